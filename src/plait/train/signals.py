"""SIGTERM/SIGINT during `plait train`: save and stop; wait; stop at once."""

from __future__ import annotations

import os
import signal
import threading
from typing import TYPE_CHECKING

from plait.train import rundir

if TYPE_CHECKING:
    from plait.train.run import Run


class StopFlag:
    """SIGTERM/SIGINT handling. The first signal asks the loop to save a checkpoint at the
    next step boundary and end; a second one is told that the step and the save are
    being finished; a third ends the run at once, removing the unfinished checkpoint, so
    the newest finished one is what a rerun resumes from. Nothing here raises into the
    main thread, which may be inside orbax: that is what used to leave tracebacks,
    hangs and `-tmp` directories."""

    def __init__(self, run: Run | None = None) -> None:
        self.signal: int | None = None
        self.count = 0
        self.run = run
        self._old = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old[sig] = signal.signal(sig, self._handle)

    @staticmethod
    def _say(text: str) -> None:
        os.write(2, f"plait: {text}\n".encode())  # safe inside a signal handler

    def _handle(self, signum, frame) -> None:
        self.count += 1
        name = signal.Signals(signum).name
        if self.count == 1:
            self.signal = signum
            self._say(f"{name}: saving a checkpoint after this step, then stopping")
            return
        if self.count == 2:
            what = ("a checkpoint is being written" if self.run is not None
                    and self.run.saving() else "finishing the step, then saving")
            self._say(f"{name} again: {what}; signal a third time to stop at once without "
                      "saving (the checkpoint before stays)")
            return
        self._abandon(name)

    def _late(self, signum, frame) -> None:
        self._abandon(signal.Signals(signum).name, "stopped while exiting")

    def _abandon(self, name: str, what: str = "stopped without saving") -> None:
        kept = "no checkpoint was written"
        if self.run is not None and self.run.is_writer:
            # orbax's and TensorStore's writer threads run on while this handler does: a
            # directory they are filling can survive one rmtree (a file made
            # mid-removal), or be re-made. Remove until 0.3 s pass with none re-made.
            rundir.remove_partial_checkpoints(self.run.ckpt_dir, quiet_s=0.3, limit_s=3.0)
            steps = rundir.committed_steps(self.run.ckpt_dir)
            if steps:
                kept = (f"the checkpoint at step {steps[0]} is intact: rerun the same command "
                        "to resume from it")
        self._say(f"{name}: {what}; {kept}")
        os._exit(130)  # threads may be mid-write; the kernel drops the run's lock

    def restore(self) -> None:
        """The handlers before install. Once a stop was asked for, a further signal while
        the process winds down ends it at once in one line instead: the default handler
        raises KeyboardInterrupt wherever the main thread is, and inside a garbage
        collector's callback Python prints that as a traceback and goes on."""
        for sig, handler in self._old.items():
            signal.signal(sig, self._late if self.count else handler)
        self._old = {}
