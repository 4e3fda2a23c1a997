"""`plait sweep --run` trains each shape in a Python process of its own.

A measured step time must be the one `plait train` gives the shape, and `plait train`
starts a fresh process. A training after others in one process need not run as fast:
on an H200 on 2026-11-27, gpt2-1.3b's FP8 step trained after its bf16 run in one
process took 363 ms, and 240 ms in a `plait train` of its own (docs/benchmarks.md, "An
eighth GPU session"). A fresh process also gets the device's memory whole (not what an
earlier shape's allocator kept), and a shape whose process dies (the system's
out-of-memory killer, an XLA abort) is said in one line while the other shapes still
run, as the compile workers of `plait.sweep.run` already do for compiles.

The process is started with `spawn`: it sets up as `plait` does (quiet libraries, the
same JAX options and devices as this process), trains, and sends back what
`run.train_one` returns. This process keeps no accelerator memory for itself
(`leave_device_memory`), so the training process can take its usual share.
"""

from __future__ import annotations

import os
import signal
import traceback
from collections.abc import Callable
from typing import Any

# JAX options that decide which devices a process has and whether compiles are cached:
# a training process takes this process's values (an environment variable is inherited).
JAX_OPTIONS = ("jax_platforms", "jax_num_cpu_devices", "jax_compilation_cache_dir",
               "jax_persistent_cache_min_compile_time_secs",
               "jax_persistent_cache_min_entry_size_bytes")
PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"
# What the training processes' environment differs in from this process's (a variable
# mapped to None is unset there): filled by `leave_device_memory`.
_THEIR_ENV: dict[str, str | None] = {}


class ProcessDied(Exception):
    """The process ended without an answer (killed, or aborted by native code)."""


class ProcessRaised(Exception):
    """What the function raised in its process: the exception's last line, its traceback
    already printed there."""


def leave_device_memory() -> None:
    """Before this process starts a backend: keep it from taking an accelerator's memory
    up front (JAX's GPU allocator takes 75% of it when it starts), leaving that to the
    training processes, which start as the user's environment says. Nothing once a
    backend runs (the variable is read when it starts); no effect on CPUs."""
    from plait.mesh import backend_started

    if backend_started() or PREALLOCATE in _THEIR_ENV:
        return
    _THEIR_ENV[PREALLOCATE] = os.environ.get(PREALLOCATE)
    os.environ[PREALLOCATE] = "false"


def _start(options: dict[str, Any], environ: dict[str, str | None], devices: int) -> None:
    """A fresh process's set-up: `plait`'s quiet libraries and XLA flags (inherited with
    the environment), the environment and JAX options of the process that started it,
    and its devices (`devices` on the mesh of `plait sweep --devices`)."""
    from plait import quiet

    quiet.quiet_libraries()
    for key, value in environ.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    import jax

    from plait import mesh as mesh_lib

    for key, value in options.items():
        jax.config.update(key, value)
    mesh_lib.provision_devices(mesh_lib.MeshSpec({"data": devices}, "--devices"), devices)


def _child(conn, options: dict, environ: dict, devices: int, fn: Callable, args: tuple) -> None:
    try:
        _start(options, environ, devices)
        conn.send(("returned", fn(*args)))
    except KeyboardInterrupt:  # Ctrl-C reached this process's group: the parent says it
        os._exit(130)
    except BaseException as e:  # noqa: BLE001 - any failure goes back as one line
        traceback.print_exc()
        conn.send(("raised", "".join(traceback.format_exception_only(e)).strip()))
    finally:
        conn.close()


def _died(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        name = signal.Signals(-exitcode).name
        why = (" (the system's out-of-memory killer, if memory ran out)"
               if name == "SIGKILL" else "")
        return f"its process was killed by {name}{why}"
    return f"its process ended with status {exitcode} without an answer"


def call(fn: Callable, *args, devices: int) -> Any:
    """fn(*args) in a fresh process set up like this one with `devices` devices: what it
    returns (picklable); ProcessRaised with the exception's last line if it raises (its
    traceback printed on stderr), ProcessDied if the process ends without an answer.
    Ctrl-C here ends the process too."""
    from multiprocessing import get_context

    import jax

    ctx = get_context("spawn")
    options = {k: getattr(jax.config, k) for k in JAX_OPTIONS if hasattr(jax.config, k)}
    mine, theirs = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(theirs, options, dict(_THEIR_ENV), devices, fn,
                                            args))
    proc.start()
    theirs.close()  # the process's end: EOF here once it exits
    try:
        try:
            kind, value = mine.recv()
        except EOFError:
            proc.join()
            raise ProcessDied(_died(proc.exitcode)) from None
        proc.join()
    finally:
        mine.close()
        if proc.is_alive():  # interrupted here
            proc.terminate()
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if kind == "raised":
        raise ProcessRaised(value)
    return value
