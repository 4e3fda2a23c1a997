"""An XLA runtime error in the compiled step, as the one line a user reads: what failed,
what to try, what is kept (a lost peer of a multi-process run named as such)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax

from plait.errors import RunFailed
from plait.train.memory import out_of_memory

if TYPE_CHECKING:
    from plait.train.run import Run

# What a collective says when the process at the other end is gone (Gloo on CPU).
_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
              "Socket closed", "Connection refused")


def step_failed(run: Run, step: int, err: Exception) -> RunFailed:
    """One line for an XLA runtime error in the step: what failed, what to try, what is kept."""
    first = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
    kept = (f"the checkpoint at step {run.last_saved} is intact" if run.last_saved is not None
            else "no checkpoint was written")
    if jax.process_count() > 1 and any(s in str(err) for s in _PEER_LOST):
        return RunFailed(f"process {jax.process_index()} of this {jax.process_count()}-process "
                         f"run lost another process at step {step + 1} ({first}); {kept}: "
                         "rerun the same command on every process to resume")
    hint = ""
    if out_of_memory(err):
        hint = f"; the device ran out of memory: {run.task.memory_fixes()}"
    elif getattr(run.task, "attention", None) == "cudnn":
        hint = '; if it is the attention kernel, retry with --set model.attention="xla"'
    kept += ": rerun the same command to resume" if run.last_saved is not None else ""
    return RunFailed(f"the train step failed at step {step + 1}: {first}{hint}; {kept}")
