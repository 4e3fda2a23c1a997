"""`plait train --profile START:STOP`: a jax.profiler trace of a window of steps."""

from __future__ import annotations

from pathlib import Path

import jax

from plait.errors import UserError
from plait.train.metrics import MetricsLog


def check_window(window: tuple[int, int] | None, start: int, total: int) -> str | None:
    """Refuse a --profile window this run will not reach (it resumes past its start, or
    ends before it) before the step is compiled; a note where the run ends inside it."""
    if window is None:
        return None
    first, stop = window
    text = f"--profile {first}:{stop}"
    if first < start:
        raise UserError(f"{text} would trace steps {first + 1}-{stop}, but this run resumes "
                        f"at step {start}; pick a window after it (e.g. --profile "
                        f"{start}:{start + min(stop - first, 5)})")
    if first >= total:
        raise UserError(f"{text} would trace steps {first + 1}-{stop}, but the run ends at "
                        f"step {total}; pick a window before it or raise --steps")
    if stop > total:
        return (f"plait: {text} traces steps {first + 1}-{total}: the run ends at step "
                f"{total}")
    return None


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
            self._end(step, state)

    def close(self, step: int | None = None, state=None) -> None:
        """End a trace the window's end did not: the run ended or stopped inside it
        (`step`: where; its trace is written and said), or failed (None: dropped)."""
        if self.on and step is not None:
            self._end(step, state)
        elif self.on:
            jax.profiler.stop_trace()
            self.on = False

    def _end(self, step: int, state) -> None:
        jax.block_until_ready(state)
        jax.profiler.stop_trace()
        self.on = False
        self.log.note(f"plait: profile of steps {self.window[0] + 1}-{step} written to "
                      f"{self.dir} (tensorboard --logdir {self.dir}, or XProf / Perfetto)")
