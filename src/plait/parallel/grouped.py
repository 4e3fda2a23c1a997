"""Grouped matrix products for dropless experts: rows sorted by group, each group's rows
times its own weight, at (about) the FLOPs of the rows actually routed.

`jax.lax.ragged_dot` says exactly this, but what it costs is the backend's choice:
XLA:CPU expands it into a dense product over every group's zero-padded rows, G times
the FLOPs and an activation per group (docs/architecture.md, "Dropless"). `tiles`
gets the same result from plain XLA: each group's rows are laid out from a multiple of
a tile of rows, so every tile belongs to one group, and a scan over the tiles
multiplies each by its group's weight (a dynamic index, no gathered copy). The tiles
are a static count, ceil(rows / tile) + groups, so the padding costs at most one tile
per group. Rows past the groups' total (assignments to another rank's experts) come
back as zeros, as ragged_dot gives them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

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


def tiles(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    """x [M, K] sorted by group, w [G, K, N], sizes [G] (their sum at most M) ->
    [M, N]: row i of group g times w[g]; rows past sum(sizes) give zeros."""
    M, K = x.shape
    G = w.shape[0]
    tile = tile_rows(M, G)
    T = -(-M // tile) + G
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    padded = -(-sizes // tile) * tile
    pends = jnp.cumsum(padded)
    i = jnp.arange(M)
    g = _group_of(i, ends)  # G past the last group
    gi = jnp.minimum(g, G - 1)
    dest = jnp.where(g < G, pends[gi] - padded[gi] + i - starts[gi], T * tile)
    xp = jnp.zeros((T * tile, K), x.dtype).at[dest].set(x, mode="drop", unique_indices=True)
    tile_group = _group_of(jnp.arange(T) * tile, pends)

    def step(_, inputs):
        xt, gt = inputs
        yt = xt @ w[jnp.minimum(gt, G - 1)]
        return None, jnp.where(gt < G, yt, jnp.zeros_like(yt))

    _, yp = jax.lax.scan(step, None, (xp.reshape(T, tile, K), tile_group))
    return jnp.take(yp.reshape(T * tile, -1), dest, axis=0, mode="fill", fill_value=0)


def grouped_matmul(x: jax.Array, w: jax.Array, sizes: jax.Array, how: str) -> jax.Array:
    """`how`: "tiles" (above) or "ragged_dot" (jax.lax.ragged_dot, the backend's own)."""
    if how == "ragged_dot":
        return jax.lax.ragged_dot(x, w, sizes)
    return tiles(x, w, sizes)
