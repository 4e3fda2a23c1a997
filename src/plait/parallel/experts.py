"""Mixture-of-experts token movement: each token's top-k assignments go to their experts
and come back weighted.

Two ways, chosen by `moe.capacity_factor`:

- capacity (factor > 0): every sequence is a dispatch group. Within a group each
  expert takes at most C = ceil(factor x seq x top_k / experts) assignments, first
  choices before second ones, earlier tokens before later ones; the rest are dropped
  (they add nothing; the residual stream carries the token on). Groups are sequences,
  not devices, so what is dropped does not depend on the mesh. The buffer
  [rows, experts, C, d] is built and read per row, where the rows already are. With an
  `expert` axis the experts are split over it and the buffer crosses it by one
  all-to-all each way inside a shard_map (manual over `expert` only; data, fsdp and
  tensor stay with GSPMD): each rank sends its rows' slices for the other ranks'
  experts and gets theirs for its own.
- dropless (factor 0): every assignment is kept. Each device sorts its own tokens'
  assignments by expert and runs the experts as grouped MLPs (`parallel.grouped`:
  a batched share of each expert's rows, batched tiles of the rows past it and a loop
  over the rest; JAX's Pallas grouped GEMM kernels on a Hopper GPU,
  `parallel.grouped_pallas`; or `jax.lax.ragged_dot`, by `moe.grouped`), the sort's permutations
  gathers both ways (`_sorted_rows`, `_unsorted`). Where an axis splits the
  model's MLP hidden units and not the rows (1-D's `tensor`, 2-D's `tensor_col`),
  each of its ranks runs its slice of every expert's hidden units on the same rows,
  and the partial outputs (and the rows' gradients) are summed once, outside the
  grouped MLPs (`split_axes`). Without an `expert` axis the weights are otherwise
  gathered whole. With one, the experts are split over it and the
  tokens are all-gathered across it instead (the all-gather dispatch of
  Megatron-Core): each rank runs its own experts
  on every assignment of the group routed to them, leaving the rest out of its
  grouped matmuls, and a reduce-scatter sums each token's outputs back to the rank
  that holds it (in bf16 an all-to-all and a float32 sum: `expert_sums.sum_scatter`). No sizes
  depend on the routing (an all-to-all of exactly the routed tokens would), at
  X / top_k times the all-to-all's bytes and X times the sorted buffer
  (formulas.expert_bytes), though each rank's grouped matmuls multiply only the tiles
  its experts' rows fill (`parallel.grouped`), its share of the FLOPs.

`parallel/` is the only code that writes collectives: the model hands over its router
choices and expert weights and gets the combined output back.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from plait.parallel import expert_sums as sums
from plait.parallel.grouped import expert_mlp, grouped_mlp, ragged_mlp
from plait.parallel.grouped_pallas import pallas_mlp
from plait.sharding import active, axes_tuple, varying_like

AXIS = "expert"
# Expert weights: w13 [E, d, 2, f] (SwiGLU) or w1 [E, d, f] (GELU), then w2 [E, f, d].
Weights = dict[str, jax.Array]


def capacity(seq: int, top_k: int, experts: int, factor: float) -> int:
    """Assignments each expert takes per sequence (capacity mode)."""
    return max(1, math.ceil(factor * seq * top_k / experts))


def slot_positions(idx: jax.Array, experts: int) -> jax.Array:
    """idx [T, k] expert of each token's choices -> the place of each assignment in its
    expert's queue [T, k]: all first choices in token order, then all second ones, ..."""
    flat = idx.T.reshape(-1)  # choice-major
    onehot = jax.nn.one_hot(flat, experts, dtype=jnp.int32)
    before = jnp.cumsum(onehot, axis=0) - onehot
    return jnp.take_along_axis(before, flat[:, None], axis=1)[:, 0].reshape(idx.shape[::-1]).T


def _dispatch_row(x: jax.Array, idx: jax.Array, pos: jax.Array, experts: int, cap: int):
    """One sequence: x [T, d] -> buffer [E, C, d] of the kept assignments."""
    T, k = idx.shape
    slot = jnp.where(pos < cap, idx * cap + pos, experts * cap)  # out of range: dropped
    rows = jnp.broadcast_to(x[:, None], (T, k, x.shape[-1])).reshape(T * k, -1)
    buf = jnp.zeros((experts * cap, x.shape[-1]), x.dtype)
    buf = buf.at[slot.reshape(-1)].set(rows, mode="drop", unique_indices=True)
    return buf.reshape(experts, cap, -1)


def _combine_row(out: jax.Array, idx: jax.Array, pos: jax.Array, gate: jax.Array, cap: int):
    """One sequence: expert outputs [E, C, d] -> [T, d], each token's kept assignments
    weighted by their gates and summed."""
    E = out.shape[0]
    slot = jnp.where(pos < cap, idx * cap + pos, E * cap)
    picked = jnp.take(out.reshape(E * cap, -1), slot.reshape(-1), axis=0, mode="fill",
                      fill_value=0).reshape(*idx.shape, -1)
    return jnp.einsum("tkd,tk->td", picked, gate.astype(picked.dtype))


def _mesh_and_size() -> tuple[object, int]:
    ctx = active()
    if ctx is None:
        return None, 1
    mesh = ctx[0]
    return mesh, dict(mesh.shape).get(AXIS, 1)


def _weights_per_rank(w: Weights, axes: tuple[str, ...]) -> Weights:
    """The expert weights inside a shard_map manual over `axes` (`sums.per_rank`),
    where they are low-precision and an axis besides `expert` splits the rows."""
    others = tuple(a for a in axes if a != AXIS)
    if not others:
        return w
    return {k: sums.per_rank(v, others) if sums.narrow(v) else v for k, v in w.items()}


def _exchange(buf: jax.Array, w: Weights, activation: str, mesh) -> jax.Array:
    """buf [rows, E, C, d], rows split over `expert` first -> expert outputs laid out
    the same way: one all-to-all to the experts' ranks, the local experts' MLPs, one
    all-to-all back. The shard_map is manual over every axis that splits the rows (an
    all-to-all under GSPMD's other row axes gathers the rows over them first); the
    expert weights enter whole but for their experts, gathered over fsdp by GSPMD, and
    their gradients leave summed over the row axes."""
    def body(b, wl):
        # b [rows here, E, C, d] -> [rows here, source rank, local experts, C, d]
        there = jax.lax.all_to_all(b[:, None], AXIS, split_axis=2, concat_axis=1, tiled=True)
        done = expert_mlp(_weights_per_rank(wl, axes), there, activation)
        return jax.lax.all_to_all(done, AXIS, split_axis=1, concat_axis=2, tiled=True)[:, 0]

    context = jax.sharding.get_abstract_mesh()
    if not context.empty and context.manual_axes:
        return _exchange_by_layout(buf, w, activation, context)
    axes = _row_axes(active())
    specs = {k: P(AXIS) for k in w}
    return jax.shard_map(body, mesh=mesh, in_specs=(P(axes), specs), out_specs=P(axes),
                         axis_names=set(axes))(buf, w)


def _exchange_by_layout(buf: jax.Array, w: Weights, activation: str, mesh) -> jax.Array:
    """The same exchange inside a pipeline stage (a shard_map manual over `pipeline`,
    where a nested one's residuals cannot be laid out): the buffer's expert dimension
    re-laid over `expert` in place of its rows, which GSPMD makes the same all-to-all."""
    X = mesh.shape[AXIS]
    B = buf.shape[0]
    rest = tuple(a for a in _row_axes(active()) if a != AXIS) or None

    def pin(x, spec):
        return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh, spec))

    b = pin(buf.reshape(X, B // X, *buf.shape[1:]), P(AXIS, rest))
    there = pin(b, P(None, rest, AXIS))
    done = pin(expert_mlp(w, there, activation), P(None, rest, AXIS))
    return pin(done, P(AXIS, rest)).reshape(buf.shape)


def _manual_mesh(mesh):
    """Inside another shard_map (the pipeline), the abstract mesh whose axes are Manual."""
    context = jax.sharding.get_abstract_mesh()
    return context if not context.empty and context.manual_axes else mesh


def with_capacity(x: jax.Array, idx: jax.Array, gate: jax.Array, w: Weights, activation: str,
                  factor: float) -> tuple[jax.Array, jax.Array]:
    """x [B, T, d], idx / gate [B, T, k] -> (output [B, T, d], dropped assignments)."""
    E = next(iter(w.values())).shape[0]
    cap = capacity(x.shape[1], idx.shape[-1], E, factor)
    pos = jax.vmap(slot_positions, in_axes=(0, None))(idx, E)
    buf = jax.vmap(_dispatch_row, in_axes=(0, 0, 0, None, None))(x, idx, pos, E, cap)
    mesh, size = _mesh_and_size()
    out = (_exchange(buf, w, activation, mesh) if size > 1
           else expert_mlp(w, buf, activation))
    y = jax.vmap(_combine_row, in_axes=(0, 0, 0, 0, None))(out, idx, pos, gate, cap)
    return y, jnp.sum(pos >= cap)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _sorted_rows(x: jax.Array, order: jax.Array, inverse: jax.Array, k: int) -> jax.Array:
    """x [N, d] -> each token's k assignments in sorted order, [N x k, d] (assignment a
    = token a // k at sorted place inverse[a]; order: the assignment at each place).
    Both ways a gather: the gradient sums each token's k rows, read at their places,
    where autodiff's would scatter-add them into the tokens (slower on a GPU)."""
    return jnp.take(x, order // k, axis=0)


def _sorted_rows_fwd(x, order, inverse, k):
    return _sorted_rows(x, order, inverse, k), (order, inverse)


def _sorted_rows_bwd(k, res, ct):
    order, inverse = res
    return jnp.take(ct, inverse, axis=0).reshape(-1, k, ct.shape[-1]).sum(1), None, None


_sorted_rows.defvjp(_sorted_rows_fwd, _sorted_rows_bwd)


@jax.custom_vjp
def _unsorted(y: jax.Array, order: jax.Array, inverse: jax.Array) -> jax.Array:
    """Rows in sorted order back in assignment order: a gather both ways (the
    gradient's by `order`), where autodiff's would scatter."""
    return jnp.take(y, inverse, axis=0)


def _unsorted_fwd(y, order, inverse):
    return _unsorted(y, order, inverse), (order, inverse)


def _unsorted_bwd(res, ct):
    order, _ = res
    return jnp.take(ct, order, axis=0), None, None


_unsorted.defvjp(_unsorted_fwd, _unsorted_bwd)


def _ragged_group(x: jax.Array, idx: jax.Array, gate: jax.Array, w: Weights, activation: str,
                  how: str, ranks: int = 1, bulk: float = 1.0, spill: float = 1.25
                  ) -> jax.Array:
    """Tokens x [N, d] of one device, every assignment kept: sorted by expert, the experts
    run as grouped matmuls over their contiguous rows, then put back and weighted.
    Assignments to experts outside [0, E) (another rank's) sort last, past every group:
    the grouped matmuls leave them out and their outputs are 0. `ranks`: how many ranks
    share the assignments (a balanced routing gives this one 1 / ranks of them); `bulk`,
    `spill`: how many rows `parallel.grouped.grouped_mlp` batches."""
    N, k = idx.shape
    expected = N * k // ranks
    E = next(iter(w.values())).shape[0]
    flat = idx.reshape(-1)
    flat = jnp.where((flat >= 0) & (flat < E), flat, E)
    # argsort's permutation comes out typed as its iota is, not as the keys vary
    order = varying_like(jnp.argsort(flat, stable=True).astype(jnp.int32), flat)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=jnp.int32),
                                                  unique_indices=True)
    rows = _sorted_rows(x, order, inverse, k)
    sizes = jnp.bincount(flat, length=E + 1)[:E].astype(jnp.int32)
    if how == "pallas":
        out = pallas_mlp(rows, w, sizes, activation)
    elif how == "ragged_dot":
        out = ragged_mlp(rows, w, sizes, activation)
    else:  # "tiles"; "auto" where no task resolved it for a device (tasks.gpt_runtime)
        out = grouped_mlp(rows, w, sizes, activation, expected, bulk, spill)
    back = _unsorted(out, order, inverse).reshape(N, k, -1)
    return jnp.einsum("nkd,nk->nd", back, gate.astype(back.dtype))


def dropless(x: jax.Array, idx: jax.Array, gate: jax.Array, w: Weights, activation: str,
             how: str = "tiles", bulk: float = 1.0, spill: float = 1.25
             ) -> tuple[jax.Array, jax.Array]:
    """x [B, T, d], idx / gate [B, T, k] -> (output [B, T, d], 0 dropped): each device's
    tokens through `_ragged_group`, in a shard_map over the axes that split the rows
    and the one that splits the experts' hidden units (`split_axes`); over an
    `expert` axis, every rank's tokens through its own experts (the module's
    docstring). Inside a pipeline stage the backward recomputes the layer's forward."""
    B, T, d = x.shape
    _, X = _mesh_and_size()

    def local(x, idx, gate, w):
        w = _weights_per_rank(w, axes)
        b = x.shape[0]
        x, idx, gate = x.reshape(b * T, d), idx.reshape(b * T, -1), gate.reshape(b * T, -1)
        if hidden:  # each rank computes with its slice of every expert's hidden units
            x, gate = sums.per_rank(x, hidden, f32), sums.per_rank(gate, hidden, f32)
        if X > 1:
            x, gate = sums.gather(x, AXIS), sums.gather(gate, AXIS)
            idx = jax.lax.all_gather(idx, AXIS, tiled=True)
            first = jax.lax.axis_index(AXIS) * next(iter(w.values())).shape[0]
            y = sums.sum_scatter(_ragged_group(x, idx - first, gate, w, activation, how, X,
                                               bulk, spill), AXIS)
        else:
            y = _ragged_group(x, idx, gate, w, activation, how, bulk=bulk, spill=spill)
        if hidden:
            y = sums.from_slices(y, hidden, f32)
        return y.reshape(b, T, d)

    ctx = active()
    axes, hidden = _split_axes(ctx)
    f32 = bool(hidden) and ctx[0].devices.flat[0].platform == "cpu"
    if not axes and not hidden:
        return local(x, idx, gate, w), jnp.zeros((), jnp.int32)
    mesh = _manual_mesh(ctx[0])
    rows = P(axes or None)
    specs = {key: _expert_spec(key, AXIS if X > 1 else None, hidden or None) for key in w}
    manual = set(axes) | set(hidden)
    sharded = jax.shard_map(local, mesh=mesh, in_specs=(rows, rows, rows, specs),
                            out_specs=rows, axis_names=manual)
    if mesh is ctx[0]:  # not inside a pipeline stage
        return sharded(x, idx, gate, w), jnp.zeros((), jnp.int32)

    # In a pipeline stage the backward is a shard_map of its own over the layer's
    # inputs, which recomputes the forward: autodiff's would take residuals out of the
    # forward's shard_map, typed over the stage's manual axis too, and Shardy cannot
    # lay those out where the stage's backward replays them (a local shape that does
    # not match; "manual axis after free axis").
    def pull(x, idx, gate, w, dy):
        return jax.vjp(lambda x, gate, w: local(x, idx, gate, w), x, gate, w)[1](dy)

    @jax.custom_vjp
    def recomputed(x, idx, gate, w):
        return sharded(x, idx, gate, w)

    def recomputed_bwd(res, dy):
        dx, dgate, dw = jax.shard_map(pull, mesh=mesh, in_specs=(rows,) * 3 + (specs, rows),
                                      out_specs=(rows, rows, specs),
                                      axis_names=manual)(*res, dy)
        return dx, None, dgate, dw

    recomputed.defvjp(lambda *a: (sharded(*a), a), recomputed_bwd)
    return recomputed(x, idx, gate, w), jnp.zeros((), jnp.int32)


def recomputed_in_a_stage(sizes: dict[str, int], rules) -> tuple[str, ...]:
    """The axes beside `pipeline` that split dropless's rows or the experts' hidden
    units (`split_axes`): where there are any, a pipeline stage's backward recomputes
    the experts' forward (`dropless`), which the run's start-up line says."""
    if sizes.get("pipeline", 1) == 1:
        return ()
    rows, hidden = split_axes(sizes, rules, {"pipeline"})
    return rows + hidden


def split_axes(sizes: dict[str, int], rules, manual=frozenset()
               ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(rows, hidden): the mesh axes (size > 1, not in `manual`, in the rules' order)
    that split the rows of a batch, and those that split a model's MLP hidden units
    but not the rows (1-D's `tensor`, 2-D's `tensor_col`; 3-D's `tensor_y` splits the
    rows). Dropless runs its grouped MLPs on each hidden rank's slice of the experts'
    hidden units, manual, and sums the partial outputs once after them: left to
    GSPMD, the sums sat inside the grouped MLP's switch and loop, a conditional
    holding collectives that XLA:CPU ordered differently on different devices against
    the attention's (`train.loop._would_hang` refused the step), and one all-reduce
    per tile of the loop."""
    def free(logical: str) -> tuple[str, ...]:
        return tuple(a for a in axes_tuple(rules.get(logical))
                     if sizes.get(a, 1) > 1 and a not in manual)

    rows = free("act_batch")
    return rows, tuple(a for a in free("mlp") if a not in rows)


def _split_axes(ctx) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """`split_axes` of the step being traced (`sharding.active()`), the axes already
    manual (a pipeline stage's) left out."""
    if ctx is None:
        return (), ()
    mesh, rules = ctx
    context = jax.sharding.get_abstract_mesh()
    manual = set(context.manual_axes) if not context.empty else set()
    return split_axes(dict(mesh.shape), rules, manual)


def _row_axes(ctx) -> tuple[str, ...]:
    """The mesh axes that split the rows of a batch (size > 1), in the rules' order."""
    return _split_axes(ctx)[0]


def _expert_spec(key: str, expert: str | None, hidden) -> P:
    """An expert weight's PartitionSpec (`Weights`' layouts): experts over `expert`,
    the hidden units over `hidden`."""
    if key == "w2":  # [E, f, d]
        return P(expert, hidden, None)
    if key == "w13":  # [E, d, 2, f]
        return P(expert, None, None, hidden)
    return P(expert, None, hidden)  # w1 [E, d, f]
