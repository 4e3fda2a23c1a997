"""A supervisor for each process of a multi-process run, so a lost peer ends in one line.

When one process of a jax.distributed run dies, the others learn it from JAX's
coordination service, whose C++ client then aborts the process with a fatal
log and a stack trace (exit 134): Python never gets control, so the process
cannot say anything itself. (jaxlib 0.10's client takes an error callback, but
calling it with the error status throws std::bad_cast, another abort.) A
process blocked in a collective with the dead one usually learns it first, from
the collective's own error (Gloo: connection reset), which the loop reports in
one line; the abort is for the rest (compiling, saving, the coordinator gone).

So `plait train|inspect|plan` joining a multi-process run re-executes itself as
a child of a small supervisor that imports no JAX. The supervisor relays the
child's output, keeps native noise (Gloo's connection lines, absl logs, abort
traces) out of the console and in RUN_DIR/native-<process>.log, forwards
SIGINT/SIGTERM once, and, if the child is aborted or killed, prints the one line:
which process, why, and to rerun the same command on every process. The child
dies with the supervisor (PR_SET_PDEATHSIG), so `kill -9` of the pid a user or
scheduler knows leaves nothing behind.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

SUPERVISED = "PLAIT_SUPERVISED"
# Native lines (not plait's): Gloo's connection notes (whole, or torn apart by its
# threads), absl log entries and their continuation lines, abort traces.
_NOISE = re.compile(
    r"^(\[Gloo\]|.*is connected to \d+ peer ranks|\s*\d+\s*$|[EWIF]\d{4} \d\d:\d\d:\d\d|"
    r"\*\*\* Check failure|\s+@\s+0x|terminate called|\s*what\(\):|WARNING: All log "
    r"messages before absl|Additional GRPC error|:UNKNOWN:|RPC: /xla|The tasks have crashed)")
# Lines that end a run of native continuation lines: plait's own, and Python's.
_OWN = re.compile(r"^(plait: |step\s+\d|Traceback |\S+Error\b)")

def needed(argv: list[str]) -> bool:
    """Whether this invocation joins a multi-process run and is not yet supervised."""
    from plait.launch import LAUNCHABLE

    if os.environ.get(SUPERVISED) == "1" or not argv or argv[0] not in LAUNCHABLE:
        return False
    from plait.cluster import from_environment

    return from_environment() or any(a == "--coordinator" or a.startswith("--coordinator=")
                              for a in argv)


def _flag(argv: list[str], name: str) -> str | None:
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def _run_dir(argv: list[str]) -> Path | None:
    """Where the child writes (its --run-dir, or runs/<name>), for the native log."""
    if argv[0] != "train":
        return None
    if (given := _flag(argv, "--run-dir")) is not None:
        return Path(given)
    try:
        from plait.config_files import load_experiment

        sets = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--set"]
        return Path("runs") / load_experiment(argv[1], sets).name
    except Exception:  # noqa: BLE001 - the child reports a bad experiment itself
        return None


def _child_setup() -> None:
    """In the child before exec (the supervisor has no threads): its own process group,
    so a terminal's Ctrl-C reaches the supervisor only and is passed on once; and
    SIGKILL when the supervisor dies (Linux's PR_SET_PDEATHSIG)."""
    os.setpgid(0, 0)
    with contextlib.suppress(OSError, AttributeError):  # not Linux
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)


def supervise(argv: list[str]) -> int:
    """Run `plait ARGV` as a child; returns the status to exit with."""
    process = _flag(argv, "--process-id") or os.environ.get("SLURM_PROCID") or "?"
    env = {**os.environ, SUPERVISED: "1"}
    # stdout is relayed (and filtered) only when it is not a terminal: a terminal stays
    # the child's own, for its progress bar.
    pipe_out = not sys.stdout.isatty()
    child = subprocess.Popen([sys.executable, "-m", "plait", *argv], env=env,
                             stdout=subprocess.PIPE if pipe_out else None,
                             stderr=subprocess.PIPE, text=True, errors="replace",
                             bufsize=1, preexec_fn=_child_setup)

    def forward(signum, frame) -> None:
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    noise: collections.deque[str] = collections.deque(maxlen=5000)

    def relay(stream, out) -> None:
        native = False  # inside a multi-line native message
        for line in stream:
            native = bool(_NOISE.match(line)) or (native and not _OWN.match(line))
            if native:
                noise.append(line)
            else:
                out.write(line)
                out.flush()

    readers = [threading.Thread(target=relay, args=(child.stderr, sys.stderr), daemon=True)]
    if pipe_out:
        readers.append(threading.Thread(target=relay, args=(child.stdout, sys.stdout),
                                        daemon=True))
    for r in readers:
        r.start()
    for r in readers:
        r.join()
    status = child.wait()
    run_dir = _run_dir(argv)
    log = None
    if noise and run_dir is not None and run_dir.is_dir():
        log = run_dir / f"native-{process}.log"
        try:
            with open(log, "a") as f:
                f.writelines(noise)
        except OSError:
            log = None
    if status >= 0 and status != 134:
        return status
    if status == -signal.SIGKILL:
        why = "it was killed (SIGKILL)"
    elif status in (134, -signal.SIGABRT):
        why = ("it lost contact with another process of the run (JAX's coordination "
               "service aborted it)")
    else:
        why = f"it was ended by {signal.Signals(-status).name}"
    where = f"; native messages in {log}" if log else ""
    sys.stderr.write(f"plait: error: process {process} of the multi-process run stopped: "
                     f"{why}; rerun the same command on every process to resume from the "
                     f"newest checkpoint{where}\n")
    return 1
