"""Context parallelism: the `context` mesh axis splits every sequence.

Each of the C ranks of the axis holds seq / C tokens of every sequence: the
embedding output, the residual stream, the MLP, the logits and the loss are
token-wise and never communicate (the rule set maps `act_seq` to the axis).
Only attention needs the other ranks' keys and values, by one of two methods:

- ring: a `shard_map` over the axis; each rank's key/value block travels round
  the ring (C - 1 `ppermute`s forward, and their transposes backward) while
  every rank attends to the block it holds, the partial results merged with an
  online softmax (running max and sum, float32).
- allgather: keys and values gathered over the axis per layer (GSPMD inserts the
  all-gather, and a reduce-scatter of their gradients), queries kept local.

Causal masks make contiguous slices unequal work (rank 0's tokens see one
block, rank C-1's see all), so sequences are stored in a balanced order: cut
into 2C chunks, rank r holds chunk r and chunk 2C-1-r. Every rank then has the
same number of visible (query, key) pairs, and in the ring each block after
the first is visible to exactly half of the rank's queries or from exactly half
of its keys, so only that half is computed. Inputs, targets and positions
(learned embeddings, RoPE) follow the order; the loss is a mean over tokens and
does not care.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from plait.sharding import active

AXIS = "context"
_HIDDEN = -1e30  # a masked score: exp() of it minus any finite max is 0, never NaN


def size() -> int:
    """The context axis of the step being traced (1 outside one, or without the axis)."""
    ctx = active()
    return 1 if ctx is None else ctx[0].shape.get(AXIS, 1)


def balanced_order(seq: int, ranks: int) -> np.ndarray:
    """Positions in stored order: the sequence cut into 2 x ranks chunks, rank r's
    contiguous slice holding chunk r then chunk 2 x ranks - 1 - r."""
    if ranks == 1:
        return np.arange(seq)
    chunk = seq // (2 * ranks)
    starts = [c for r in range(ranks) for c in (r, 2 * ranks - 1 - r)]
    return np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for c in starts])


def positions(seq: int) -> np.ndarray | None:
    """The position of each stored slot of a sequence of `seq` tokens in the step being
    traced; None when the order is the natural one (no context axis)."""
    c = size()
    return None if c == 1 else balanced_order(seq, c)


def inputs_targets(tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """tokens [rows, seq + 1] -> (inputs, next-token targets) [rows, seq], in the order
    the model stores a sequence under the active mesh."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    order = positions(inputs.shape[1])
    if order is None:
        return inputs, targets
    return inputs[:, order], targets[:, order]


def attend(q: jax.Array, k: jax.Array, v: jax.Array, pos: np.ndarray | None,
           implementation: str | None) -> jax.Array:
    """Causal attention of q [batch, seq, heads, head] over k, v [batch, seq, kv_heads,
    head] stored in the order `pos` (None: natural order, no context axis)."""
    if pos is None:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                            implementation=implementation)
    mesh, rules = active()
    if rules.context_attention == "allgather":
        return _gathered(q, k, v, pos)
    return _ring(q, k, v, pos, mesh)


def _gathered(q, k, v, pos: np.ndarray) -> jax.Array:
    """Keys and values gathered over the axis (GSPMD: all-gather forward, reduce-scatter
    of their gradients backward); queries stay split, so each rank's scores are [seq / C,
    seq]."""
    from plait.sharding import constrain

    full = ("act_batch", None, "act_kv_heads", "act_head_dim")
    heads = ("act_batch", None, "act_heads", "act_head_dim")
    names = full if k.shape[2] != q.shape[2] else heads
    k, v = constrain(k, names), constrain(v, names)
    p = jnp.asarray(pos)
    visible = p[:, None] >= p[None, :]
    return jax.nn.dot_product_attention(q, k, v, mask=visible[None, None],
                                        implementation="xla")


def _block(q, k, v, qpos, kpos, scale):
    """One block's unnormalised attention: (max, sum, weighted values) per query, the
    scores in float32. q [b, t, kv, g, d], k, v [b, s, kv, d]."""
    s = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32) * scale
    s = jnp.where(qpos[:, None] >= kpos[None, :], s, _HIDDEN)
    m = s.max(-1)
    p = jnp.exp(s - m[..., None])
    o = jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v,
                   preferred_element_type=jnp.float32)
    return m, p.sum(-1), o


def _merge(acc, part):
    """Online softmax: two partial results over disjoint keys -> their union's."""
    m0, l0, o0 = acc
    m1, l1, o1 = part
    m = jnp.maximum(m0, m1)
    a0, a1 = jnp.exp(m0 - m), jnp.exp(m1 - m)
    t = lambda a: jnp.moveaxis(a, -1, 1)[..., None]  # [b, kv, g, t] -> [b, t, kv, g, 1]
    return m, l0 * a0 + l1 * a1, o0 * t(a0) + o1 * t(a1)


def _front_padded(part, half: int):
    """A result for the back half of the queries, with the front half empty."""
    m, l_, o = part

    def pad(x, axis, fill):
        shape = x.shape[:axis] + (half,) + x.shape[axis + 1:]
        return jnp.concatenate([jnp.full(shape, fill, x.dtype), x], axis)

    return pad(m, 3, _HIDDEN), pad(l_, 3, 0.0), pad(o, 1, 0.0)


def _visible_half(src, r, qg, k, v, qpos, kpos, scale, half: int):
    """Block `src` seen from rank r (src != r) in the balanced order. An earlier rank's
    front chunk precedes both of ours and its back chunk follows both: every query sees
    the front half of the block. A later rank's two chunks lie between ours: our back
    half sees all of the block. Either way half the pairs, so every rank does equal work."""
    def earlier():
        return _block(qg, k[:, :half], v[:, :half], qpos, kpos[:half], scale)

    def later():
        return _front_padded(_block(qg[:, half:], k, v, qpos[half:], kpos, scale), half)

    return jax.lax.cond(src < r, earlier, later)


def _ring(q, k, v, pos: np.ndarray, mesh) -> jax.Array:
    C = mesh.shape[AXIS]
    seq, h, d = q.shape[1], q.shape[2], q.shape[3]
    kvh = k.shape[2]
    scale = 1.0 / math.sqrt(d)
    ring = [(i, (i + 1) % C) for i in range(C)]
    t = seq // C
    # Every rank's positions (the layout is fixed): no positions travel.
    by_rank = np.asarray(pos).reshape(C, t)

    def body(q, k, v):
        r = jax.lax.axis_index(AXIS)
        qg = q.reshape(q.shape[0], t, kvh, h // kvh, d)
        local = jnp.asarray(by_rank)
        qpos = local[r]
        acc = _block(qg, k, v, qpos, qpos, scale)  # the diagonal: causal inside
        for step in range(1, C):
            k, v = (jax.lax.ppermute(x, AXIS, ring) for x in (k, v))
            src = (r - step) % C
            acc = _merge(acc, _visible_half(src, r, qg, k, v, qpos, local[src], scale,
                                            t // 2))
        _, l_, o = acc
        o = o / jnp.moveaxis(l_, -1, 1)[..., None]
        return o.reshape(q.shape).astype(q.dtype)

    spec = P(None, AXIS)
    return jax.shard_map(body, mesh=_context_mesh(mesh), in_specs=(spec, spec, spec),
                         out_specs=spec, axis_names={AXIS})(q, k, v)


def _context_mesh(mesh):
    """The mesh a shard_map over the axis names: inside another shard_map (the
    pipeline) the context's abstract mesh, where that one's axes are Manual."""
    context = jax.sharding.get_abstract_mesh()
    return context if not context.empty and context.manual_axes else mesh
