"""Context parallelism: the `context` mesh axis splits every sequence.

Each of the C ranks of the axis holds seq / C tokens of every sequence: the
embedding output, the residual stream, the MLP, the logits and the loss are
token-wise and never communicate (the rule set maps `act_seq` to the axis).
Only attention needs the other ranks' keys and values, by one of two methods:

- ring: a `shard_map` over the axis; each rank's key/value block travels round
  the ring (C - 1 `ppermute`s) while every rank attends to the block it holds,
  the partial results merged with an online softmax (running max and sum,
  float32). The backward is its own ring (a custom VJP, as flash attention's):
  it keeps only q, k, v, the output and each query's log-sum-exp, recomputes
  each block's probabilities, and sends every key/value block round again with
  its gradient accumulators (float32), which take one more step home.
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

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from plait.loss_mask import segments, starts, token_ids
from plait.sharding import active, constrain

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


def _stored(a: jax.Array) -> jax.Array:
    """a [rows, seq] in natural order -> in the order the model stores a sequence."""
    order = positions(a.shape[1])
    return a if order is None else a[:, order]


def inputs_targets(tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """tokens [rows, seq + 1] -> (inputs, next-token targets) [rows, seq], in the order
    the model stores a sequence under the active mesh (the inputs as ids; targets the
    loss leaves out stay ~id, loss_mask.kept_targets)."""
    return _stored(token_ids(tokens[:, :-1])), _stored(tokens[:, 1:])


def document_segments(tokens: jax.Array) -> jax.Array:
    """tokens [rows, seq + 1] -> each input's document [rows, seq] (how many documents
    start at or before it in its row: data.document_mask), in the stored order."""
    return _stored(jnp.cumsum(starts(tokens[:, :-1]), axis=1, dtype=jnp.int32))


def document_positions(tokens: jax.Array) -> jax.Array:
    """tokens [rows, seq + 1] -> each input's position within its document [rows, seq]
    (from 0 at each start; a row's first tokens, of a document begun before it, from 0
    at the row's start), in the stored order."""
    first = starts(tokens[:, :-1])
    i = jnp.arange(first.shape[1], dtype=jnp.int32)
    return _stored(i - jax.lax.cummax(jnp.where(first, i, 0), axis=1))


def attend(q: jax.Array, k: jax.Array, v: jax.Array, pos: np.ndarray | None,
           implementation: str | None) -> jax.Array:
    """Causal attention of q [batch, seq, heads, head] over k, v [batch, seq, kv_heads,
    head] stored in the order `pos` (None: natural order, no context axis); within
    loss_mask.documents, each token sees only the earlier tokens of its own document."""
    seg = segments()
    if pos is None:
        if seg is None:
            return jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                implementation=implementation)
        return jax.nn.dot_product_attention(q, k, v, mask=_same_document(seg),
                                            is_causal=True, implementation=implementation)
    mesh, rules = active()
    if rules.context_attention == "allgather":
        return _gathered(q, k, v, pos, seg)
    if "act_kv_heads" in rules.held:
        # Key/value heads too few to split over tensor, so replicated there: each rank's
        # query heads would add to every key/value head's gradient inside the ring's
        # per-block `lax.cond` (an all-reduce in a branch: XLA:CPU hangs, plait refused
        # the step). As many as the query heads instead, split like them (each rank
        # sends its heads' keys round the ring), their gradients summed once after it.
        heads = ("act_batch", "act_seq", "act_heads", "act_head_dim")
        k, v = (constrain(jnp.repeat(x, q.shape[2] // x.shape[2], axis=2), heads)
                for x in (k, v))
    return _ring(q, k, v, pos, mesh, seg)


def _same_document(seg: jax.Array) -> jax.Array:
    """[rows, 1, seq, seq]: whether query and key are of one document."""
    return seg[:, None, :, None] == seg[:, None, None, :]


def _gathered(q, k, v, pos: np.ndarray, seg: jax.Array | None = None) -> jax.Array:
    """Keys and values gathered over the axis (GSPMD: all-gather forward, reduce-scatter
    of their gradients backward); queries stay split, so each rank's scores are [seq / C,
    seq]."""
    full = ("act_batch", None, "act_kv_heads", "act_head_dim")
    heads = ("act_batch", None, "act_heads", "act_head_dim")
    names = full if k.shape[2] != q.shape[2] else heads
    k, v = constrain(k, names), constrain(v, names)
    p = jnp.asarray(pos)
    visible = (p[:, None] >= p[None, :])[None, None]
    if seg is not None:
        visible = visible & _same_document(seg)
    return jax.nn.dot_product_attention(q, k, v, mask=visible, implementation="xla")


def _scores(q, k, qpos, kpos, scale, qseg=None, kseg=None):
    """Scaled scores [b, kv, g, t, s] in float32, hidden where the causal mask hides
    them, and where query and key are of different documents (qseg [b, t], kseg [b, s];
    None: no document mask). q [b, t, kv, g, d], k [b, s, kv, d]."""
    s = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32) * scale
    visible = qpos[:, None] >= kpos[None, :]
    if qseg is not None:
        visible = visible & (qseg[:, None, None, :, None] == kseg[:, None, None, None, :])
    return jnp.where(visible, s, _HIDDEN)


def _rows(seg, part: slice):
    """A document array's rows of one half (None stays None: no document mask)."""
    return None if seg is None else seg[:, part]


def _block(q, k, v, qpos, kpos, scale, qseg=None, kseg=None):
    """One block's unnormalised attention: (max, sum, weighted values) per query. A
    query that sees none of the block's keys (another document) gets max _HIDDEN, and
    merging with its own diagonal block, where it always sees itself, weighs it 0."""
    s = _scores(q, k, qpos, kpos, scale, qseg, kseg)
    m = s.max(-1)
    p = jnp.exp(s - m[..., None])
    o = jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v,
                   preferred_element_type=jnp.float32)
    return m, p.sum(-1), o


def _block_grads(q, k, v, do, delta, lse, qpos, kpos, scale, qseg=None, kseg=None):
    """One block's gradients (dq [b, t, kv, g, d], dk, dv [b, s, kv, d], float32) from
    the forward's log-sum-exp per query: the probabilities are recomputed, not kept."""
    p = jnp.exp(_scores(q, k, qpos, kpos, scale, qseg, kseg) - lse[..., None])
    f32 = jnp.float32
    dv = jnp.einsum("bkgts,btkgd->bskd", p, do, preferred_element_type=f32)
    dp = jnp.einsum("btkgd,bskd->bkgts", do, v, preferred_element_type=f32)
    ds = p * (dp - delta[..., None]) * scale
    dq = jnp.einsum("bkgts,bskd->btkgd", ds, k, preferred_element_type=f32)
    dk = jnp.einsum("bkgts,btkgd->bskd", ds, q, preferred_element_type=f32)
    return dq, dk, dv


def _merge(acc, part):
    """Online softmax: two partial results over disjoint keys -> their union's."""
    m0, l0, o0 = acc
    m1, l1, o1 = part
    m = jnp.maximum(m0, m1)
    a0, a1 = jnp.exp(m0 - m), jnp.exp(m1 - m)
    return m, l0 * a0 + l1 * a1, o0 * _per_query(a0) + o1 * _per_query(a1)


def _per_query(a):
    """[b, kv, g, t] -> [b, t, kv, g, 1], to scale per-query rows of values."""
    return jnp.moveaxis(a, -1, 1)[..., None]


def _pad_front(x, axis: int, half: int, fill=0.0):
    """x for the back half of the queries (or keys) along `axis`, the front half filled."""
    shape = x.shape[:axis] + (half,) + x.shape[axis + 1:]
    return jnp.concatenate([jnp.full(shape, fill, x.dtype), x], axis)


def _pad_back(x, axis: int, half: int):
    shape = x.shape[:axis] + (half,) + x.shape[axis + 1:]
    return jnp.concatenate([x, jnp.zeros(shape, x.dtype)], axis)


class _Ring:
    """Ring attention on one rank of the context axis (inside the shard_map).

    In the balanced order, block `src` seen from rank r (src != r): an earlier rank's
    front chunk precedes both of ours and its back chunk follows both, so every query
    sees the front half of the block; a later rank's two chunks lie between ours, so our
    back half of the queries sees all of it. Either way half the pairs: every rank does
    the same work at every step, and `lax.cond` picks the half.
    """

    def __init__(self, C: int, t: int, kvh: int, g: int, d: int, by_rank: np.ndarray):
        self.C, self.t, self.kvh, self.g, self.half = C, t, kvh, g, t // 2
        self.scale = 1.0 / math.sqrt(d)
        self.ring = [(i, (i + 1) % C) for i in range(C)]
        self.by_rank = by_rank  # every rank's positions: the layout is fixed

    def grouped(self, x):
        return x.reshape(x.shape[0], self.t, self.kvh, self.g, x.shape[-1])

    def send(self, *xs):
        return tuple(jax.lax.ppermute(x, AXIS, self.ring) for x in xs if x is not None)

    def forward(self, q, k, v, seg=None):
        """-> (o [b, t, h, d] in q's dtype, log-sum-exp [b, kv, g, t] float32). `seg`:
        each local token's document (a document mask), which travels with its keys."""
        r = jax.lax.axis_index(AXIS)
        pos = jnp.asarray(self.by_rank)
        qg, qpos, h, sc = self.grouped(q), pos[r], self.half, self.scale
        qseg = kseg = seg
        acc = _block(qg, k, v, qpos, qpos, sc, qseg, kseg)  # the diagonal: causal inside
        for step in range(1, self.C):
            k, v, *sent = self.send(k, v, kseg)
            kseg = sent[0] if sent else None
            src = (r - step) % self.C
            kpos = pos[src]

            def earlier(k=k, v=v, kpos=kpos, kseg=kseg):
                return _block(qg, k[:, :h], v[:, :h], qpos, kpos[:h], sc, qseg,
                              _rows(kseg, slice(None, h)))

            def later(k=k, v=v, kpos=kpos, kseg=kseg):
                m, l_, o = _block(qg[:, h:], k, v, qpos[h:], kpos, sc,
                                  _rows(qseg, slice(h, None)), kseg)
                return (_pad_front(m, 3, h, _HIDDEN), _pad_front(l_, 3, h),
                        _pad_front(o, 1, h))

            acc = _merge(acc, jax.lax.cond(src < r, earlier, later))
        m, l_, o = acc
        o = o / _per_query(l_)
        return o.reshape(q.shape).astype(q.dtype), m + jnp.log(l_)

    def backward(self, q, k, v, o, lse, do, seg=None):
        """The ring again: each block's key/value gradients travel with it and come home
        after the last step."""
        r = jax.lax.axis_index(AXIS)
        pos = jnp.asarray(self.by_rank)
        qg, og, dog = self.grouped(q), self.grouped(o), self.grouped(do)
        delta = jnp.moveaxis(jnp.sum(og.astype(jnp.float32) * dog.astype(jnp.float32), -1),
                             1, -1)  # [b, kv, g, t]
        qpos, h, sc = pos[r], self.half, self.scale
        qseg = kseg = seg
        dq, dk, dv = _block_grads(qg, k, v, dog, delta, lse, qpos, qpos, sc, qseg, kseg)
        for step in range(1, self.C):
            k, v, dk, dv, *sent = self.send(k, v, dk, dv, kseg)
            kseg = sent[0] if sent else None
            src = (r - step) % self.C
            kpos = pos[src]

            def earlier(k=k, v=v, kpos=kpos, kseg=kseg):
                gq, gk, gv = _block_grads(qg, k[:, :h], v[:, :h], dog, delta, lse, qpos,
                                          kpos[:h], sc, qseg, _rows(kseg, slice(None, h)))
                return gq, _pad_back(gk, 1, h), _pad_back(gv, 1, h)

            def later(k=k, v=v, kpos=kpos, kseg=kseg):
                gq, gk, gv = _block_grads(qg[:, h:], k, v, dog[:, h:], delta[..., h:],
                                          lse[..., h:], qpos[h:], kpos, sc,
                                          _rows(qseg, slice(h, None)), kseg)
                return _pad_front(gq, 1, h), gk, gv

            gq, gk, gv = jax.lax.cond(src < r, earlier, later)
            dq, dk, dv = dq + gq, dk + gk, dv + gv
        dk, dv = self.send(dk, dv)  # block r - (C - 1) = r + 1's gradients go home
        return (dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype))


def _ring(q, k, v, pos: np.ndarray, mesh, seg: jax.Array | None = None) -> jax.Array:
    """Ring attention; with `seg` [b, seq] (each token's document, stored order) a
    document mask, whose key side travels round with the keys."""
    C = mesh.shape[AXIS]
    seq, heads, d = q.shape[1], q.shape[2], q.shape[3]
    kvh = k.shape[2]
    ring = _Ring(C, seq // C, kvh, heads // kvh, d, np.asarray(pos).reshape(C, -1))
    seq_spec, lse_spec = P(None, AXIS), P(None, None, None, AXIS)
    extra = () if seg is None else (seg,)
    segs = (seq_spec,) * len(extra)
    on = functools.partial(jax.shard_map, mesh=_context_mesh(mesh), axis_names={AXIS})
    forward = on(ring.forward, in_specs=(seq_spec,) * 3 + segs,
                 out_specs=(seq_spec, lse_spec))

    def backward_of(q, k, v, o, lse, do, *seg):
        return ring.backward(q, k, v, o, lse, do, *seg)

    backward = on(backward_of, in_specs=(seq_spec,) * 4 + (lse_spec, seq_spec) + segs,
                  out_specs=(seq_spec,) * 3)

    @jax.custom_vjp
    def attention(q, k, v, *seg):
        return forward(q, k, v, *seg)[0]

    def attention_fwd(q, k, v, *seg):
        o, lse = forward(q, k, v, *seg)
        return o, (q, k, v, o, lse, seg)

    def attention_bwd(res, do):
        q, k, v, o, lse, seg = res
        return (*backward(q, k, v, o, lse, do, *seg), *(None for _ in seg))

    attention.defvjp(attention_fwd, attention_bwd)
    return attention(q, k, v, *extra)


def _context_mesh(mesh):
    """The mesh a shard_map over the axis names: inside another shard_map (the
    pipeline) the context's abstract mesh, where that one's axes are Manual."""
    context = jax.sharding.get_abstract_mesh()
    return context if not context.empty and context.manual_axes else mesh
