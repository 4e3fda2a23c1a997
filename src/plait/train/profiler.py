"""`plait train --profile START:STOP`: a jax.profiler trace of a window of steps."""

from __future__ import annotations

from pathlib import Path

import jax

from plait.errors import UserError
from plait.train.metrics import MetricsLog


def check_window(window: tuple[int, int] | None, start: int, total: int
                 ) -> tuple[tuple[int, int] | None, str | None]:
    """(the steps the run can trace of a --profile window, a note where that is not all
    of it), before the step is compiled. A window past the run's end is refused; one a
    resumed run has passed is said, not refused: a preempted run is rerun with the same
    command, which must go on."""
    if window is None:
        return None, None
    first, stop = window
    text = f"--profile {first}:{stop}"
    if first >= total:
        raise UserError(f"{text} would trace steps {first + 1}-{stop}, but the run ends at "
                        f"step {total}; pick a window before it or raise --steps")
    if stop <= start:
        return None, (f"plait: {text} traces nothing: this run resumes at step {start}, "
                      "after the window")
    traced = (max(first, start), min(stop, total))
    if traced == window:
        return window, None
    why = "; ".join(w for w in (f"the run resumes at step {start}" if first < start else "",
                                f"it ends at step {total}" if stop > total else "") if w)
    return traced, f"plait: {text} traces steps {traced[0] + 1}-{traced[1]}: {why}"


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
