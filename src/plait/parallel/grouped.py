"""Grouped matrix products for dropless experts: rows sorted by group, each group's rows
times its own weight, at (about) the FLOPs of the rows actually routed.

`jax.lax.ragged_dot` says exactly this, but what it costs is the backend's choice:
XLA:CPU expands it into a dense product over every group's zero-padded rows, G times
the FLOPs and an activation per group (docs/architecture.md, "Dropless"). `tiles`
gets the same result from plain XLA: each group's rows are laid out from a multiple of
a tile of rows, so every tile belongs to one group, and a loop over the tiles
multiplies each by its group's weight (a dynamic index, no gathered copy). Rows past
the groups' total (assignments to another rank's experts) come back as zeros, as
ragged_dot gives them.

The buffer has room for the worst case (every row in the groups, each group padded
by most of a tile), but the loop runs only over the tiles that hold rows: a static
loop over the tiles of the rows a balanced routing gives (`expected`), then a loop
whose trip count is the tiles actually occupied past those. Over an `expert` axis of
X ranks the buffer holds the whole group's X x N x k rows and a balanced rank's
groups N x k of them, so this is the difference between X times the experts' FLOPs
and their share; and the compiled program's FLOPs, which count the static loop (a
loop of unknown trip count counts once), price the balanced case. A custom VJP runs
the backward over the same tiles (JAX cannot reverse a loop of dynamic length).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

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


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _tile_products(xp: jax.Array, w: jax.Array, tile_group: jax.Array, occupied: jax.Array,
                   static: int) -> jax.Array:
    """xp [T, tile, K], w [G, K, N], tile_group [T] (G: no group), occupied (the tiles
    that hold rows come first) -> [T, tile, N]; tiles past `occupied` are zeros."""
    return _forward(xp, w, tile_group, occupied, static)


def _forward(xp, w, tile_group, occupied, static):
    G = w.shape[0]

    def body(t, y):
        g = tile_group[t]
        yt = xp[t] @ w[jnp.minimum(g, G - 1)]
        return y.at[t].set(jnp.where(g < G, yt, jnp.zeros_like(yt)))

    y = jnp.zeros(xp.shape[:2] + w.shape[2:], jnp.result_type(xp, w))
    return _over_tiles(body, varying_like(y, xp, w, tile_group), static, occupied)


def _tile_products_fwd(xp, w, tile_group, occupied, static):
    return _forward(xp, w, tile_group, occupied, static), (xp, w, tile_group, occupied)


def _tile_products_bwd(static, res, dy):
    xp, w, tile_group, occupied = res
    G = w.shape[0]

    def body(t, c):
        dx, dw = c
        g = tile_group[t]
        gi = jnp.minimum(g, G - 1)
        dyt = jnp.where(g < G, dy[t], jnp.zeros_like(dy[t]))
        dx = dx.at[t].set((dyt @ w[gi].T).astype(dx.dtype))
        dw = dw.at[gi].add(jnp.matmul(xp[t].T, dyt, preferred_element_type=jnp.float32))
        return dx, dw

    like = (xp, w, tile_group, dy)
    init = (varying_like(jnp.zeros_like(xp), *like),
            varying_like(jnp.zeros(w.shape, jnp.float32), *like))
    dx, dw = _over_tiles(body, init, static, occupied)
    return dx, dw.astype(w.dtype), None, None


_tile_products.defvjp(_tile_products_fwd, _tile_products_bwd)


def _tile_loop(x: jax.Array, w: jax.Array, sizes: jax.Array, first: jax.Array, tile: int,
               static: int) -> jax.Array:
    """Rows [first[g], first[g] + sizes[g]) of x [M, K] through w[g] in the loop over
    tiles -> [M, N], zeros elsewhere. The loop is `static` tiles long, then as long as
    the occupied tiles past those."""
    M, K = x.shape
    G = w.shape[0]
    T = -(-M // tile) + G
    padded = -(-sizes // tile) * tile
    pends = jnp.cumsum(padded)
    i = jnp.arange(M)
    g = _group_of(i, first + sizes)
    gi = jnp.minimum(g, G - 1)
    inside = (g < G) & (i >= first[gi])
    dest = jnp.where(inside, pends[gi] - padded[gi] + i - first[gi], T * tile)
    xp = jnp.zeros((T * tile, K), x.dtype).at[dest].set(x, mode="drop", unique_indices=True)
    tile_group = _group_of(jnp.arange(T) * tile, pends)
    occupied = (pends[-1] // tile).astype(jnp.int32)
    # the weight varies where the rows do before the custom VJP, whose backward then
    # gives its gradient per rank: the cast's transpose sums it across them
    yp = _tile_products(xp.reshape(T, tile, K), varying_like(w, xp, sizes), tile_group,
                        occupied, min(T, static))
    return jnp.take(yp.reshape(T * tile, -1), dest, axis=0, mode="fill", fill_value=0)


def tiles(x: jax.Array, w: jax.Array, sizes: jax.Array, expected: int | None = None,
          bulk: float = 1.0) -> jax.Array:
    """x [M, K] sorted by group, w [G, K, N], sizes [G] (their sum at most M) ->
    [M, N]: row i of group g times w[g]; rows past sum(sizes) give zeros. `expected`:
    the rows a balanced routing puts in the groups (default M), which sizes the tiles.
    `bulk`: the first rows of each group, up to `bulk` x a balanced group's share (in
    whole tiles), go through one batched product [G, C, K] x [G, K, N], as fast as a
    dense layer of those FLOPs; only the rows past them (an expert above its share) go
    through the loop over tiles, whose small products in sequence are slow on a GPU.
    0: every row through the loop, whose known part is then a balanced routing's tiles."""
    M, K = x.shape
    G = w.shape[0]
    expected = M if expected is None else max(1, min(expected, M))
    tile = tile_rows(expected, G)
    C = -(-int(bulk * expected / G) // tile) * tile
    starts = jnp.cumsum(sizes) - sizes
    if C == 0:
        return _tile_loop(x, w, sizes, starts, tile, -(-expected // tile))
    i = jnp.arange(M)
    g = _group_of(i, starts + sizes)
    gi = jnp.minimum(g, G - 1)
    rank = i - starts[gi]
    dest = jnp.where((g < G) & (rank < C), gi * C + rank, G * C)
    xb = jnp.zeros((G * C, K), x.dtype).at[dest].set(x, mode="drop", unique_indices=True)
    yb = jnp.einsum("gck,gkn->gcn", xb.reshape(G, C, K), w).reshape(G * C, -1)
    y = jnp.take(yb, dest, axis=0, mode="fill", fill_value=0)
    over = jnp.maximum(sizes - C, 0)
    return y + _tile_loop(x, w, over, starts + sizes - over, tile, 0).astype(y.dtype)


def grouped_matmul(x: jax.Array, w: jax.Array, sizes: jax.Array, how: str,
                   expected: int | None = None, bulk: float = 1.0) -> jax.Array:
    """`how`: "tiles" (above) or "ragged_dot" (jax.lax.ragged_dot, the backend's own).
    `expected`, `bulk`: the rows a balanced routing puts in the groups, and the share of
    them batched (tiles only)."""
    if how == "ragged_dot":
        return jax.lax.ragged_dot(x, w, sizes)
    return tiles(x, w, sizes, expected, bulk)
