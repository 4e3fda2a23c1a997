"""One SPMD executor for every pipeline schedule.

The schedule's lockstep table becomes an integer array [tick, rank, column].
Inside `shard_map` over `pipeline`, a `lax.scan` runs the ticks; each rank
reads its row and runs its action with `lax.switch`; between ticks every rank
makes one `ppermute` towards the next rank and one towards the previous rank
(no pipeline collective inside a branch). Messages land in an inbox of slots
(activations and gradients share it). A stage is a scan over its layers, each
layer's forward and backward read off its traced vjp (`split_backward`): the
forward residuals that depend on the microbatch wait in a stash slot until
the backward (or only the stage input, when `pipeline.recompute`); residuals
made from the parameters alone are recomputed there instead. Zero-bubble
schedules run the backward as two actions, input gradient (Bx) then weight
gradient (W), which together run each matmul of the backward once; Bx
overwrites the residuals only it read with what W needs, in the same slot.
Slots are assigned by interval colouring of the table (`parallel.tick_table`),
so memory follows the schedule's peak in flight, not the microbatch count.

The model is split as embed -> stages of equal layer counts -> head + loss.
The first stage's rank also embeds, the last stage's rank also runs the head
and the loss, whose gradient it computes at once (so no logits are stashed)
and keeps in the inbox for its backward. Parameters outside the layers
(embedding, final norm, head) are replicated over `pipeline`; their gradients
are summed over it at the end.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from plait.parallel import slots
from plait.parallel.split_backward import LayerGrad
from plait.parallel.tick_table import (
    CHUNK,
    DY_SLOT,
    IN_SLOT,
    KEEP_SLOT,
    KEEP_WRITE,
    KIND,
    MB,
    NEXT,
    OUT_DIR,
    PREV,
    RECV_NEXT,
    RECV_PREV,
    RES_SLOT,
    RES_WRITE,
    TickTable,
)
from plait.sharding import vary_over

AXIS = "pipeline"


@dataclass(frozen=True)
class StageFns:
    """The model, cut for the pipeline. Shapes: x [b, seq, d]; tokens [b, seq + 1]."""

    embed: Callable  # (shared, tokens) -> x
    layer: Callable  # (one layer's params, x[, documents]) -> x; a stage runs its layers
    head_loss: Callable  # (shared, x, tokens) -> mean loss of the microbatch
    # tokens -> each input's document [b, seq] (data.document_mask), given to every layer
    documents: Callable | None = None


def _vary(x):
    return vary_over(x, (AXIS,))


def _f32(t):
    return jax.tree.map(lambda a: a.astype(jnp.float32), t)


class _Stage:
    """A stage's layers (parameters stacked [layers, ...]) run by lax.scan, with the
    layer's forward and backward from `LayerGrad`."""

    def __init__(self, lg: LayerGrad):
        self.lg = lg

    def forward(self, pc, x, docs=None) -> tuple[jax.Array, list]:
        """(output, the stashed residuals of every layer, stacked)."""
        return jax.lax.scan(lambda h, p: self.lg.forward(p, h, docs), x, pc)

    def backward(self, pc, stashed: list, g, docs=None):
        def body(g, xs):
            dp, dh = self.lg.backward(xs[0], xs[1], g, docs)
            return dh, dp

        dx, dp = jax.lax.scan(body, g, (pc, stashed), reverse=True)
        return dp, dx

    def backward_input(self, pc, res_b: list, res_w: list, g, docs=None):
        """(input gradient, what W needs of each layer: the frontier, stacked)."""
        return jax.lax.scan(lambda g, xs: self.lg.backward_input(*xs, g, docs), g,
                            (pc, res_b, res_w), reverse=True)

    def backward_weight(self, pc, res_w: list, frontier: list, docs=None):
        return jax.lax.scan(lambda c, xs: (c, self.lg.backward_weight(*xs, docs)), 0,
                            (pc, res_w, frontier))[1]

    def pick(self, stashed: list, which: list[int]) -> list:
        """The stashed residuals `which` (indices of the layer's residuals)."""
        return [stashed[self.lg.stashed.index(i)] for i in which]


def _stacked(avals, n: int) -> list:
    return [jax.ShapeDtypeStruct((n, *a.shape), a.dtype) for a in avals]


class _Rank:
    """One pipeline rank inside the shard_map: its chunks' forward and backward, the
    action switch of a tick, and the scan over ticks."""

    def __init__(self, p: TickTable, fns: StageFns, stage_local, shared, tokens,
                 act_shape: tuple[int, ...], act_dtype, recompute: bool):
        self.p, self.fns, self.tokens = p, fns, tokens
        self.act_shape, self.act_dtype, self.recompute = act_shape, act_dtype, recompute
        self.split = p.schedule.kind.split_backward
        self.N = p.schedule.microbatches
        self.stage_local = jax.tree.map(lambda a: a[0], stage_local)  # [chunks, L/S, ...]
        # Replicated parameters become varying here, outside the switch: a gradient
        # taken inside a branch with respect to an invariant value would carry an
        # implicit psum over the pipeline, a collective only some ranks reach.
        self.shared = jax.tree.map(_vary, shared)
        self.x0 = _vary(jnp.zeros(act_shape, act_dtype))
        layer0 = jax.tree.map(lambda a: a[0, 0], self.stage_local)
        docs0 = None if fns.documents is None else _vary(jnp.zeros(act_shape[:2], jnp.int32))
        self.stage = _Stage(LayerGrad(fns.layer, layer0, self.x0, docs0))
        self._layouts()
        zeros32 = (lambda t: jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), t))
        self.g_stage0, self.g_shared0 = zeros32(self.stage_local), zeros32(self.shared)

    def _layouts(self):
        """Which arrays the stash and the keep hold per microbatch."""
        L, ex = self.p.layers_per_stage, self.stage.lg.examples()
        x = [jax.ShapeDtypeStruct(self.act_shape, self.act_dtype)]
        self.stash, self.keep = slots.Rows(), slots.Rows()
        if self.recompute:
            self.stash.add("x", x)
            if self.split:  # Bx recomputes the residuals; W's wait in the keep.
                self.keep.add("res_w", _stacked(ex["res_w"], L))
                self.keep.add("frontier", _stacked(ex["frontier"], L))
        elif self.split:
            # W's residuals, Bx's, and after Bx the frontier in Bx's buffers.
            self.stash.add("res_w", _stacked(ex["res_w"], L))
            self.stash.add("res_b", _stacked(ex["res_b"], L))
            self.stash.add("frontier", _stacked(ex["frontier"], L), share="res_b")
        else:
            self.stash.add("stashed", _stacked(ex["stashed"], L))

    def chunk_params(self, c):
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, c, keepdims=False),
                            self.stage_local)

    def out(self, msg=None, s_rows=None, k_rows=None, g_chunk=None, g_shared=None, loss=None):
        """What every branch returns: the same types, all varying over the pipeline."""
        return jax.tree.map(_vary, (
            msg if msg is not None else self.x0,
            s_rows if s_rows is not None else self.stash.zeros(),
            k_rows if k_rows is not None else self.keep.zeros(),
            g_chunk if g_chunk is not None else jax.tree.map(lambda a: a[0], self.g_stage0),
            g_shared if g_shared is not None else self.g_shared0,
            loss if loss is not None else jnp.zeros((), jnp.float32)))

    def embed_grad(self, toks, dx):
        _, vjp_e = jax.vjp(lambda sh: self.fns.embed(sh, toks), self.shared)
        return _f32(vjp_e(dx)[0])

    # --- the stage's passes over a microbatch's stash rows --------------------------
    def forward(self, c, x, docs):
        """(output, stash rows)."""
        y, stashed = self.stage.forward(self.chunk_params(c), x, docs)
        rows, st = self.stash.zeros(), self.stage
        if self.recompute:
            return y, self.stash.write(rows, "x", [x])
        if not self.split:
            return y, self.stash.write(rows, "stashed", stashed)
        rows = self.stash.write(rows, "res_w", st.pick(stashed, st.lg.res_w))
        return y, self.stash.write(rows, "res_b", st.pick(stashed, st.lg.res_b))

    def _recomputed(self, c, s_rows, docs) -> list:
        return self.stage.forward(self.chunk_params(c), self.stash.read(s_rows, "x")[0],
                                  docs)[1]

    def backward(self, c, s_rows, g, docs):
        stashed = (self._recomputed(c, s_rows, docs) if self.recompute
                   else self.stash.read(s_rows, "stashed"))
        return self.stage.backward(self.chunk_params(c), stashed, g, docs)

    def backward_input(self, c, s_rows, g, docs):
        """(input gradient, stash rows, keep rows): what W needs is kept."""
        pc, st, lg = self.chunk_params(c), self.stage, self.stage.lg
        if self.recompute:
            stashed = self._recomputed(c, s_rows, docs)
            res_b, res_w = st.pick(stashed, lg.res_b), st.pick(stashed, lg.res_w)
        else:
            res_w, res_b = self.stash.read(s_rows, "res_w"), self.stash.read(s_rows, "res_b")
        dx, frontier = st.backward_input(pc, res_b, res_w, g, docs)
        if self.recompute:
            k_rows = self.keep.write(self.keep.zeros(), "res_w", res_w)
            return dx, None, self.keep.write(k_rows, "frontier", frontier)
        return dx, self.stash.write(s_rows, "frontier", frontier), None

    def backward_weight(self, c, s_rows, k_rows, docs):
        rows, buf = (k_rows, self.keep) if self.recompute else (s_rows, self.stash)
        return self.stage.backward_weight(self.chunk_params(c), buf.read(rows, "res_w"),
                                          buf.read(rows, "frontier"), docs)

    def act(self, row, inbox, stash, keep):
        """Run this tick's action (the table's KIND column) with lax.switch."""
        c, m, N, fns, out = row[CHUNK], row[MB], self.N, self.fns, self.out
        # The microbatch's tokens whole on every device of the rank: a branch then slices
        # what it needs with no resharding collective (3-D tensor layouts asked GSPMD for
        # a collective-permute, which on CPU waits for every device, and only this
        # rank's branch would reach it).
        toks = jax.lax.with_sharding_constraint(self.tokens[m], jax.sharding.NamedSharding(
            jax.sharding.get_abstract_mesh(), P()))
        docs = None if fns.documents is None else fns.documents(toks)
        x_in = inbox[row[IN_SLOT]]
        s_rows = [b[row[RES_SLOT]] for b in stash]
        k_rows = [b[row[KEEP_SLOT]] for b in keep]

        def f_first():
            y, r = self.forward(c, fns.embed(self.shared, toks).astype(self.act_dtype), docs)
            return out(msg=y, s_rows=r)

        def f_mid():
            y, r = self.forward(c, x_in, docs)
            return out(msg=y, s_rows=r)

        def f_last():
            y, r = self.forward(c, x_in, docs)
            loss, (dsh, dy) = jax.value_and_grad(fns.head_loss, argnums=(0, 1))(
                self.shared, y, toks)
            return out(msg=(dy / N).astype(self.act_dtype), s_rows=r,
                       g_shared=jax.tree.map(lambda g: g / N, _f32(dsh)),
                       loss=loss.astype(jnp.float32))

        def b_first():
            dp, dx = self.backward(c, s_rows, x_in, docs)
            return out(g_chunk=_f32(dp), g_shared=self.embed_grad(toks, dx))

        def b_mid():
            dp, dx = self.backward(c, s_rows, x_in, docs)
            return out(msg=dx.astype(self.act_dtype), g_chunk=_f32(dp))

        def bx_first():
            dx, s2, k2 = self.backward_input(c, s_rows, x_in, docs)
            return out(s_rows=s2, k_rows=k2, g_shared=self.embed_grad(toks, dx))

        def bx_mid():
            dx, s2, k2 = self.backward_input(c, s_rows, x_in, docs)
            return out(msg=dx.astype(self.act_dtype), s_rows=s2, k_rows=k2)

        def w_any():
            return out(g_chunk=_f32(self.backward_weight(c, s_rows, k_rows, docs)))

        # A schedule runs either whole backwards or split ones; the other kind's
        # branches never run and are left empty.
        whole, split = [b_first, b_mid], [bx_first, bx_mid, w_any]
        if self.split:
            whole = [out, out]
        else:
            split = [out, out, out]
        return jax.lax.switch(row[KIND], [out, f_first, f_mid, f_last, *whole, *split])

    def tick(self, carry, t):
        """Receive the previous tick's messages, act, file and send the results."""
        inbox, stash, keep, g_stage, g_shared, loss, send_next, send_prev = carry
        D = self.p.ranks
        from_prev = jax.lax.ppermute(send_next, AXIS, [(i, (i + 1) % D) for i in range(D)])
        from_next = jax.lax.ppermute(send_prev, AXIS, [(i, (i - 1) % D) for i in range(D)])
        row = jnp.asarray(self.p.table)[t, jax.lax.axis_index(AXIS)]
        inbox = inbox.at[row[RECV_PREV]].set(from_prev)
        inbox = inbox.at[row[RECV_NEXT]].set(from_next)
        msg, s_rows, k_rows, g_chunk, g_sh, mb_loss = self.act(row, inbox, stash, keep)
        stash = [b.at[row[RES_WRITE]].set(r) for b, r in zip(stash, s_rows, strict=True)]
        keep = [b.at[row[KEEP_WRITE]].set(r) for b, r in zip(keep, k_rows, strict=True)]
        inbox = inbox.at[row[DY_SLOT]].set(msg)
        c = row[CHUNK]
        g_stage = jax.tree.map(
            lambda acc, g: jax.lax.dynamic_update_index_in_dim(
                acc, jax.lax.dynamic_index_in_dim(acc, c, keepdims=False) + g, c, 0),
            g_stage, g_chunk)
        g_shared = jax.tree.map(jnp.add, g_shared, g_sh)
        send_next = jnp.where(row[OUT_DIR] == NEXT, msg, jnp.zeros_like(msg))
        send_prev = jnp.where(row[OUT_DIR] == PREV, msg, jnp.zeros_like(msg))
        return (inbox, stash, keep, g_stage, g_shared, loss + mb_loss, send_next,
                send_prev), None

    def run(self):
        """(mean loss, this rank's stage gradients [1, chunks, ...], shared gradients)."""
        p = self.p
        inbox = _vary(jnp.zeros((p.inbox_slots + 1, *self.act_shape), self.act_dtype))
        stash = [_vary(b) for b in self.stash.buffers(p.stash_slots)]
        keep = [_vary(b) for b in self.keep.buffers(p.keep_slots)]
        carry = (inbox, stash, keep, jax.tree.map(_vary, self.g_stage0),
                 jax.tree.map(_vary, self.g_shared0), _vary(jnp.zeros((), jnp.float32)),
                 self.x0, self.x0)
        carry, _ = jax.lax.scan(self.tick, carry, jnp.arange(p.table.shape[0]))
        _, _, _, g_stage, g_shared, loss, _, _ = carry
        loss = jax.lax.psum(loss, AXIS) / self.N
        return loss, jax.tree.map(lambda a: a[None], g_stage), jax.lax.psum(g_shared, AXIS)


def run(p: TickTable, fns: StageFns, stage_params, shared, tokens: jax.Array, mesh: Mesh,
        act_shape: tuple[int, ...], act_dtype, recompute: bool):
    """Loss and gradients of one step. stage_params leaves: [D, chunks, layers/stage, ...];
    tokens [N, b, seq + 1]. Returns (loss, stage grads, shared grads), grads in float32."""
    def body(stage_local, shared, tokens):
        return _Rank(p, fns, stage_local, shared, tokens, act_shape, act_dtype,
                     recompute).run()

    return jax.shard_map(
        body, mesh=mesh, in_specs=(P(AXIS), P(), P()), out_specs=(P(), P(AXIS), P()),
        axis_names={AXIS},
    )(stage_params, shared, tokens)


def sum_pipe_copies(g_stages, virtual: int):
    """A second pipe (Chimera's up pipe) holds a copy of every stage: stage s's chunk c of
    pipe 0 sits on rank s, its copy (chunk v + c) on rank D - 1 - s. Both get the sum of
    their gradients, so the copies stay equal. Leaves: [D, 2v, ...]."""
    def one(g):
        total = g[:, :virtual] + jnp.flip(g[:, virtual:], axis=0)
        return jnp.concatenate([total, jnp.flip(total, axis=0)], axis=1)

    return jax.tree.map(one, g_stages)
