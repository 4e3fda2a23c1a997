"""`plait launch --processes P -- train ...`: P local processes joined by jax.distributed.

Each process runs the same plait command with --coordinator, --num-processes
and --process-id added (gloo collectives on CPU; each simulates its share of
the mesh's devices). Process 0's output is shown; the others' only if they
fail. The first failure's status is returned, and the rest are stopped.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading

from plait.errors import UserError

LAUNCHABLE = ("train", "inspect", "plan")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(processes: int, command: list[str], port: int | None = None) -> int:
    if command and command[0] == "--":
        command = command[1:]
    if processes < 1:
        raise UserError(f"--processes must be at least 1, got {processes}")
    if not command or command[0] not in LAUNCHABLE:
        raise UserError("plait launch needs a command after --, one of "
                        f"{', '.join(LAUNCHABLE)} (e.g. plait launch --processes 2 -- train "
                        "EXP --mesh data=8)")
    if any(a.startswith(("--coordinator", "--num-processes", "--process-id")) for a in command):
        raise UserError("plait launch sets --coordinator, --num-processes and --process-id "
                        "itself; drop them from the command")
    address = f"127.0.0.1:{port or _free_port()}"
    procs = []
    for i in range(processes):
        argv = [sys.executable, "-m", "plait", *command, "--coordinator", address,
                "--num-processes", str(processes), "--process-id", str(i)]
        procs.append(subprocess.Popen(
            argv, stdout=None if i == 0 else subprocess.PIPE,
            stderr=None if i == 0 else subprocess.STDOUT, text=True))
    captured = [""] * processes

    def drain(i: int) -> None:
        captured[i] = procs[i].communicate()[0] or ""

    threads = [threading.Thread(target=drain, args=(i,), daemon=True)
               for i in range(1, processes)]
    for t in threads:
        t.start()
    status = 0
    try:
        rc0 = procs[0].wait()
        for t in threads:
            t.join()
        codes = [rc0] + [p.returncode for p in procs[1:]]
    except KeyboardInterrupt:
        for p in procs:
            p.terminate()
        return 130
    for i, rc in enumerate(codes):
        if rc and not status:
            status = rc
            if i:
                print(f"plait: process {i} failed (exit {rc}):\n{captured[i][-3000:]}",
                      file=sys.stderr)
    return status
