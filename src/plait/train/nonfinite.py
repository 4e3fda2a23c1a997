"""train.on_nonfinite: what a step whose loss or gradient norm is NaN or Inf does to a
run ("stop" or "skip"), tracked on the device and read where the loop syncs anyway."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from plait import cluster
from plait.errors import RunFailed

if TYPE_CHECKING:
    from plait.train.run import Run


@jax.jit
def _first_nonfinite(first: jax.Array, metrics: dict, step: jax.Array) -> jax.Array:
    """The first step whose loss or gradient norm was NaN or Inf (-1: none yet); kept on
    the device and read only where the loop syncs anyway (log steps, saves)."""
    bad = ~(jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"]))
    # Per replica where the metrics are (local SGD): no reduction over replicas per step.
    return jnp.where((first < 0) & bad, step, first)


@functools.partial(jax.jit, static_argnums=3)
def _count_skips(counts: jax.Array, skipped: jax.Array, step: jax.Array,
                 max_skipped: int) -> jax.Array:
    """[skipped in a row, skipped in all, first step past max_skipped in a row (-1)]."""
    row = jnp.where(skipped > 0, counts[0] + 1, 0)
    over = jnp.where((counts[2] < 0) & (row > max_skipped), step, counts[2])
    return jnp.stack([row, counts[1] + skipped, over])


def _first_step(first: jax.Array) -> int:
    """The earliest bad step over replicas (-1: none), read on the host."""
    seen = cluster.host_array(first)
    seen = seen[seen >= 0]
    return int(seen.min()) if seen.size else -1


class NonFiniteGuard:
    """train.on_nonfinite: "stop" ends the run, before anything of the bad state is saved,
    once a step's loss or gradient norm is non-finite (the last good checkpoint stays the
    newest); "skip" counts the steps whose update the step left out (train.step.
    skipping_nonfinite) and ends the run after more than train.max_skipped in a row."""

    def __init__(self, mesh: Mesh, policy: str = "stop", max_skipped: int = 0):
        rep = NamedSharding(mesh, P())
        self.policy, self.max_skipped = policy, max_skipped
        self.first = jax.device_put(np.int32(-1), rep)
        self.counts = jax.device_put(np.array([0, 0, -1], np.int32), rep)

    def after(self, metrics: dict, step: int) -> None:
        if self.first.shape != metrics["loss"].shape:  # one per replica (local SGD)
            self.first = jax.device_put(np.full(metrics["loss"].shape, -1, np.int32),
                                        metrics["loss"].sharding)
        if self.policy == "skip":
            self.counts = _count_skips(self.counts, metrics["skipped"], np.int32(step),
                                       self.max_skipped)
        else:
            self.first = _first_nonfinite(self.first, metrics, np.int32(step))

    def skipped(self) -> int:
        """Steps skipped so far in this invocation (a sync: call where the loop syncs)."""
        return int(np.asarray(self.counts.addressable_shards[0].data)[1])

    def check(self, run: Run) -> None:
        if self.policy == "skip":
            row, total, over = (int(x) for x in np.asarray(self.counts.addressable_shards[0]
                                                           .data))
            if over < 0:
                return
            kept = (f"the checkpoint at step {run.last_saved} is intact (it holds the state "
                    "before the skipped steps)" if run.last_saved is not None
                    else "no checkpoint was written")
            raise RunFailed(
                f"{self.max_skipped + 1} steps in a row (through step {over}) had a "
                f"non-finite loss or gradient norm and were skipped ({total} in all), more "
                f"than train.max_skipped = {self.max_skipped}; {kept}: lower optimizer.lr "
                "(or check the data) and rerun the same command to resume")
        bad = _first_step(self.first)
        if bad < 0:
            return
        kept = (f"the checkpoint at step {run.last_saved} is intact: lower optimizer.lr (or "
                "check the data), then rerun the same command to resume from it"
                if run.last_saved is not None else "no checkpoint was written: lower "
                "optimizer.lr (or check the data) and run again")
        raise RunFailed(f"the loss or gradient norm became non-finite (NaN or Inf) at step "
                        f"{bad}; stopped without saving that state; {kept} (or set "
                        'train.on_nonfinite = "skip" to skip such steps)')
