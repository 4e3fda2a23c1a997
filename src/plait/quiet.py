"""Keep the console for plait's own lines: what `plait` and each process it starts
for a measurement (`plait.sweep.isolated`) set up before anything else."""

from __future__ import annotations

import logging
import os
import sys


def quiet_libraries() -> None:
    """Keep the console for plait's own lines. Libraries' warnings and errors (orbax's
    tracebacks from a failed save, a corrupt checkpoint's ignored coroutines) go only to
    RUN_DIR/plait.log once a run directory is open (`plait.train.rundir.open_log`)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        import absl.logging

        absl.logging.set_verbosity(absl.logging.WARNING)
    except ImportError:  # pragma: no cover
        pass
    logging.basicConfig(format="plait: %(levelname)s: %(message)s", level=logging.WARNING)
    for handler in logging.getLogger().handlers:
        handler.addFilter(lambda r: r.name == "plait" or r.name.startswith("plait."))
    logging.captureWarnings(True)  # Python warnings become log records (py.warnings)
    sys.unraisablehook = unraisablehook
    for name in ("orbax", "absl", "jax"):
        logging.getLogger(name).setLevel(logging.WARNING)


def unraisablehook(unraisable) -> None:
    """Errors native code reports after the fact (TensorStore completing a failed save's
    write on an asyncio loop that orbax already closed) go to the log file, not the
    console; anything else is printed as Python would."""
    value = unraisable.exc_value
    if isinstance(value, RuntimeError) and str(value) == "Event loop is closed":
        logging.getLogger("orbax.late").warning(
            "late error of a failed save",
            exc_info=(unraisable.exc_type, value, unraisable.exc_traceback))
        return
    sys.__unraisablehook__(unraisable)
