"""Grouped MLPs for dropless experts: rows sorted by group, each group's rows through
its own expert's MLP (or one product), at (about) the FLOPs of the rows actually routed.

`jax.lax.ragged_dot` says this of one product, but what it costs is the backend's
choice: XLA:CPU expands it into a dense product over every group's zero-padded rows,
G times the FLOPs and an activation per group, and on an H100 / H200 it ran at a sixth
of a dense product's speed (docs/architecture.md, "Dropless"). `grouped_mlp` gets the
same result from plain XLA in three parts:

1. bulk: each group's first C rows (`bulk` x a balanced group's share, in whole
   tiles) go to a [G, C, K] buffer and one batched MLP (`expert_mlp`, the capacity
   path's), as fast as a dense layer of those FLOPs, its hidden activations kept.
2. spill: the rows past them are cut into tiles, windows of contiguous rows of one
   group (the last of a group partly its own), and the first S tiles go through one
   more batched MLP, [S, tile, K] against each tile's group's weights gathered
   [S, ...], at a batched product's speed. S is chosen per call among a few compiled
   sizes (0, powers of two, the largest: `spill` x the rows of a balanced routing,
   by default every tile there can be): the smallest that holds the tiles the
   routing overflows, by a `lax.switch`, so an expert somewhat above its share costs
   fewer than twice its overflow's FLOPs and one far above it no loop.
3. loop: the tiles past the largest size (every tile with bulk and spill 0) run one
   at a time in a loop whose trip count is known only when it runs, reading its rows
   from x and writing its outputs into y in place (dynamic slices and a dynamic
   weight index: no padded copy). On a GPU each of its iterations waits for the host
   (a while loop's condition), as the switch's choice does once.

Rows past the groups' total (assignments to another rank's experts) come back as
zeros, as ragged_dot gives them. Over an `expert` axis of X ranks the rows are the
whole group's X x N x k and a balanced rank's groups hold N x k of them; the compiled
program's FLOPs as plait counts them (the bulk, the spill's first size, 0 tiles, and
the loop once) price the balanced case. One custom VJP covers the three: JAX cannot
reverse a loop of dynamic length.
The backward keeps the bulk MLP's own residuals and the rows, takes the same spill
size -- the bulk's backward inside that size's branch, so its gradients are made there
rather than copied through the switch -- and recomputes the spill's forward (its
gathered weights are never kept) and each loop tile's. The spill's weight gradients
are summed per group by a product with the tiles' one-hot groups (no scatter-add:
atomics on a GPU) onto the bulk's, in the weights' dtype;
only the largest size, which runs the loop, copies them to float32 for its many
small additions and back.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from plait.hlo import SIZED_BY_DATA
from plait.models.activations import gelu, swiglu_halves
from plait.parallel.products import weight_product
from plait.sharding import varying_like

MAX_TILE = 512


def tile_rows(rows: int, groups: int) -> int:
    """Rows per tile: a power of two near a quarter of an even group's share (padding at
    most about a quarter of the rows), between 8 and MAX_TILE."""
    share = max(1, rows // (4 * groups))
    return int(min(MAX_TILE, max(8, 1 << (share.bit_length() - 1))))


def group_of(i: jax.Array, ends: jax.Array) -> jax.Array:
    """The group of each position i given the groups' ends (searchsorted "right", as a
    count: jnp.searchsorted does not trace inside a shard_map here)."""
    return jnp.sum(i[:, None] >= ends[None, :], axis=1)


class _Shape(NamedTuple):
    """The static sizes: G groups, C rows of each batched (bulk), the spill's possible
    sizes in tiles of `tile` rows (0 first; each call takes the smallest that holds its
    overflow tiles, or the largest)."""
    G: int
    C: int
    sizes: tuple[int, ...]
    tile: int


def spill_sizes(most: int) -> tuple[int, ...]:
    """The spill's sizes in tiles up to `most`: 0, then powers of two, then `most`. A
    routing that overflows n tiles gets the smallest >= n: fewer than twice n tiles'
    FLOPs, from a handful of compiled sizes."""
    return (0, *(1 << i for i in range(max(most, 1).bit_length()) if 1 << i < most),
            *((most,) if most else ()))


def spill_size_index(occupied: jax.Array, sizes: tuple[int, ...]) -> jax.Array:
    """Which of `sizes` holds `occupied` tiles: the smallest >= it (the last if none)."""
    return jnp.minimum(jnp.sum(jnp.asarray(sizes) < occupied), len(sizes) - 1)


class _Layout(NamedTuple):
    """Where the M sorted rows go. `slot`: each row's row of the bulk [G x C] (G x C: not
    there), `source`: each bulk row's row (M: none), so that rows go in and out by
    gathers. Past the bulk, tiles of contiguous rows of one group: tile t is rows
    [start[t], start[t] + length[t]) of group `group[t]` (G: none), the first `occupied`
    hold rows; `tile_of`: each row's tile (T: none), `place`: its row among the tiles'
    rows (t x tile + its place in t)."""
    slot: jax.Array
    source: jax.Array
    tile_of: jax.Array
    place: jax.Array
    start: jax.Array
    length: jax.Array
    group: jax.Array
    occupied: jax.Array


def _layout(M: int, sizes: jax.Array, shape: _Shape) -> _Layout:
    """Each group's first C rows to the bulk, the rest to tiles of their own group (room
    for the worst case: ceil(M / tile) + G tiles)."""
    G, C, _, tile = shape
    T = -(-M // tile) + G
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    i = jnp.arange(M)
    g = group_of(i, ends)  # G past the last group
    gi = jnp.minimum(g, G - 1)
    rank = i - starts[gi]
    over = jnp.maximum(sizes - C, 0)
    count = -(-over // tile)
    tends = jnp.cumsum(count)
    o = jnp.maximum(rank - C, 0)  # a row's place among its group's rows past the bulk
    tile_of = jnp.where((g < G) & (rank >= C), tends[gi] - count[gi] + o // tile, T)
    slot = jnp.where((g < G) & (rank < C), gi * C + rank, G * C)
    t = jnp.arange(T)
    group = group_of(t, tends)
    tg = jnp.minimum(group, G - 1)
    start = ends[tg] - over[tg] + (t - tends[tg] + count[tg]) * tile
    length = jnp.where(group < G, jnp.clip(ends[tg] - start, 0, tile), 0)
    c = jnp.arange(C)
    source = jnp.where(c < sizes[:, None], starts[:, None] + c, M).reshape(-1)
    return _Layout(slot, source, tile_of, tile_of * tile + o % tile, start, length, group,
                   tends[-1].astype(jnp.int32))


def _tile_at(lay: _Layout, t: jax.Array, M: int, tile: int):
    """(first row of the `tile` rows read for tile t, which of them are its own): the
    read starts earlier near the end of the rows, where a full tile would not fit."""
    first = jnp.clip(lay.start[t], 0, M - tile)
    r = first + jnp.arange(tile)
    return first, (r >= lay.start[t]) & (r < lay.start[t] + lay.length[t])


UP = {"swiglu": "w13", "gelu": "w1", None: "w"}  # the first product's weight, by activation


def _up(wu: jax.Array, h: jax.Array, activation: str | None) -> jax.Array:
    """The first product: h [..., E, C, d] -> pre-activations [..., E, C, (2,) f]."""
    if activation == "swiglu":
        return weight_product("...ecd,edgf->...ecgf", h, wu)
    return weight_product("...ecd,edf->...ecf", h, wu)


def activate(pre: jax.Array, activation: str) -> jax.Array:
    """The hidden activations from the first product's output ([..., 2, f] for SwiGLU's
    gate and up halves, [..., f] for GELU)."""
    return swiglu_halves(pre) if activation == "swiglu" else gelu(pre)


def _down(w2: jax.Array | None, pre: jax.Array, activation: str | None) -> jax.Array:
    """The activation, then the second product (None: no activation, no product)."""
    if activation is None:
        return pre
    return weight_product("...ecf,efd->...ecd", activate(pre, activation), w2)


def expert_mlp(w: dict[str, jax.Array], h: jax.Array, activation: str | None) -> jax.Array:
    """Every expert's MLP on its own rows: h [..., E, C, d] -> [..., E, C, d]. None: the
    one product h @ w["w"] (a grouped matmul)."""
    return _down(w.get("w2"), _up(w[UP[activation]], h, activation), activation)


def _tile_mlp(xt: jax.Array, wg: dict, activation: str | None) -> jax.Array:
    """One group's MLP (weights wg, each [1, ...]) on one tile's rows [tile, K]."""
    return expert_mlp(wg, xt[None], activation)[0]


def _of_groups(w: dict, g: jax.Array) -> dict:
    """The weights of groups g (each [len(g), ...]; past the last group: the last's)."""
    G = next(iter(w.values())).shape[0]
    return {k: jnp.take(v, jnp.minimum(g, G - 1), axis=0) for k, v in w.items()}


def _add_to_groups(dw: dict, g: jax.Array, dwg: dict) -> dict:
    """dw ([G, ...]) plus each of dwg's gradients at its group g (one tile: an update in
    place of one group's slice)."""
    G = next(iter(dw.values())).shape[0]
    return {k: dw[k].at[jnp.minimum(g, G - 1)].add(dwg[k].astype(dw[k].dtype)) for k in dw}


def _sum_into_groups(dw: dict, g: jax.Array, dwg: dict) -> dict:
    """dw ([G, ...]) plus the tiles' gradients dwg ([S, ...]) summed per group g, as a
    product by the one-hot groups that cuBLAS adds onto dw: a scatter-add of tiles
    sharing a group is, on a GPU, atomic adds in an order that varies run to run."""
    G = next(iter(dw.values())).shape[0]
    return {k: dw[k] + jnp.einsum("sg,s...->g...", jax.nn.one_hot(
        jnp.minimum(g, G - 1), G, dtype=dw[k].dtype), dwg[k].astype(dw[k].dtype)) for k in dw}


def _loop_forward(x: jax.Array, w: dict, lay: _Layout, activation: str | None, tile: int,
                  first: int, y: jax.Array) -> jax.Array:
    """y [M, N] with the rows of tiles [first, occupied) of x [M, K] through their
    groups' MLPs written in (in place, one tile at a time)."""
    M, K = x.shape

    def body(t, y):
        row, own = _tile_at(lay, t, M, tile)
        xt = jax.lax.dynamic_slice(x, (row, 0), (tile, K))
        yt = _tile_mlp(xt, _of_groups(w, lay.group[t][None]), activation).astype(y.dtype)
        kept = jax.lax.dynamic_slice(y, (row, 0), (tile, y.shape[1]))
        return jax.lax.dynamic_update_slice(y, jnp.where(own[:, None], yt, kept), (row, 0))

    return jax.lax.fori_loop(first, jnp.maximum(lay.occupied, first), body, y)


def _loop_backward(x: jax.Array, w: dict, lay: _Layout, activation: str | None, tile: int,
                   first: int, dy: jax.Array, dx: jax.Array, dw: dict):
    """The loop's gradients over the same tiles (JAX cannot reverse a loop of dynamic
    length), each tile's forward recomputed: the tiles' rows of dx written in, their
    weight gradients added to dw, in float32 for the many small additions."""
    M, K = x.shape

    def body(t, c):
        dx, dw = c
        row, own = _tile_at(lay, t, M, tile)
        g = lay.group[t][None]
        xt = jax.lax.dynamic_slice(x, (row, 0), (tile, K))
        dyt = jax.lax.dynamic_slice(dy, (row, 0), (tile, dy.shape[1]))
        dyt = jnp.where(own[:, None], dyt, jnp.zeros_like(dyt))
        yt, pull = jax.vjp(lambda xt, wg: _tile_mlp(xt, wg, activation), xt, _of_groups(w, g))
        dxt, dwg = pull(dyt.astype(yt.dtype))
        kept = jax.lax.dynamic_slice(dx, (row, 0), (tile, K))
        dx = jax.lax.dynamic_update_slice(
            dx, jnp.where(own[:, None], dxt.astype(dx.dtype), kept), (row, 0))
        return dx, _add_to_groups(dw, g, dwg)

    dx, dw = jax.lax.fori_loop(first, jnp.maximum(lay.occupied, first), body,
                               (dx, {k: v.astype(jnp.float32) for k, v in dw.items()}))
    return dx, {k: dw[k].astype(w[k].dtype) for k in w}


def _rows(a: jax.Array, index: jax.Array) -> jax.Array:
    """a's rows at index (zeros where it is out of range): how rows go into a batched
    buffer and come out of it, gathers both ways."""
    return jnp.take(a, index, axis=0, mode="fill", fill_value=0)


def _spill_rows(a: jax.Array, lay: _Layout, S: int, tile: int) -> jax.Array:
    """The rows of a [M, ...] that the first S tiles hold, [S, tile, ...] (zeros past a
    tile's own rows)."""
    r = jnp.arange(tile)
    index = jnp.where(r < lay.length[:S, None], lay.start[:S, None] + r, a.shape[0])
    return _rows(a, index.reshape(-1)).reshape(S, tile, *a.shape[1:])


def _into_rows(a: jax.Array, parts: jax.Array, lay: _Layout, S: int) -> jax.Array:
    """a [M, N] with the rows of the first S tiles taken from parts [S x tile, N]."""
    return jnp.where((lay.tile_of < S)[:, None],
                     _rows(parts.astype(a.dtype), lay.place), a)


def _loops(S: int, shape: _Shape, lay: _Layout) -> bool:
    """Whether spill size S runs the loop over the tiles past it: the largest does,
    unless it holds every tile there can be."""
    largest, tiles = shape.sizes[-1], lay.group.shape[0]
    return largest == S and tiles > S


def _spill_forward(S: int, x, w, lay, activation, shape: _Shape, y):
    """y with the first S tiles' rows through one batched MLP (each tile's group's
    weights gathered) and, with the largest size, the tiles past them through the loop."""
    if S:
        ys = expert_mlp(_of_groups(w, lay.group[:S]), _spill_rows(x, lay, S, shape.tile),
                        activation)
        y = _into_rows(y, ys.reshape(S * shape.tile, -1), lay, S)
    if _loops(S, shape, lay):
        y = _loop_forward(x, w, lay, activation, shape.tile, S, y)
    return y


def _spill_backward(S: int, x, w, lay, activation, shape: _Shape, dy, dx, dw):
    """The gradients of `_spill_forward(S, ...)`, its batched forward recomputed (its
    gathered weights are never kept), the spill's weight gradients added per group."""
    if S:
        ys, pull = jax.vjp(lambda xs, ws: expert_mlp(ws, xs, activation),
                           _spill_rows(x, lay, S, shape.tile), _of_groups(w, lay.group[:S]))
        dxs, dws = pull(_spill_rows(dy, lay, S, shape.tile).astype(ys.dtype))
        dx = _into_rows(dx, dxs.reshape(S * shape.tile, -1), lay, S)
        dw = _sum_into_groups(dw, lay.group[:S], dws)
    if _loops(S, shape, lay):
        dx, dw = _loop_backward(x, w, lay, activation, shape.tile, S, dy, dx, dw)
    return dx, dw


def _by_size(shape: _Shape, lay: _Layout, branch, *operands):
    """branch(S, *operands) for the spill size that holds this call's overflow tiles: a
    lax.switch over the sizes (on a GPU one decision on the host, as a loop's condition
    would be), or the one size. Its scope makes the compiled program's FLOPs count the
    first size, 0 tiles, as a balanced routing runs (`hlo.SIZED_BY_DATA`)."""
    if len(shape.sizes) == 1:
        return branch(shape.sizes[0], *operands)
    with jax.named_scope(SIZED_BY_DATA):
        return jax.lax.switch(spill_size_index(lay.occupied, shape.sizes),
                              [functools.partial(branch, S) for S in shape.sizes], *operands)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _grouped(x: jax.Array, w: dict, lay: _Layout, activation: str | None, shape: _Shape
             ) -> jax.Array:
    """x [M, K] through the groups' MLPs (weights w, each [G, ...]) as `lay` places its
    rows -> [M, N]. A custom VJP: the loop's length is known only when it runs."""
    return _grouped_fwd(x, w, lay, activation, shape)[0]


def _grouped_fwd(x, w, lay, activation, shape):
    G, C, _, _ = shape
    out = jax.eval_shape(functools.partial(_tile_mlp, activation=activation), x[:1],
                         _of_groups(w, jnp.zeros(1, jnp.int32)))
    pull = None
    if C:
        yb, pull = jax.vjp(lambda xb, w: expert_mlp(w, xb, activation),
                           _rows(x, lay.source).reshape(G, C, -1), w)
        y = _rows(yb.reshape(G * C, -1).astype(out.dtype), lay.slot)
    else:
        y = jnp.zeros((x.shape[0], out.shape[-1]), out.dtype)
    y = varying_like(y, x, *w.values(), lay.start)
    y = _by_size(shape, lay, lambda S, y: _spill_forward(S, x, w, lay, activation, shape, y),
                 y)
    return y, (x, w, lay, pull)


def _grouped_bwd(activation, shape, res, dy):
    x, w, lay, pull = res
    G, C, _, _ = shape
    like = (x, *w.values(), lay.start, dy)

    def bulk():
        if C:
            dxb, dw = pull(_rows(dy, lay.source).reshape(G, C, -1))
            dx = _rows(dxb.reshape(G * C, -1), lay.slot).astype(x.dtype)
        else:
            dx, dw = jnp.zeros_like(x), {k: jnp.zeros_like(v) for k, v in w.items()}
        return varying_like(dx, *like), {k: varying_like(v, *like) for k, v in dw.items()}

    # The bulk's backward runs inside each size's branch, so its gradients are made
    # there: handed into the switch and out, they were copied (a conditional's result
    # cannot be its operand), 240 MB a layer on mixtral-mini.
    dx, dw = _by_size(shape, lay, lambda S: _spill_backward(
        S, x, w, lay, activation, shape, dy, *bulk()))
    return dx, dw, None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def grouped_mlp(x: jax.Array, w: dict[str, jax.Array], sizes: jax.Array,
                activation: str | None, expected: int | None = None, bulk: float = 1.0,
                spill: float = 1.25) -> jax.Array:
    """x [M, K] sorted by group, weights w (each [G, ...], as `expert_mlp` takes them),
    sizes [G] (their sum at most M) -> [M, N]: row i of group g through group g's MLP
    (`expert_mlp`; activation None: the one product x @ w["w"][g]); rows past
    sum(sizes) give zeros. `expected`: the rows a balanced routing puts in the groups
    (default M), which sizes the tiles and the batched parts. `bulk`: the first rows of
    each group, up to `bulk` x a balanced group's share (in whole tiles), go through one
    batched MLP on [G, C, K]; `spill`: tiles of the rows past them, as many as hold
    them up to `spill` x the expected rows, through another with weights gathered per
    tile; the rest through the loop over tiles (the module's docstring). Both 0: every
    row through the loop."""
    M = x.shape[0]
    G = next(iter(w.values())).shape[0]
    expected = M if expected is None else max(1, min(expected, M))
    tile = min(tile_rows(expected, G), M)
    T = -(-M // tile) + G
    shape = _Shape(G, -(-int(bulk * expected / G) // tile) * tile,
                   spill_sizes(min(T, -(-int(spill * expected) // tile))), tile)
    lay = _layout(M, sizes, shape)
    # the weights vary where the rows do before the custom VJP, whose backward then
    # gives their gradients per rank: the cast's transpose sums them across them
    w = {k: varying_like(v, x, sizes) for k, v in w.items()}
    return _grouped(x, w, lay, activation, shape)


def ragged_mlp(x: jax.Array, w: dict[str, jax.Array], sizes: jax.Array,
               activation: str | None) -> jax.Array:
    """`grouped_mlp`'s result from jax.lax.ragged_dot's grouped products (the backend's
    own; `moe.grouped = "ragged_dot"`)."""
    wu = w[UP[activation]]
    G, K = wu.shape[:2]
    pre = jax.lax.ragged_dot(x, wu.reshape(G, K, -1), sizes).reshape(x.shape[0],
                                                                    *wu.shape[2:])
    if activation is None:
        return pre
    return jax.lax.ragged_dot(activate(pre, activation), w["w2"], sizes)
