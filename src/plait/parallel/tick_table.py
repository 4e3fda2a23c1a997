"""A pipeline schedule laid onto ranks, chunks, layers and buffer slots.

The executor (`parallel.pipeline`) reads an integer array [tick, rank, column]:
per tick and rank, which action runs (KIND), on which chunk and microbatch, which
inbox slot it reads, which stash and keep slots hold its residuals, where its
message goes and where the rank files what arrives. Slots are assigned by
interval colouring (`parallel.slots`), so memory follows the schedule's peak in
flight, not the microbatch count.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from plait.parallel import schedules as sch
from plait.parallel import slots

(KIND, CHUNK, MB, IN_SLOT, RES_SLOT, OUT_DIR, DY_SLOT, RECV_PREV, RECV_NEXT, RES_WRITE,
 KEEP_SLOT, KEEP_WRITE) = range(12)
IDLE, F_FIRST, F_MID, F_LAST, B_FIRST, B_MID, BX_FIRST, BX_MID, W_ANY = range(9)
NONE, NEXT, PREV = 0, 1, 2


@dataclass
class TickTable:
    """A schedule laid onto ranks, chunks, layers and buffer slots: the int array the
    executor indexes, [tick, rank, column].

    Buffers: the inbox (messages and loss gradients), the stash (a microbatch's
    forward residuals, from its forward to its backward; with a split backward and
    no recompute, to its weight gradient, Bx refilling the slot with what W needs)
    and, with a split backward and recompute, the keep (what W needs, from Bx to W).
    """

    schedule: sch.Schedule
    layers_per_stage: int
    table: np.ndarray  # [ticks, D, 12] int32
    inbox_slots: int
    stash_slots: int
    keep_slots: int = 0
    recompute: bool = False
    # Per rank, the slots of each buffer it fills at once: inbox, stash, keep.
    held: dict[str, list[int]] = field(default_factory=dict)

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


def tick_table(schedule: sch.Schedule, layers: int, recompute: bool = False) -> TickTable:
    s = schedule
    S = s.num_stages
    if layers % S:
        raise AssertionError("layer count checked before")
    D, T = s.stages, len(s.table)
    split = s.kind.split_backward
    when = {a: t for t, row in enumerate(s.table) for a in row if a is not None}
    last = S - 1

    def consumer(a: sch.Action) -> sch.Action | None:
        if a.kind == sch.F:
            return sch.Action(sch.F, a.pipe, a.stage + 1, a.mb) if a.stage < last else None
        if a.kind in (sch.B, sch.BX):
            return sch.Action(a.kind, a.pipe, a.stage - 1, a.mb) if a.stage else None
        return None

    def of(kind: str, a: sch.Action) -> sch.Action:
        return sch.Action(kind, a.pipe, a.stage, a.mb)

    # Inbox items: a message (produced at t, stored at t + 1) or a last-stage dy
    # (stored at t), read by the consumer. A split backward's W reads no message:
    # what it needs of the gradient, Bx kept for it.
    inbox, stash, keep = [], [], []
    for a, t in when.items():
        here = s.rank_of(a.pipe, a.stage)
        c = consumer(a)
        if c is not None:
            inbox.append((t + 1, when[c], s.rank_of(c.pipe, c.stage), ("msg", a)))
        if a.kind == sch.F and a.stage == last:
            inbox.append((t, when[of(s.backward_kind, a)], here, ("dy", a)))
        if a.kind == sch.F:
            stash_end = sch.W if split and not recompute else s.backward_kind
            stash.append((t, when[of(stash_end, a)], here, a))
        if a.kind == sch.BX and recompute:
            keep.append((t, when[of(sch.W, a)], here, a))
    in_slot, in_held = slots.colour(inbox, D)
    res_slot, res_held = slots.colour(stash, D)
    keep_slot, keep_held = slots.colour(keep, D)
    n_in, n_res, n_keep = max(in_held), max(res_held), max(keep_held)

    tab = np.zeros((T, D, 12), np.int32)
    for col, trash in ((IN_SLOT, n_in), (RES_SLOT, n_res), (DY_SLOT, n_in), (RECV_PREV, n_in),
                       (RECV_NEXT, n_in), (RES_WRITE, n_res), (KEEP_SLOT, n_keep),
                       (KEEP_WRITE, n_keep)):
        tab[:, :, col] = trash
    for a, t in when.items():
        r = s.rank_of(a.pipe, a.stage)
        row = tab[t, r]
        row[CHUNK] = s.chunk_of(a.pipe, a.stage)
        row[MB] = a.mb
        first, is_last = a.stage == 0, a.stage == last
        fwd = of(sch.F, a)
        if a.kind != sch.W or not recompute:
            row[RES_SLOT] = res_slot[fwd]
        if a.kind == sch.F or (a.kind == sch.BX and not recompute):
            row[RES_WRITE] = res_slot[fwd]
        if recompute and a.kind in (sch.BX, sch.W):
            row[KEEP_SLOT] = keep_slot[of(sch.BX, a)]
            if a.kind == sch.BX:
                row[KEEP_WRITE] = row[KEEP_SLOT]
        if a.kind == sch.F:
            row[KIND] = F_FIRST if first else F_LAST if is_last else F_MID
            if not first:
                row[IN_SLOT] = in_slot[("msg", sch.Action(sch.F, a.pipe, a.stage - 1, a.mb))]
            if is_last:
                row[DY_SLOT] = in_slot[("dy", a)]
        else:
            if a.kind != sch.W:
                if is_last:
                    row[IN_SLOT] = in_slot[("dy", fwd)]
                else:
                    row[IN_SLOT] = in_slot[("msg", sch.Action(a.kind, a.pipe, a.stage + 1, a.mb))]
            row[KIND] = {sch.B: B_FIRST if first else B_MID,
                         sch.BX: BX_FIRST if first else BX_MID, sch.W: W_ANY}[a.kind]
        c = consumer(a)
        if c is not None:
            dest = s.rank_of(c.pipe, c.stage)
            row[OUT_DIR] = NEXT if dest == (r + 1) % D else PREV
            # The receiver files it when it arrives, at the next tick.
            recv = tab[t + 1, dest]
            recv[RECV_PREV if row[OUT_DIR] == NEXT else RECV_NEXT] = in_slot[("msg", a)]
    return TickTable(s, layers // S, tab, n_in, n_res, n_keep, recompute,
                     {"inbox": in_held, "stash": res_held, "keep": keep_held})
