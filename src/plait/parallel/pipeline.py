"""One SPMD executor for every pipeline schedule.

The schedule's lockstep table becomes an integer array [tick, rank, column].
Inside `shard_map` over `pipeline`, a `lax.scan` runs the ticks; each rank
reads its row and runs its action with `lax.switch`; between ticks every rank
makes one `ppermute` towards the next rank and one towards the previous rank
(no pipeline collective inside a branch). Messages land in an inbox of slots
(activations and gradients share it); forward residuals of `jax.vjp` wait in
a stash of slots until their backward (or only the stage input, when
`pipeline.recompute`). Slots are assigned by interval colouring of the table,
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
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from plait.parallel import schedules as sch

AXIS = "pipeline"
(KIND, CHUNK, MB, IN_SLOT, RES_SLOT, OUT_DIR, DY_SLOT, RECV_PREV, RECV_NEXT) = range(9)
IDLE, F_FIRST, F_MID, F_LAST, B_FIRST, B_MID, BX_FIRST, BX_MID, W_ANY = range(9)
NONE, NEXT, PREV = 0, 1, 2


def varying_axes(x) -> frozenset:
    """The mesh axes a value inside shard_map varies over (the attribute moved across JAX)."""
    t = jax.typeof(x)
    vma = getattr(t, "vma", None)
    if vma is None:
        vma = getattr(getattr(t, "manual_axis_type", None), "varying", None)
    return frozenset(vma or ())


def _colour(intervals: list[tuple[int, int, int, object]]) -> tuple[dict, int]:
    """Greedy interval colouring per rank: item -> slot in its rank's buffer, and the
    slots the largest rank needs (SPMD: every rank allocates that many)."""
    ends: dict[int, list[int]] = {}
    slot_of = {}
    for start, end, rank, item in sorted(intervals, key=lambda x: (x[0], x[1])):
        mine = ends.setdefault(rank, [])
        for k, e in enumerate(mine):
            if e < start:
                mine[k] = end
                slot_of[item] = k
                break
        else:
            slot_of[item] = len(mine)
            mine.append(end)
    return slot_of, max((len(v) for v in ends.values()), default=0)


@dataclass
class TickTable:
    """A schedule laid onto ranks, chunks, layers and buffer slots: the int array the
    executor indexes, [tick, rank, column]."""

    schedule: sch.Schedule
    layers_per_stage: int
    table: np.ndarray  # [ticks, D, 9] int32
    inbox_slots: int
    stash_slots: int

    @property
    def ranks(self) -> int:
        return self.schedule.stages

    @property
    def chunks(self) -> int:
        return self.schedule.chunks

    def layer_of(self, rank: int, chunk: int, i: int) -> int:
        """The model layer of layer i of a rank's chunk (every pipe runs the whole model)."""
        return self.schedule.stage_of(rank, chunk)[1] * self.layers_per_stage + i

    def branch_weights(self) -> dict[int, list[float]]:
        """How often each branch of the executor's switch runs per tick, averaged over
        ranks (for reading FLOPs and bytes out of the compiled program)."""
        kinds = self.table[:, :, KIND]
        n = W_ANY + 1
        return {n: [float((kinds == k).mean()) for k in range(n)]}


def tick_table(schedule: sch.Schedule, layers: int) -> TickTable:
    s = schedule
    S = s.num_stages
    if layers % S:
        raise AssertionError("layer count checked before")
    D, T = s.stages, len(s.table)
    when = {a: t for t, row in enumerate(s.table) for a in row if a is not None}
    last = S - 1

    def consumer(a: sch.Action) -> sch.Action | None:
        if a.kind == sch.F:
            return sch.Action(sch.F, a.pipe, a.stage + 1, a.mb) if a.stage < last else None
        if a.kind in (sch.B, sch.BX):
            return sch.Action(a.kind, a.pipe, a.stage - 1, a.mb) if a.stage else None
        return None

    # Inbox items: a message (produced at t, stored at t + 1) or a last-stage dy
    # (stored at t), read by the consumer; zero-bubble weight gradients re-read
    # the gradient their input-gradient action read.
    inbox, stash = [], []
    for a, t in when.items():
        here = s.rank_of(a.pipe, a.stage)
        c = consumer(a)
        if c is not None:
            end = when[c]
            if c.kind == sch.BX:
                end = when[sch.Action(sch.W, c.pipe, c.stage, c.mb)]
            inbox.append((t + 1, end, s.rank_of(c.pipe, c.stage), ("msg", a)))
        if a.kind == sch.F and a.stage == last:
            # The loss gradient is read by the backward, and again by W when split.
            end = when[sch.Action(s.last_use_kind, a.pipe, a.stage, a.mb)]
            inbox.append((t, end, here, ("dy", a)))
        if a.kind == sch.F:
            done = sch.Action(s.last_use_kind, a.pipe, a.stage, a.mb)
            stash.append((t, when[done], here, a))
    in_slot, n_in = _colour(inbox)
    res_slot, n_res = _colour(stash)

    tab = np.zeros((T, D, 9), np.int32)
    tab[:, :, IN_SLOT] = n_in  # the trash slot
    tab[:, :, RES_SLOT] = n_res
    tab[:, :, DY_SLOT] = n_in
    tab[:, :, RECV_PREV] = n_in
    tab[:, :, RECV_NEXT] = n_in
    for a, t in when.items():
        r = s.rank_of(a.pipe, a.stage)
        row = tab[t, r]
        row[CHUNK] = s.chunk_of(a.pipe, a.stage)
        row[MB] = a.mb
        first, is_last = a.stage == 0, a.stage == last
        fwd = sch.Action(sch.F, a.pipe, a.stage, a.mb)
        row[RES_SLOT] = res_slot[fwd]
        if a.kind == sch.F:
            row[KIND] = F_FIRST if first else F_LAST if is_last else F_MID
            if not first:
                row[IN_SLOT] = in_slot[("msg", sch.Action(sch.F, a.pipe, a.stage - 1, a.mb))]
            if is_last:
                row[DY_SLOT] = in_slot[("dy", a)]
        else:
            grad_kind = sch.BX if a.kind == sch.W else a.kind
            if is_last:
                row[IN_SLOT] = in_slot[("dy", fwd)]
            else:
                row[IN_SLOT] = in_slot[("msg", sch.Action(grad_kind, a.pipe, a.stage + 1, a.mb))]
            row[KIND] = {sch.B: B_FIRST if first else B_MID,
                         sch.BX: BX_FIRST if first else BX_MID, sch.W: W_ANY}[a.kind]
        c = consumer(a)
        if c is not None:
            dest = s.rank_of(c.pipe, c.stage)
            row[OUT_DIR] = NEXT if dest == (r + 1) % D else PREV
            # The receiver files it when it arrives, at the next tick.
            recv = tab[t + 1, dest]
            recv[RECV_PREV if row[OUT_DIR] == NEXT else RECV_NEXT] = in_slot[("msg", a)]
    return TickTable(s, layers // S, tab, n_in, n_res)


@dataclass(frozen=True)
class StageFns:
    """The model, cut for the pipeline. Shapes: x [b, seq, d]; tokens [b, seq + 1]."""

    embed: Callable  # (shared, tokens) -> x
    stage: Callable  # (stage_params [layers_per_stage, ...], x) -> x
    head_loss: Callable  # (shared, x, tokens) -> mean loss of the microbatch


def _vary(x):
    return x if AXIS in varying_axes(x) else jax.lax.pcast(x, AXIS, to="varying")


def _f32(t):
    return jax.tree.map(lambda a: a.astype(jnp.float32), t)


class _Rank:
    """One pipeline rank inside the shard_map: its chunks' forward and backward, the
    action switch of a tick, and the scan over ticks."""

    def __init__(self, p: TickTable, fns: StageFns, stage_local, shared, tokens,
                 act_shape: tuple[int, ...], act_dtype, recompute: bool):
        self.p, self.fns, self.tokens = p, fns, tokens
        self.act_shape, self.act_dtype, self.recompute = act_shape, act_dtype, recompute
        self.N = p.schedule.microbatches
        self.stage_local = jax.tree.map(lambda a: a[0], stage_local)  # [chunks, L/S, ...]
        # Replicated parameters become varying here, outside the switch: a gradient
        # taken inside a branch with respect to an invariant value would carry an
        # implicit psum over the pipeline, a collective only some ranks reach.
        self.shared = jax.tree.map(_vary, shared)
        self.x0 = _vary(jnp.zeros(act_shape, act_dtype))
        if recompute:
            self.res_example, self.treedef = [self.x0], None
        else:
            chunk0 = jax.tree.map(lambda a: a[0], self.stage_local)
            _, vjp0 = jax.vjp(fns.stage, chunk0, self.x0)
            self.res_example, self.treedef = jax.tree.flatten(vjp0)
        zeros32 = (lambda t: jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), t))
        self.g_stage0, self.g_shared0 = zeros32(self.stage_local), zeros32(self.shared)
        self.res_zero = [jnp.zeros_like(r) for r in self.res_example]

    def chunk_params(self, c):
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, c, keepdims=False),
                            self.stage_local)

    def forward(self, c, x):
        pc = self.chunk_params(c)
        if self.recompute:
            return self.fns.stage(pc, x), [x]
        y, vjp_fn = jax.vjp(self.fns.stage, pc, x)
        return y, jax.tree.leaves(vjp_fn)

    def backward(self, c, res, g):
        if self.recompute:
            _, vjp_fn = jax.vjp(self.fns.stage, self.chunk_params(c), res[0])
        else:
            vjp_fn = jax.tree.unflatten(self.treedef, res)
        return vjp_fn(g)

    def out(self, msg=None, res=None, g_chunk=None, g_shared=None, loss=None):
        """What every branch returns: the same types, all varying over the pipeline."""
        return jax.tree.map(_vary, (
            msg if msg is not None else self.x0,
            res if res is not None else self.res_zero,
            g_chunk if g_chunk is not None else jax.tree.map(lambda a: a[0], self.g_stage0),
            g_shared if g_shared is not None else self.g_shared0,
            loss if loss is not None else jnp.zeros((), jnp.float32)))

    def embed_grad(self, toks, dx):
        _, vjp_e = jax.vjp(lambda sh: self.fns.embed(sh, toks), self.shared)
        return _f32(vjp_e(dx)[0])

    def act(self, row, inbox, stash):
        """Run this tick's action (the table's KIND column) with lax.switch."""
        c, m, N, fns, out = row[CHUNK], row[MB], self.N, self.fns, self.out
        toks = self.tokens[m]
        x_in = inbox[row[IN_SLOT]]
        res = [s[row[RES_SLOT]] for s in stash]

        def f_first():
            y, r = self.forward(c, fns.embed(self.shared, toks).astype(self.act_dtype))
            return out(msg=y, res=r)

        def f_mid():
            y, r = self.forward(c, x_in)
            return out(msg=y, res=r)

        def f_last():
            y, r = self.forward(c, x_in)
            loss, (dsh, dy) = jax.value_and_grad(fns.head_loss, argnums=(0, 1))(
                self.shared, y, toks)
            return out(msg=(dy / N).astype(self.act_dtype), res=r,
                       g_shared=jax.tree.map(lambda g: g / N, _f32(dsh)),
                       loss=loss.astype(jnp.float32))

        def b_first():
            dp, dx = self.backward(c, res, x_in)
            return out(g_chunk=_f32(dp), g_shared=self.embed_grad(toks, dx))

        def b_mid():
            dp, dx = self.backward(c, res, x_in)
            return out(msg=dx.astype(self.act_dtype), g_chunk=_f32(dp))

        def bx_first():
            return out(g_shared=self.embed_grad(toks, self.backward(c, res, x_in)[1]))

        def bx_mid():
            return out(msg=self.backward(c, res, x_in)[1].astype(self.act_dtype))

        def w_any():
            return out(g_chunk=_f32(self.backward(c, res, x_in)[0]))

        return jax.lax.switch(row[KIND], [out, f_first, f_mid, f_last, b_first, b_mid,
                                          bx_first, bx_mid, w_any])

    def tick(self, carry, t):
        """Receive the previous tick's messages, act, file and send the results."""
        inbox, stash, g_stage, g_shared, loss, send_next, send_prev = carry
        D = self.p.ranks
        from_prev = jax.lax.ppermute(send_next, AXIS, [(i, (i + 1) % D) for i in range(D)])
        from_next = jax.lax.ppermute(send_prev, AXIS, [(i, (i - 1) % D) for i in range(D)])
        row = jnp.asarray(self.p.table)[t, jax.lax.axis_index(AXIS)]
        inbox = inbox.at[row[RECV_PREV]].set(from_prev)
        inbox = inbox.at[row[RECV_NEXT]].set(from_next)
        msg, res, g_chunk, g_sh, mb_loss = self.act(row, inbox, stash)
        is_f = (row[KIND] >= F_FIRST) & (row[KIND] <= F_LAST)
        stash_slot = jnp.where(is_f, row[RES_SLOT], self.p.stash_slots)
        stash = [s.at[stash_slot].set(r) for s, r in zip(stash, res, strict=True)]
        inbox = inbox.at[row[DY_SLOT]].set(msg)
        c = row[CHUNK]
        g_stage = jax.tree.map(
            lambda acc, g: jax.lax.dynamic_update_index_in_dim(
                acc, jax.lax.dynamic_index_in_dim(acc, c, keepdims=False) + g, c, 0),
            g_stage, g_chunk)
        g_shared = jax.tree.map(jnp.add, g_shared, g_sh)
        send_next = jnp.where(row[OUT_DIR] == NEXT, msg, jnp.zeros_like(msg))
        send_prev = jnp.where(row[OUT_DIR] == PREV, msg, jnp.zeros_like(msg))
        return (inbox, stash, g_stage, g_shared, loss + mb_loss, send_next, send_prev), None

    def run(self):
        """(mean loss, this rank's stage gradients [1, chunks, ...], shared gradients)."""
        p = self.p
        inbox = _vary(jnp.zeros((p.inbox_slots + 1, *self.act_shape), self.act_dtype))
        stash = [_vary(jnp.zeros((p.stash_slots + 1, *r.shape), r.dtype))
                 for r in self.res_example]
        carry = (inbox, stash, jax.tree.map(_vary, self.g_stage0),
                 jax.tree.map(_vary, self.g_shared0), _vary(jnp.zeros((), jnp.float32)),
                 self.x0, self.x0)
        carry, _ = jax.lax.scan(self.tick, carry, jnp.arange(p.table.shape[0]))
        _, _, g_stage, g_shared, loss, _, _ = carry
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
