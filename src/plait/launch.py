"""`plait launch --processes P -- train ...`: P local processes joined by jax.distributed.

Each process runs the same plait command with --coordinator, --num-processes
and --process-id added (gloo collectives on CPU; each simulates its share of
the mesh's devices). Process 0's output is shown; the others' only if they
fail. The first failure is reported in one line and its status returned; the others
end by themselves when they lose it as a peer (plait.supervise), or are killed
after the heartbeat timeout and a margin.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

from plait.cli_args import parser, subcommands
from plait.cluster import check_port
from plait.errors import UserError

LAUNCHABLE = ("train", "inspect", "plan", "eval")


def free_port() -> int:
    """A TCP port on localhost no one listens on now (for a coordinator)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(processes: int, command: list[str], port: int | None = None) -> int:
    if command and command[0] == "--":
        command = command[1:]
    if processes < 1:
        raise UserError(f"--processes must be at least 1, got {processes}")
    if command and command[0] == "plait" and command[1:2] and command[1] in LAUNCHABLE:
        raise UserError(f"plait launch takes the command without 'plait': drop it after -- "
                        f"(plait launch --processes {processes} -- {' '.join(command[1:3])} ...)")
    if command and command[0] not in LAUNCHABLE and command[0] in subcommands(parser()):
        raise UserError(f"plait {command[0]} runs in one process; run it without plait "
                        f"launch (plait launch starts {', '.join(LAUNCHABLE)})")
    if not command or command[0] not in LAUNCHABLE:
        raise UserError("plait launch needs a command after --, one of "
                        f"{', '.join(LAUNCHABLE)} (e.g. plait launch --processes 2 -- train "
                        "EXP --mesh data=8)")
    if any(a.startswith(("--coordinator", "--num-processes", "--process-id")) for a in command):
        raise UserError("plait launch sets --coordinator, --num-processes and --process-id "
                        "itself; drop them from the command")
    if port:  # 0 or none: a free one
        check_port(port, f"--port {port}")
    address = f"127.0.0.1:{port or free_port()}"
    procs = []
    for i in range(processes):
        argv = [sys.executable, "-m", "plait", *command, "--coordinator", address,
                "--num-processes", str(processes), "--process-id", str(i)]
        procs.append(subprocess.Popen(
            argv, stdout=None if i == 0 else subprocess.PIPE,
            stderr=subprocess.PIPE if i == 0 else subprocess.STDOUT, text=True,
            start_new_session=True))  # a terminal's Ctrl-C reaches the launcher alone
    captured: list[list[str]] = [[] for _ in range(processes)]

    def drain(i: int) -> None:
        """Keep each child's lines; process 0's error stream is also shown as it comes."""
        stream = procs[i].stderr if i == 0 else procs[i].stdout
        for line in stream:
            captured[i].append(line)
            if i == 0 and not line.startswith("plait: error:"):  # errors: one line, below
                sys.stderr.write(line)
                sys.stderr.flush()

    threads = [threading.Thread(target=drain, args=(i,), daemon=True)
               for i in range(processes)]
    for t in threads:
        t.start()

    def forward(signum, frame) -> None:  # each child saves and stops (or, again, waits)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    _wait_for_end(procs)
    for t in threads:
        t.join()
    failures = []
    for i, p in enumerate(procs):
        if p.returncode:
            lines = [x.strip() for x in captured[i] if x.strip()]
            said = next((x for x in reversed(lines) if x.startswith("plait: error:")),
                        lines[-1] if lines else "no output")
            failures.append((i, p.returncode, said.removeprefix("plait: error: ")))
    if not failures:
        return 0
    # The cause, not its echoes: a process that lost its peer says so; the one that
    # failed for itself (or was killed) is the one to report.
    # A process killed by a signal is a cause whatever its last words were (its trainer
    # may have outlived it long enough to report losing the others).
    echo = ("lost another process", "lost contact with another process")
    killed = [(i, rc, f"killed ({signal.Signals(-rc).name})") for i, rc, _ in failures
              if rc < 0 and -rc in signal.valid_signals()]
    i, rc, said = killed[0] if killed else next(
        (f for f in failures if not any(e in f[2] for e in echo)), failures[0])
    same = len(failures) == len(procs) and len({f[2] for f in failures}) == 1 and rc > 0
    if len(failures) == 1 and i == 0 or same:  # one process's, or every process's mistake
        print(f"plait: error: {said}", file=sys.stderr)
    else:
        print(f"plait: error: process {i} of {len(procs)} failed first (exit {rc}): {said}",
              file=sys.stderr)
    return rc if rc > 0 else 1


def _wait_for_end(procs) -> None:
    """Wait for every child; after the first failure the others get the heartbeat
    timeout and a margin to end by themselves (they lose their peer), then are killed."""
    deadline = None
    while any(p.poll() is None for p in procs):
        if deadline is None and any(p.returncode not in (None, 0) for p in procs):
            deadline = time.monotonic() + _grace()
        if deadline is not None and time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.1)


def _grace() -> float:
    try:
        return float(os.environ.get("PLAIT_HEARTBEAT_TIMEOUT_S", "30")) + 30.0
    except ValueError:
        return 60.0
