"""Grouped MLPs for dropless experts: rows sorted by group, each group's rows through
its own expert's MLP (or one product), at (about) the FLOPs of the rows actually routed.

`jax.lax.ragged_dot` says this of one product, but what it costs is the backend's
choice: XLA:CPU expands it into a dense product over every group's zero-padded rows,
G times the FLOPs and an activation per group, and on an H100 / H200 it ran at a sixth
of a dense product's speed (docs/architecture.md, "Dropless"). `grouped_mlp` gets the
same result from plain XLA in three parts, all of static shape but the last:

1. bulk: each group's first C rows (`bulk` x a balanced group's share, in whole
   tiles) go to a [G, C, K] buffer and one batched MLP (`expert_mlp`, the capacity
   path's), as fast as a dense layer of those FLOPs, its hidden activations kept.
2. spill: the rows past them are cut into tiles, windows of contiguous rows of one
   group (the last of a group partly its own). The first S tiles (`spill` x the
   rows of a balanced routing) go through one more batched MLP, [S, tile, K] against
   each tile's group's weights gathered [S, ...]: the rows of experts somewhat above
   their share, at a batched product's speed, for S tiles' FLOPs whether they are
   filled or not.
3. loop: the tiles past those (an expert far above its share, every tile with bulk
   and spill 0) run one at a time in a loop whose trip count is known only when it
   runs, reading its rows from x and writing its outputs into y in place (dynamic
   slices and a dynamic weight index: no padded copy). On a GPU each of its
   iterations waits for the host (a while loop's condition), so the loop is for what
   the batched parts cannot hold; when they hold everything it runs no iteration.

Rows past the groups' total (assignments to another rank's experts) come back as
zeros, as ragged_dot gives them. Over an `expert` axis of X ranks the rows are the
whole group's X x N x k and a balanced rank's groups hold N x k of them; the compiled
program's FLOPs, which count the batched parts and the loop once, price the balanced
case. One custom VJP covers the three: JAX cannot reverse a loop of dynamic length.
The backward keeps the bulk MLP's own residuals, the spill's pre-activations (not
its gathered weights, which it gathers again) and the rows: only each loop tile's
forward is recomputed there. The spill's weight gradients are added to the bulk's in
the weights' dtype (an expert's rows in two or three parts, each a product's
gradient); only when the loop has tiles are they copied to float32 for its many
small additions and back.
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


class _Shape(NamedTuple):
    """The static sizes: G groups, C rows of each batched (bulk), S tiles of `tile`
    rows batched (spill); the batched buffer is [G x C + S x tile] rows."""
    G: int
    C: int
    S: int
    tile: int

    @property
    def rows(self) -> int:
        return self.G * self.C + self.S * self.tile


class _Layout(NamedTuple):
    """Where the M sorted rows go. `slot`: each row's row of the batched buffer (bulk,
    then spill tiles; `_Shape.rows`: in neither), and `source`: each buffer row's row
    (M: none), so that rows go in and out by gathers. Past the bulk, tiles of contiguous
    rows of one group: tile t is rows [start[t], start[t] + length[t]) of group
    `group[t]` (G: none); the first S are the spill's, the first `occupied` hold rows."""
    slot: jax.Array
    source: jax.Array
    start: jax.Array
    length: jax.Array
    group: jax.Array
    occupied: jax.Array


def _layout(M: int, sizes: jax.Array, shape: _Shape) -> _Layout:
    """Each group's first C rows to the bulk, the rest to tiles of their own group (room
    for the worst case: ceil(M / tile) + G tiles), the first S tiles to the spill."""
    G, C, S, tile = shape
    T = -(-M // tile) + G
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    i = jnp.arange(M)
    g = _group_of(i, ends)  # G past the last group
    gi = jnp.minimum(g, G - 1)
    rank = i - starts[gi]
    over = jnp.maximum(sizes - C, 0)
    count = -(-over // tile)
    tends = jnp.cumsum(count)
    o = jnp.maximum(rank - C, 0)  # a row's place among its group's rows past the bulk
    ti = tends[gi] - count[gi] + o // tile  # and its tile
    spill = G * C + ti * tile + o % tile
    slot = jnp.where(g >= G, shape.rows, jnp.where(
        rank < C, gi * C + rank, jnp.where(ti < S, spill, shape.rows)))
    t = jnp.arange(T)
    group = _group_of(t, tends)
    tg = jnp.minimum(group, G - 1)
    start = ends[tg] - over[tg] + (t - tends[tg] + count[tg]) * tile
    length = jnp.where(group < G, jnp.clip(ends[tg] - start, 0, tile), 0)
    c, r = jnp.arange(C), jnp.arange(tile)
    source = jnp.concatenate([
        jnp.where(c < sizes[:, None], starts[:, None] + c, M).reshape(-1),
        jnp.where(r < length[:S, None], start[:S, None] + r, M).reshape(-1)])
    return _Layout(slot, source, start, length, group, tends[-1].astype(jnp.int32))


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
        return jnp.einsum("...ecd,edgf->...ecgf", h, wu)
    return jnp.einsum("...ecd,edf->...ecf", h, wu)


def _down(w2: jax.Array | None, pre: jax.Array, activation: str | None) -> jax.Array:
    """The activation, then the second product (None: no activation, no product)."""
    if activation is None:
        return pre
    hidden = swiglu(pre[..., 0, :], pre[..., 1, :]) if activation == "swiglu" else gelu(pre)
    return jnp.einsum("...ecf,efd->...ecd", hidden, w2)


def expert_mlp(w: dict[str, jax.Array], h: jax.Array, activation: str | None) -> jax.Array:
    """Every expert's MLP on its own rows: h [..., E, C, d] -> [..., E, C, d]. None: the
    one product h @ w["w"] (a grouped matmul)."""
    return _down(w.get("w2"), _up(w[UP[activation]], h, activation), activation)


def _spill_backward(xs: jax.Array, pre: jax.Array | None, ws: dict, dys: jax.Array,
                    activation: str | None) -> tuple[jax.Array, dict]:
    """The spill MLP's gradients from its rows xs, its kept pre-activations and its
    weights gathered again: autodiff of each product, whose forward is then dead code
    (XLA drops it), so nothing is multiplied twice."""
    grads = {}
    if activation is not None:
        _, pull = jax.vjp(lambda p, w2: _down(w2, p, activation), pre, ws["w2"])
        dys, grads["w2"] = pull(dys)
    _, pull = jax.vjp(lambda x, wu: _up(wu, x, activation), xs, ws[UP[activation]])
    dxs, grads[UP[activation]] = pull(dys)
    return dxs, grads


def _tile_mlp(xt: jax.Array, wg: dict, activation: str | None) -> jax.Array:
    """One group's MLP (weights wg, each [1, ...]) on one tile's rows [tile, K]."""
    return expert_mlp(wg, xt[None], activation)[0]


def _of_group(w: dict, g: jax.Array) -> dict:
    """The weights of one group g (a scalar), each [1, ...]."""
    G = next(iter(w.values())).shape[0]
    return {k: v[jnp.minimum(g, G - 1)][None] for k, v in w.items()}


def _of_groups(w: dict, g: jax.Array) -> dict:
    """The weights of groups g (each [len(g), ...]; past the last group: the last's)."""
    G = next(iter(w.values())).shape[0]
    return {k: jnp.take(v, jnp.minimum(g, G - 1), axis=0) for k, v in w.items()}


def _add_to_groups(dw: dict, g: jax.Array, dwg: dict) -> dict:
    """dw ([G, ...]) plus each of dwg's gradients at its group g."""
    G = next(iter(dw.values())).shape[0]
    return {k: dw[k].at[jnp.minimum(g, G - 1)].add(dwg[k].astype(dw[k].dtype)) for k in dw}


def _loop_forward(x: jax.Array, w: dict, lay: _Layout, activation: str | None,
                  shape: _Shape, y: jax.Array) -> jax.Array:
    """y [M, N] with each loop tile's rows of x [M, K] through its group's MLP written
    in (in place, one tile at a time)."""
    M, K = x.shape
    tile = shape.tile

    def body(t, y):
        first, own = _tile_at(lay, t, M, tile)
        xt = jax.lax.dynamic_slice(x, (first, 0), (tile, K))
        yt = _tile_mlp(xt, _of_group(w, lay.group[t]), activation).astype(y.dtype)
        kept = jax.lax.dynamic_slice(y, (first, 0), (tile, y.shape[1]))
        return jax.lax.dynamic_update_slice(y, jnp.where(own[:, None], yt, kept), (first, 0))

    y = varying_like(y, x, *w.values(), lay.start)
    return jax.lax.fori_loop(shape.S, jnp.maximum(lay.occupied, shape.S), body, y)


def _loop_backward(x: jax.Array, w: dict, lay: _Layout, activation: str | None,
                   shape: _Shape, dy: jax.Array, dx: jax.Array, dw: dict):
    """The loop's gradients over the same tiles (JAX cannot reverse a loop of dynamic
    length), each tile's forward recomputed: the tiles' rows of dx written in, their
    weight gradients added to dw (float32)."""
    M, K = x.shape
    tile = shape.tile

    def body(t, c):
        dx, dw = c
        first, own = _tile_at(lay, t, M, tile)
        g = jnp.minimum(lay.group[t], next(iter(w.values())).shape[0] - 1)
        xt = jax.lax.dynamic_slice(x, (first, 0), (tile, K))
        dyt = jax.lax.dynamic_slice(dy, (first, 0), (tile, dy.shape[1]))
        dyt = jnp.where(own[:, None], dyt, jnp.zeros_like(dyt))
        yt, pull = jax.vjp(lambda xt, wg: _tile_mlp(xt, wg, activation), xt, _of_group(w, g))
        dxt, dwg = pull(dyt.astype(yt.dtype))
        kept = jax.lax.dynamic_slice(dx, (first, 0), (tile, K))
        dx = jax.lax.dynamic_update_slice(
            dx, jnp.where(own[:, None], dxt.astype(dx.dtype), kept), (first, 0))
        return dx, {k: dw[k].at[g].add(dwg[k][0].astype(jnp.float32)) for k in dw}

    return jax.lax.fori_loop(shape.S, jnp.maximum(lay.occupied, shape.S), body, (dx, dw))


def _rows(a: jax.Array, index: jax.Array) -> jax.Array:
    """a's rows at index (zeros where it is out of range): how rows go into the batched
    buffer (index `source`) and come out of it (index `slot`), gathers both ways."""
    return jnp.take(a, index, axis=0, mode="fill", fill_value=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _grouped(x: jax.Array, w: dict, lay: _Layout, activation: str | None, shape: _Shape
             ) -> jax.Array:
    """x [M, K] through the groups' MLPs (weights w, each [G, ...]) as `lay` places its
    rows -> [M, N]. A custom VJP: the loop's length is known only when it runs."""
    return _grouped_fwd(x, w, lay, activation, shape)[0]


def _grouped_fwd(x, w, lay, activation, shape):
    G, C, S, tile = shape
    out = jax.eval_shape(functools.partial(_tile_mlp, activation=activation), x[:1],
                         _of_groups(w, jnp.zeros(1, jnp.int32)))
    pull = pre = None
    if shape.rows:
        buf = _rows(x, lay.source)
        parts = []
        if C:
            yb, pull = jax.vjp(lambda xb, w: expert_mlp(w, xb, activation),
                               buf[:G * C].reshape(G, C, -1), w)
            parts.append(yb.reshape(G * C, -1))
        if S:  # keeps its pre-activations, not its gathered weights (gathered again)
            ws = _of_groups(w, lay.group[:S])
            pre = _up(ws[UP[activation]], buf[G * C:].reshape(S, tile, -1), activation)
            parts.append(_down(ws.get("w2"), pre, activation).reshape(S * tile, -1))
            pre = pre if activation else None
        y = _rows(jnp.concatenate(parts).astype(out.dtype), lay.slot)
    else:
        y = jnp.zeros((x.shape[0], out.shape[-1]), out.dtype)
    return _loop_forward(x, w, lay, activation, shape, y), (x, w, lay, pull, pre)


def _grouped_bwd(activation, shape, res, dy):
    x, w, lay, pull, pre = res
    G, C, S, tile = shape
    dw = {k: jnp.zeros_like(v) for k, v in w.items()}
    dx = jnp.zeros_like(x)
    if shape.rows:
        dbuf = _rows(dy, lay.source)
        parts = []
        if C:
            dxb, dwb = pull(dbuf[:G * C].reshape(G, C, -1))
            parts.append(dxb.reshape(G * C, -1))
            dw = dwb
        if S:
            xs = _rows(x, lay.source[G * C:]).reshape(S, tile, -1)
            dxs, dws = _spill_backward(xs, pre, _of_groups(w, lay.group[:S]),
                                       dbuf[G * C:].reshape(S, tile, -1), activation)
            parts.append(dxs.reshape(S * tile, -1))
            dw = _add_to_groups(dw, lay.group[:S], dws)
        dx = _rows(jnp.concatenate(parts), lay.slot).astype(x.dtype)

    def loop(dx, dw):  # its tiles' weight gradients summed in float32
        dx, dw = _loop_backward(x, w, lay, activation, shape, dy, dx,
                                {k: v.astype(jnp.float32) for k, v in dw.items()})
        return dx, {k: dw[k].astype(w[k].dtype) for k in w}

    # only when the loop has tiles: otherwise the weight gradients are not copied into
    # float32 and back (a GPU decides on the host either way, as a loop's condition)
    like = (x, *w.values(), lay.start, dy)
    dx, dw = varying_like(dx, *like), {k: varying_like(v, *like) for k, v in dw.items()}
    dx, dw = jax.lax.cond(lay.occupied > S, loop, lambda dx, dw: (dx, dw), dx, dw)
    return dx, dw, None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def grouped_mlp(x: jax.Array, w: dict[str, jax.Array], sizes: jax.Array,
                activation: str | None, expected: int | None = None, bulk: float = 1.0,
                spill: float = 0.125) -> jax.Array:
    """x [M, K] sorted by group, weights w (each [G, ...], as `expert_mlp` takes them),
    sizes [G] (their sum at most M) -> [M, N]: row i of group g through group g's MLP
    (`expert_mlp`; activation None: the one product x @ w["w"][g]); rows past
    sum(sizes) give zeros. `expected`: the rows a balanced routing puts in the groups
    (default M), which sizes the tiles and the batched parts. `bulk`: the first rows of
    each group, up to `bulk` x a balanced group's share (in whole tiles), go through one
    batched MLP on [G, C, K]; `spill`: tiles of the rows past them, up to `spill` x the
    expected rows, through another with weights gathered per tile; the rest through the
    loop over tiles (the module's docstring). Both 0: every row through the loop."""
    M = x.shape[0]
    G = next(iter(w.values())).shape[0]
    expected = M if expected is None else max(1, min(expected, M))
    tile = min(tile_rows(expected, G), M)
    T = -(-M // tile) + G
    shape = _Shape(G, -(-int(bulk * expected / G) // tile) * tile,
                   min(T, -(-int(spill * expected) // tile)), tile)
    lay = _layout(M, sizes, shape)
    # the weights vary where the rows do before the custom VJP, whose backward then
    # gives their gradients per rank: the cast's transpose sums them across them
    w = {k: varying_like(v, x, sizes) for k, v in w.items()}
    return _grouped(x, w, lay, activation, shape)


def grouped_matmul(x: jax.Array, w: jax.Array, sizes: jax.Array, how: str,
                   expected: int | None = None, bulk: float = 1.0, spill: float = 0.125
                   ) -> jax.Array:
    """x [M, K] sorted by group, w [G, K, N] -> [M, N] (`grouped_mlp` of the one
    product). `how`: "tiles" (`grouped_mlp`) or "ragged_dot" (jax.lax.ragged_dot, the
    backend's own)."""
    if how == "ragged_dot":
        return jax.lax.ragged_dot(x, w, sizes)
    return grouped_mlp(x, {"w": w}, sizes, None, expected, bulk, spill)
