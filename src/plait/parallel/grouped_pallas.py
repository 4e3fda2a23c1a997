"""Dropless's grouped MLP on JAX's own Pallas kernels for Hopper GPUs
(`model.moe.grouped = "pallas"`).

JAX ships a grouped GEMM for sm_90 in `jax.experimental.pallas.ops.gpu`:
`ragged_dot_mgpu.ragged_dot` (rows sorted by group, each group's rows times its own
[K, N] weight; warpgroup MMAs fed by TMA; a block of rows shared by two groups is
computed for each and stored in parts) and `transposed_ragged_dot_mgpu` (per group
x_g^T dy_g: the weights' gradient). With them an expert MLP reads each expert's rows
where the sort put them: none of the tiles path's bulk buffer, spill tiles, weight
gathers, one-hot sums of the spill's gradients or size switch
(`parallel.grouped`), and no padding but the last block of a group.

XLA cannot differentiate a Pallas call, so the MLP has its own VJP: the backward
multiplies the output's gradient by each group's transposed weights (the same kernel,
`transpose_rhs`) and the rows by the gradients (the transposed kernel), keeping the
rows and the first product's output (the activation is recomputed from it).

The kernels write only the rows of the groups: rows past sum(sizes) would be left
unwritten, so this path runs where every row belongs to a group (no `expert` mesh
axis: "auto" takes the tiles there, and `tasks.gpt_runtime.check_grouped` refuses an
explicit "pallas" in one line). The kernels' tiling is `BLOCKS`
(`benchmarks/pallas_blocks.py` times candidates on a Hopper GPU; not yet tuned);
`KERNELS` is where a test puts reference products in their place (the kernels run
only on a Hopper GPU)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from plait.parallel.grouped import UP, activate, group_of
from plait.sharding import varying_like

# The kernels' tiling (ragged: the forward products and the inputs' gradients;
# transposed: the weights' gradients); a block that does not divide a dimension is
# 128 or 64 there instead (the products' dimensions are multiples of 64).
BLOCKS: dict[str, dict[str, int]] = {
    "ragged": {"block_m": 128, "block_n": 128, "block_k": 64, "max_concurrent_steps": 4,
               "grid_block_n": 1},
    "transposed": {"block_m": 128, "block_n": 128, "block_k": 64,
                   "max_concurrent_steps": 4, "grid_block_n": 1},
}
MULTIPLE = 64


def _fit(blocks: dict[str, int], **dims: int) -> dict[str, int]:
    """`blocks` with each block_<d> that does not divide dimension <d> (m, n or k) made
    128 or 64, the first that does."""
    out = dict(blocks)
    for d, size in dims.items():
        key = f"block_{d}"
        out[key] = next((b for b in (out[key], 128, MULTIPLE) if size % b == 0), MULTIPLE)
    return out


def _taken(kernel: Callable, blocks: dict[str, int]) -> dict[str, int]:
    """The block settings `kernel` takes (JAX's kernels are experimental: a JAX release
    may drop or rename one)."""
    params = inspect.signature(kernel).parameters
    return {k: v for k, v in blocks.items() if k in params}


# Each kernel call goes through one jitted function per shapes and tiling: the step's
# program then holds one lowered copy of each distinct kernel, called from every layer,
# not a Mosaic GPU module per call site (4 of mixtral-mini's layers lowered for a GPU on
# a 2-core CPU: 4.5 s and 4.1 MB of program each call site its own, 1.8 s and 1.1 MB
# so; what XLA then compiles per site on a GPU is not measured).
@functools.partial(jax.jit, static_argnames=("transpose_rhs", "blocks"))
def _ragged_call(lhs, rhs, sizes, transpose_rhs: bool, blocks: tuple):
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    kernel = ragged_dot_mgpu.ragged_dot
    return kernel(lhs, rhs, group_sizes=sizes, transpose_rhs=transpose_rhs,
                  **_taken(kernel, dict(blocks)))


@functools.partial(jax.jit, static_argnames=("blocks",))
def _transposed_call(lhs, rhs, sizes, blocks: tuple):
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

    kernel = transposed_ragged_dot_mgpu.transposed_ragged_dot
    return kernel(lhs, rhs, group_sizes=sizes, **_taken(kernel, dict(blocks)))


def _ragged(lhs: jax.Array, rhs: jax.Array, sizes: jax.Array,
            transpose_rhs: bool = False) -> jax.Array:
    """lhs [M, K] sorted by group, rhs [G, K, N] ([G, N, K] with transpose_rhs) -> [M, N]:
    each group's rows times its weight (Hopper's kernel, as BLOCKS tiles it now)."""
    blocks = _fit(BLOCKS["ragged"], k=lhs.shape[1], n=rhs.shape[1 if transpose_rhs else 2])
    return _ragged_call(lhs, rhs, sizes, transpose_rhs=transpose_rhs,
                        blocks=tuple(sorted(blocks.items())))


def _transposed(lhs: jax.Array, rhs: jax.Array, sizes: jax.Array) -> jax.Array:
    """lhs [M, K], rhs [M, N], both sorted by group -> [G, K, N]: per group lhs_g^T rhs_g
    (Hopper's kernel, as BLOCKS tiles it now)."""
    blocks = _fit(BLOCKS["transposed"], m=lhs.shape[1], n=rhs.shape[1])
    return _transposed_call(lhs, rhs, sizes, blocks=tuple(sorted(blocks.items())))


class Kernels(NamedTuple):
    ragged: Callable[..., jax.Array]
    transposed: Callable[..., jax.Array]


KERNELS = Kernels(_ragged, _transposed)


def reference_kernels() -> Kernels:
    """The kernels' results from `jax.lax.ragged_dot` (any backend): what the Hopper
    kernels are checked against, and what a CPU test runs this module's VJP with."""
    def ragged(lhs, rhs, sizes, transpose_rhs=False):
        rhs = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
        return jax.lax.ragged_dot(lhs, rhs, sizes)

    def transposed(lhs, rhs, sizes):
        # each row's group as a one-hot factor of one contraction over the rows (G x
        # the FLOPs, but plain XLA on any backend)
        group = group_of(jnp.arange(lhs.shape[0]), jnp.cumsum(sizes))
        onehot = jax.nn.one_hot(group, sizes.shape[0], dtype=lhs.dtype)
        return jnp.einsum("mg,mk,mn->gkn", onehot, lhs, rhs,
                          preferred_element_type=jnp.float32).astype(lhs.dtype)

    return Kernels(ragged, transposed)


def _hidden(pre: jax.Array, activation: str) -> jax.Array:
    """The first product's output [M, (2 x) f] -> the hidden activations [M, f]."""
    if activation == "swiglu":
        pre = pre.reshape(pre.shape[0], 2, -1)
    return activate(pre, activation)


def _kernel(name: str, like: tuple, *args, **kw) -> jax.Array:
    """KERNELS' `name` on args, its result typed as varying where any of `like` does:
    inside a shard_map a kernel's result has no varying type of its own, and the VJP's
    gradients must have their inputs' (the rows' and weights', which vary where the
    rows do)."""
    return varying_like(getattr(KERNELS, name)(*args, **kw), *like)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _mlp(x: jax.Array, up: jax.Array, w2: jax.Array, sizes: jax.Array, activation: str
         ) -> jax.Array:
    """x [M, K] through each group's up [G, K, (2 x) f], activation and w2 [G, f, K]."""
    return _mlp_fwd(x, up, w2, sizes, activation)[0]


def _mlp_fwd(x, up, w2, sizes, activation):
    like = (x, up, w2, sizes)
    pre = _kernel("ragged", like, x, up, sizes)
    y = _kernel("ragged", like, _hidden(pre, activation).astype(x.dtype), w2, sizes)
    return y, (x, pre, up, w2, sizes)


def _mlp_bwd(activation, res, dy):
    x, pre, up, w2, sizes = res
    like = (x, up, w2, sizes, dy)
    dy = dy.astype(x.dtype)
    h, pull = jax.vjp(lambda p: _hidden(p, activation), pre)
    dh = _kernel("ragged", like, dy, w2, sizes, transpose_rhs=True)
    dw2 = _kernel("transposed", like, h.astype(x.dtype), dy, sizes)
    (dpre,) = pull(dh.astype(h.dtype))
    dpre = dpre.astype(x.dtype)
    dx = _kernel("ragged", like, dpre, up, sizes, transpose_rhs=True)
    dup = _kernel("transposed", like, x, dpre, sizes)
    # a group with no rows: the transposed kernel skips it and stores its accumulator
    # as it began; its gradient is 0
    empty = (sizes == 0)[:, None, None]
    return (dx, jnp.where(empty, 0, dup).astype(up.dtype),
            jnp.where(empty, 0, dw2).astype(w2.dtype), None)


_mlp.defvjp(_mlp_fwd, _mlp_bwd)


def pallas_mlp(x: jax.Array, w: dict[str, jax.Array], sizes: jax.Array, activation: str
               ) -> jax.Array:
    """x [M, K] sorted by group, every row in one (sum(sizes) = M), weights w as
    `parallel.grouped.expert_mlp` takes them (w13 [G, K, 2, f] or w1 [G, K, f], w2
    [G, f, K]), sizes [G] -> [M, K]: each row through its group's MLP."""
    if activation not in ("swiglu", "gelu"):
        raise ValueError(f"pallas_mlp runs a SwiGLU or GELU MLP, not {activation!r}")
    # the weights vary where the rows do before the custom VJP, whose backward then
    # gives their gradients per rank (as parallel.grouped's)
    up, w2 = (varying_like(w[key], x, sizes) for key in (UP[activation], "w2"))
    up = up.reshape(up.shape[0], up.shape[1], -1)  # SwiGLU's [G, K, 2, f] as one product
    return _mlp(x, up.astype(x.dtype), w2.astype(x.dtype), sizes.astype(jnp.int32),
                activation)
