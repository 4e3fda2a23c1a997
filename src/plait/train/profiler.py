"""`plait train --profile START:STOP`: a jax.profiler trace of a window of steps."""

from __future__ import annotations

from pathlib import Path

import jax

from plait.train.metrics import MetricsLog


class Profiler:
    """A jax.profiler trace of steps [start, stop) into RUN_DIR/profile: the XPlane file
    that TensorBoard's profile plugin and XProf read, and perfetto_trace.json.gz, which
    ui.perfetto.dev (or a script) reads with nothing installed."""

    def __init__(self, window: tuple[int, int] | None, run_dir: Path, log: MetricsLog):
        self.window, self.dir, self.log, self.on = window, run_dir / "profile", log, False

    def before(self, step: int) -> None:
        """Called before running step `step` + 1."""
        if self.window and step == self.window[0] and not self.on:
            jax.profiler.start_trace(str(self.dir), create_perfetto_trace=True)
            self.on = True

    def after(self, step: int, state) -> None:
        """Called after `step` steps have run."""
        if self.on and step >= self.window[1]:
            jax.block_until_ready(state)
            jax.profiler.stop_trace()
            self.on = False
            self.log.note(f"plait: profile of steps {self.window[0] + 1}-{step} written to "
                          f"{self.dir} (tensorboard --logdir {self.dir}, or XProf / Perfetto)")

    def close(self) -> None:
        if self.on:
            jax.profiler.stop_trace()
            self.on = False
