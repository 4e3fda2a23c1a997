"""Where a Pallas kernel of plait's step runs (parallel.loss_kernel, parallel.norm_kernel):
whether it can run in this trace at all, and the mesh and the tokens' layout its
shard_map takes, with whether Pallas's interpreter stands in for the GPU; and the block
width its Triton lowering takes."""

from __future__ import annotations

from dataclasses import dataclass

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from plait.sharding import active, spec


def usable() -> bool:
    """Whether a kernel runs here: not inside another shard_map (a pipeline's body), where
    the models keep XLA's form (a Pallas call nested in a partly manual shard_map is not
    tested, and its interpreter's types there are not JAX's)."""
    context = jax.sharding.get_abstract_mesh()
    return context.empty or not context.manual_axes


@dataclass(frozen=True)
class Placement:
    """The mesh and the tokens' axes of an activation [batch, seq, ...] as plait's step
    lays it out (None outside the step), and whether in Pallas's interpreter (the step's
    devices are CPUs). A kernel whose backward is traced after the step has left
    `sharding.use` takes its placement from the forward's trace."""
    mesh: Mesh | None
    tokens: P | None
    interpret: bool

    def token_axes(self) -> tuple[str, ...]:
        """The mesh axes the tokens are split over, flattened: each device's rows of a
        per-device result stacked across them (a kernel's partial sums or maxima)."""
        return tuple(a for part in self.tokens or () if part is not None
                     for a in (part if isinstance(part, tuple) else (part,)))


def placement(ndim: int) -> Placement:
    """Where a kernel over an activation of `ndim` dimensions (its last one whole on each
    device) runs, from the active `sharding.use`."""
    ctx = active()
    # compiled for the step's devices (a CPU may compile for a GPU: gpu_census.py)
    platform = ctx[0].devices.flat[0].platform if ctx else jax.default_backend()
    if ctx is None:
        return Placement(None, None, platform == "cpu")
    mesh, rules = ctx
    return Placement(mesh, spec(("act_batch", "act_seq")[:ndim - 1], rules, mesh),
                     platform == "cpu")


def pow2(n: int) -> int:
    """The smallest power of two >= n: a block's width (Triton's blocks are powers of
    two; the columns past n are masked)."""
    return 1 << max(0, (n - 1).bit_length())
