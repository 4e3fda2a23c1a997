"""Grouped MLPs for dropless experts: rows sorted by group, each group's rows through
its own expert's MLP (or one product), at (about) the FLOPs of the rows actually routed.

`jax.lax.ragged_dot` says this of one product, but what it costs is the backend's
choice: XLA:CPU expands it into a dense product over every group's zero-padded rows,
G times the FLOPs and an activation per group (docs/architecture.md, "Dropless").
`grouped_mlp` gets the same result from plain XLA in two parts. Each group's first C
rows (`bulk` x a balanced group's share, in whole tiles) go to a [G, C, K] buffer and
one batched MLP (`expert_mlp`, the capacity path's), as fast as a dense layer of
those FLOPs, its hidden activations staying in that layout. The rows past them are
cut into tiles, windows of contiguous rows of one group (the last of a group partly
its own), and a loop over the tiles runs each through its group's MLP, reading
its rows from x and writing its outputs into y in place (dynamic slices and a
dynamic weight index: no padded copy of the rows): many small products in sequence,
slow on a GPU, so only the rows of experts above their share go there (with bulk 0,
every row). Rows past the groups' total (assignments to another rank's experts)
come back as zeros, as ragged_dot gives them.

The tiles are counted for the worst case (every row in the groups, each group's
last tile partly filled), but the loop runs only over the tiles that hold rows: with
bulk 0 a static loop over the tiles of the rows a balanced routing gives
(`expected`), then one whose trip count is the tiles actually occupied past those.
Over an `expert` axis of X ranks the rows are the whole group's X x N x k and a balanced
rank's groups hold N x k of them, so this is the difference between X times the
experts' FLOPs and their share; and the compiled program's FLOPs, which count the
batched product and the static loop (a loop of unknown trip count counts once),
price the balanced case. One custom VJP covers both parts: JAX cannot reverse a loop
of dynamic length. The backward keeps the batched MLP's own residuals and, for the
loop, only the sorted rows: each tile's forward is recomputed there.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from plait.models.activations import gelu, swiglu
from plait.sharding import varying_like

MAX_TILE = 512


def tile_rows(rows: int, groups: int) -> int:
    """Rows per tile: a power of two near a quarter of an even group's share (padding at
    most about a quarter of the rows), between 8 and MAX_TILE."""
    share = max(1, rows // (4 * groups))
    return int(min(MAX_TILE, max(8, 1 << (share.bit_length() - 1))))


def _group_of(i: jax.Array, ends: jax.Array) -> jax.Array:
    """The group of each position i given the groups' ends (searchsorted "right", as a
    count: jnp.searchsorted does not trace inside a shard_map here)."""
    return jnp.sum(i[:, None] >= ends[None, :], axis=1)


def _over_tiles(body, init, static: int, occupied: jax.Array):
    """body over tiles [0, static) in a loop of known length, then over
    [static, occupied) in one whose length is known only when it runs."""
    carry = jax.lax.fori_loop(0, static, body, init)
    return jax.lax.fori_loop(static, jnp.maximum(occupied, static), body, carry)


class _Layout(NamedTuple):
    """Where the M sorted rows go. `bulk`: each row's row of the [G x C] batched buffer
    (G x C: not there). The rest are tiles of contiguous rows of one group: tile t is
    rows [start[t], start[t] + length[t]) of group `group[t]` (G: none); the first
    `occupied` tiles hold rows."""
    bulk: jax.Array
    start: jax.Array
    length: jax.Array
    group: jax.Array
    occupied: jax.Array


def _layout(M: int, G: int, sizes: jax.Array, C: int, tile: int) -> _Layout:
    """Each group's first C rows to the batched buffer, the rest to tiles of their own
    group (room for the worst case: ceil(M / tile) + G tiles)."""
    T = -(-M // tile) + G
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    i = jnp.arange(M)
    g = _group_of(i, ends)  # G past the last group
    gi = jnp.minimum(g, G - 1)
    rank = i - starts[gi]
    bulk = jnp.where((g < G) & (rank < C), gi * C + rank, G * C)
    over = jnp.maximum(sizes - C, 0)
    count = -(-over // tile)
    tends = jnp.cumsum(count)
    t = jnp.arange(T)
    group = _group_of(t, tends)
    tg = jnp.minimum(group, G - 1)
    start = ends[tg] - over[tg] + (t - tends[tg] + count[tg]) * tile
    length = jnp.where(group < G, jnp.clip(ends[tg] - start, 0, tile), 0)
    return _Layout(bulk, start, length, group, tends[-1].astype(jnp.int32))


def _tile_at(lay: _Layout, t: jax.Array, M: int, tile: int):
    """(first row of the `tile` rows read for tile t, which of them are its own): the
    read starts earlier near the end of the rows, where a full tile would not fit."""
    first = jnp.clip(lay.start[t], 0, M - tile)
    r = first + jnp.arange(tile)
    return first, (r >= lay.start[t]) & (r < lay.start[t] + lay.length[t])


def expert_mlp(w: dict[str, jax.Array], h: jax.Array, activation: str | None) -> jax.Array:
    """Every expert's MLP on its own rows: h [..., E, C, d] -> [..., E, C, d]. None: the
    one product h @ w["w"] (a grouped matmul)."""
    if activation is None:
        return jnp.einsum("...ecd,edf->...ecf", h, w["w"])
    if activation == "swiglu":
        gu = jnp.einsum("...ecd,edgf->...ecgf", h, w["w13"])
        hidden = swiglu(gu[..., 0, :], gu[..., 1, :])
    else:
        hidden = gelu(jnp.einsum("...ecd,edf->...ecf", h, w["w1"]))
    return jnp.einsum("...ecf,efd->...ecd", hidden, w["w2"])


def _tile_mlp(xt: jax.Array, wg: dict, activation: str | None) -> jax.Array:
    """One group's MLP (weights wg, each [1, ...]) on one tile's rows [tile, K]."""
    return expert_mlp(wg, xt[None], activation)[0]


def _of_group(w: dict, g: jax.Array) -> dict:
    return {k: v[g][None] for k, v in w.items()}


def _loop_forward(x: jax.Array, w: dict, lay: _Layout, activation: str | None, tile: int,
                  static: int, y: jax.Array) -> jax.Array:
    """y [M, N] with each tile's rows of x [M, K] through its group's MLP written in
    (in place, in a loop over the occupied tiles)."""
    M, K = x.shape
    G = next(iter(w.values())).shape[0]

    def body(t, y):
        first, own = _tile_at(lay, t, M, tile)
        xt = jax.lax.dynamic_slice(x, (first, 0), (tile, K))
        yt = _tile_mlp(xt, _of_group(w, jnp.minimum(lay.group[t], G - 1)), activation)
        yt = yt.astype(y.dtype)
        kept = jax.lax.dynamic_slice(y, (first, 0), (tile, y.shape[1]))
        return jax.lax.dynamic_update_slice(y, jnp.where(own[:, None], yt, kept), (first, 0))

    return _over_tiles(body, varying_like(y, x, *w.values(), lay.start), static,
                       lay.occupied)


def _loop_backward(x: jax.Array, w: dict, lay: _Layout, activation: str | None, tile: int,
                   static: int, dy: jax.Array, dx: jax.Array, dw: dict):
    """The loop's gradients over the same tiles (JAX cannot reverse a loop of dynamic
    length), each tile's forward recomputed: the tiles' rows of dx written in, their
    weight gradients added to dw (float32)."""
    M, K = x.shape
    G = next(iter(w.values())).shape[0]

    def body(t, c):
        dx, dw = c
        first, own = _tile_at(lay, t, M, tile)
        g = jnp.minimum(lay.group[t], G - 1)
        xt = jax.lax.dynamic_slice(x, (first, 0), (tile, K))
        dyt = jax.lax.dynamic_slice(dy, (first, 0), (tile, dy.shape[1]))
        dyt = jnp.where(own[:, None], dyt, jnp.zeros_like(dyt))
        yt, pull = jax.vjp(lambda xt, wg: _tile_mlp(xt, wg, activation), xt, _of_group(w, g))
        dxt, dwg = pull(dyt.astype(yt.dtype))
        kept = jax.lax.dynamic_slice(dx, (first, 0), (tile, K))
        dx = jax.lax.dynamic_update_slice(
            dx, jnp.where(own[:, None], dxt.astype(dx.dtype), kept), (first, 0))
        dw = {k: dw[k].at[g].add(dwg[k][0].astype(jnp.float32)) for k in dw}
        return dx, dw

    like = (x, *w.values(), lay.start, dy)
    init = (varying_like(dx, *like), {k: varying_like(v, *like) for k, v in dw.items()})
    return _over_tiles(body, init, static, lay.occupied)


def _put(x: jax.Array, dest: jax.Array, rows: int) -> jax.Array:
    return jnp.zeros((rows, x.shape[1]), x.dtype).at[dest].set(x, mode="drop",
                                                              unique_indices=True)


def _get(buf: jax.Array, dest: jax.Array) -> jax.Array:
    return jnp.take(buf.reshape(-1, buf.shape[-1]), dest, axis=0, mode="fill", fill_value=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _grouped(x: jax.Array, w: dict, lay: _Layout, activation: str | None, C: int, tile: int,
             static: int) -> jax.Array:
    """x [M, K] through the groups' MLPs (weights w, each [G, ...]) as `lay` places its
    rows -> [M, N]. A custom VJP: the loop's length is known only when it runs."""
    return _grouped_fwd(x, w, lay, activation, C, tile, static)[0]


def _grouped_fwd(x, w, lay, activation, C, tile, static):
    G = next(iter(w.values())).shape[0]
    pull = None
    if C:
        xb = _put(x, lay.bulk, G * C).reshape(G, C, -1)
        yb, pull = jax.vjp(lambda xb, w: expert_mlp(w, xb, activation), xb, w)
        y = _get(yb, lay.bulk)
    else:
        out = jax.eval_shape(functools.partial(_tile_mlp, activation=activation), x[:1],
                             _of_group(w, 0))
        y = jnp.zeros((x.shape[0], out.shape[-1]), out.dtype)
    return _loop_forward(x, w, lay, activation, tile, static, y), (x, w, lay, pull)


def _grouped_bwd(activation, C, tile, static, res, dy):
    x, w, lay, pull = res
    G = next(iter(w.values())).shape[0]
    dw = {k: jnp.zeros(v.shape, jnp.float32) for k, v in w.items()}
    dx = jnp.zeros_like(x)
    if C:
        dxb, dwb = pull(_put(dy, lay.bulk, G * C).reshape(G, C, -1))
        dx = _get(dxb, lay.bulk).astype(x.dtype)
        dw = {k: v.astype(jnp.float32) for k, v in dwb.items()}
    dx, dw = _loop_backward(x, w, lay, activation, tile, static, dy, dx, dw)
    return dx, {k: dw[k].astype(w[k].dtype) for k in w}, None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def grouped_mlp(x: jax.Array, w: dict[str, jax.Array], sizes: jax.Array,
                activation: str | None, expected: int | None = None, bulk: float = 1.0
                ) -> jax.Array:
    """x [M, K] sorted by group, weights w (each [G, ...], as `expert_mlp` takes them),
    sizes [G] (their sum at most M) -> [M, N]: row i of group g through group g's MLP
    (`expert_mlp`; activation None: the one product x @ w["w"][g]); rows past
    sum(sizes) give zeros. `expected`: the rows a balanced routing puts in the groups
    (default M), which sizes the tiles. `bulk`: the first rows of each group, up to
    `bulk` x a balanced group's share (in whole tiles), go through one batched MLP on
    [G, C, K], as fast as a dense layer of those FLOPs, its hidden activations kept in
    that layout; only the rows past them (an expert above its share) go through the
    loop over tiles, whose small products in sequence are slow on a GPU. 0: every row
    through the loop, whose known part is then a balanced routing's tiles."""
    M = x.shape[0]
    G = next(iter(w.values())).shape[0]
    expected = M if expected is None else max(1, min(expected, M))
    tile = min(tile_rows(expected, G), M)
    C = -(-int(bulk * expected / G) // tile) * tile
    lay = _layout(M, G, sizes, C, tile)
    static = 0 if C else min(lay.group.shape[0], -(-expected // tile))
    # the weights vary where the rows do before the custom VJP, whose backward then
    # gives their gradients per rank: the cast's transpose sums them across them
    w = {k: varying_like(v, x, sizes) for k, v in w.items()}
    return _grouped(x, w, lay, activation, C, tile, static)


def grouped_matmul(x: jax.Array, w: jax.Array, sizes: jax.Array, how: str,
                   expected: int | None = None, bulk: float = 1.0) -> jax.Array:
    """x [M, K] sorted by group, w [G, K, N] -> [M, N] (`grouped_mlp` of the one
    product). `how`: "tiles" (`grouped_mlp`) or "ragged_dot" (jax.lax.ragged_dot, the
    backend's own)."""
    if how == "ragged_dot":
        return jax.lax.ragged_dot(x, w, sizes)
    return grouped_mlp(x, {"w": w}, sizes, None, expected, bulk)
