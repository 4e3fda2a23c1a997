"""One writer per run directory: a second `plait train` on a directory in use refuses.

Process 0 of a run holds an exclusive `flock` on RUN_DIR/plait.lock for as long as
the run lasts (the other processes of a multi-process run share its directory and
take no lock). The kernel drops the lock when the process ends however it ends
(kill -9 included), so a stale lock cannot exist; the file keeps the holder's pid
and host for the refusal message.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from plait.errors import UserError

_HELD: dict[Path, int] = {}  # run directory -> this process's locked descriptor


def acquire(run_dir: Path) -> None:
    path = (run_dir / "plait.lock").resolve()
    release(run_dir)  # a run of this process that ended without closing
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise UserError(f"run directory '{run_dir}' is in use by another plait train "
                        f"({holder}); wait for it to end or pick another --run-dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    _HELD[path] = fd


def release(run_dir: Path) -> None:
    fd = _HELD.pop((run_dir / "plait.lock").resolve(), None)
    if fd is not None:
        os.close(fd)  # closing drops the flock
