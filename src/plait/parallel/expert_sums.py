"""Sums across the ranks of a mixture-of-experts layer that survive bfloat16 on XLA:CPU.

XLA:CPU aborts compiling a bfloat16 all-reduce or reduce-scatter as JAX writes them
(its AllReducePromotion cannot clone a reducer that JAX ends in a copy: "Invalid
binary instruction opcode copy"), so each sum here of a narrow float goes another way
-- in float32, or as an all-to-all of the slices added up in float32 -- which also
rounds once, not once per rank. `parallel.experts` uses them: the expert weights'
gradients over the row axes and the tokens' over the axis that splits the experts'
hidden units (`per_rank`), the tokens' all-gather over `expert` and its
reduce-scatter back (`gather`, `sum_scatter`), and the hidden slices' outputs
(`from_slices`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def narrow(x: jax.Array) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize < 4


def sum_scatter(y: jax.Array, axis: str) -> jax.Array:
    """psum_scatter(y, axis, scatter_dimension=0, tiled=True). In a narrow float the same
    bytes go by one all-to-all (each rank's slice for every other) and are summed here in
    float32: XLA:CPU aborts compiling a bfloat16 reduce-scatter as JAX writes it (the
    reducer `per_rank` avoids), and the sum rounds once, not once per rank."""
    if not narrow(y):
        return jax.lax.psum_scatter(y, axis, scatter_dimension=0, tiled=True)
    X = jax.lax.axis_size(axis)
    parts = jax.lax.all_to_all(y.reshape(X, -1, *y.shape[1:]), axis, 0, 0, tiled=True)
    return jnp.sum(parts, axis=0, dtype=jnp.float32).astype(y.dtype)


def all_sum(y: jax.Array, axes: tuple[str, ...], f32: bool) -> jax.Array:
    """psum(y, axes); with `f32` (XLA:CPU) a narrow float is summed in float32: XLA:CPU
    aborts compiling the bfloat16 psum JAX writes, and promotes
    every bfloat16 all-reduce to float32 anyway (the same bytes). A GPU sums in y's
    dtype, as GSPMD's all-reduces of the dense layers do."""
    if f32 and narrow(y):
        return jax.lax.psum(y.astype(jnp.float32), axes).astype(y.dtype)
    return jax.lax.psum(y, axes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def per_rank(x: jax.Array, axes: tuple[str, ...], f32: bool = True) -> jax.Array:
    """x, the same on every rank of `axes` inside a shard_map, used by each rank on its
    own (its rows; its slice of the hidden units): its gradient, partial per rank, is
    summed over `axes` here (`all_sum`; with `f32`, a narrow float in float32). Left
    implicit, that sum is an all-reduce in the compute dtype whose reducer JAX ends in
    a copy, and XLA:CPU aborts compiling a bfloat16 one: a bf16 MoE with an expert axis
    beside data or fsdp could not compile. The expert weights' gradients are summed in
    float32 everywhere: that rounds once, not once per rank, at twice the bytes."""
    return jax.lax.pcast(x, axes, to="varying")


def _per_rank_fwd(x, axes, f32):
    return per_rank(x, axes, f32), None


def _per_rank_bwd(axes, f32, _, ct):
    return (all_sum(ct, axes, f32),)


per_rank.defvjp(_per_rank_fwd, _per_rank_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def from_slices(y: jax.Array, axes: tuple[str, ...], f32: bool) -> jax.Array:
    """The partial outputs of the ranks' hidden slices summed (`all_sum`); the
    gradient goes to every slice as it is."""
    return all_sum(y, axes, f32)


def _from_slices_fwd(y, axes, f32):
    return from_slices(y, axes, f32), None


def _from_slices_bwd(axes, f32, _, ct):
    return (jax.lax.pcast(ct, axes, to="varying"),)


from_slices.defvjp(_from_slices_fwd, _from_slices_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def gather(a: jax.Array, axis: str) -> jax.Array:
    """all_gather(a, axis, tiled=True), whose gradient is summed back by `sum_scatter`."""
    return jax.lax.all_gather(a, axis, tiled=True)


def _gather_fwd(a, axis):
    return gather(a, axis), None


def _gather_bwd(axis, _, ct):
    return (sum_scatter(ct, axis),)


gather.defvjp(_gather_fwd, _gather_bwd)
