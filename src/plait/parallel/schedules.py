"""Pipeline schedules as plain tables, built in pure Python.

A schedule gives each pipeline rank a program: an ordered list of actions
(forward, backward, or for zero-bubble schedules input-gradient and
weight-gradient) on (pipe, stage, microbatch). Two simulations of those
programs give

- the figures, from a timed run in the papers' units (forward 1, whole
  backward 2, input-gradient 1, weight-gradient 1; each rank starts its next
  action as soon as its inputs exist): bubble (idle share of the makespan),
  bubble_ratio (idle over compute, Megatron's definition), idle time;
- the table the SPMD executor runs, from a lockstep run in ticks: one action
  per rank per tick, an action's inputs produced at an earlier tick, so one
  exchange with each neighbour between ticks carries every message; and each
  rank's peak number of stashed microbatches.

Stages: a pipe has S = D * v stages (v > 1 for schedules that interleave).
Stage s of pipe 0 runs on rank s mod D; pipe 1 (Chimera's upward pipe) runs
stage s on rank D - 1 - (s mod D). A rank's local stages are numbered `chunk`
= pipe * v + s // D.

Each schedule is a `ScheduleKind` (`parallel.schedule_base`) registered in
SCHEDULES, whose attributes (pipes, split backward, default virtual stages,
durations, constraints) are all the executor, the figures and the sweep ask
of it.
"""

from __future__ import annotations

import bisect
import itertools

from plait.errors import UserError
from plait.parallel.schedule_base import BX, DURATION, Action, B, F, Schedule, ScheduleKind, W


def _one_f_one_b(fwd: list[Action], bwd: list[Action], warmup: int) -> list[Action]:
    warmup = min(warmup, len(fwd))
    out = fwd[:warmup]
    for i in range(len(fwd) - warmup):
        out += [fwd[warmup + i], bwd[i]]
    return out + bwd[len(fwd) - warmup:]


class GPipe(ScheduleKind):
    """Every forward, then every backward (Huang et al. 2019)."""

    name = "gpipe"

    def programs(self, s: Schedule) -> list[list[Action]]:
        N = s.microbatches
        return [[Action(F, 0, r, m) for m in range(N)] + [Action(B, 0, r, m) for m in range(N)]
                for r in range(s.stages)]


class OneFOneB(ScheduleKind):
    """D - 1 - rank warm-up forwards, then one forward and one backward in turn
    (PipeDream-Flush, as Megatron-LM orders it)."""

    name = "1f1b"

    def programs(self, s: Schedule) -> list[list[Action]]:
        D, N = s.stages, s.microbatches
        return [_one_f_one_b([Action(F, 0, r, m) for m in range(N)],
                             [Action(B, 0, r, m) for m in range(N)], D - 1 - r)
                for r in range(D)]


class Interleaved(ScheduleKind):
    """Interleaved 1F1B with v stages per rank, in Megatron-LM's order."""

    name = "interleaved"
    default_virtual = 2
    interleaves = True

    def check(self, D: int, N: int, v: int) -> None:
        super().check(D, N, v)
        if v < 2:
            raise UserError("the interleaved schedule needs pipeline.virtual_stages >= 2")
        if N % D:
            raise UserError(f"the interleaved schedule needs pipeline.microbatches ({N}) to be a "
                            f"multiple of the pipeline stages ({D})")

    def programs(self, s: Schedule) -> list[list[Action]]:
        D, N, v = s.stages, s.microbatches, s.virtual
        groups = [range(g, g + D) for g in range(0, N, D)]
        progs = []
        for r in range(D):
            fwd = [Action(F, 0, c * D + r, m) for grp in groups for c in range(v) for m in grp]
            bwd = [Action(B, 0, c * D + r, m) for grp in groups for c in reversed(range(v))
                   for m in grp]
            progs.append(_one_f_one_b(fwd, bwd, (D - r - 1) * 2 + (v - 1) * D))
        return progs


class Chimera(ScheduleKind):
    """Two pipelines in opposite directions; each rank holds one stage of each (Li &
    Hoefler 2021). Its published bubble assumes forward and backward of equal length."""

    name = "chimera"
    pipes = 2
    durations = {**DURATION, B: 1}

    def check(self, D: int, N: int, v: int) -> None:
        super().check(D, N, v)
        if D % 2 or N % D:
            raise UserError(f"Chimera needs an even number of stages and microbatches a "
                            f"multiple of the stages (got {D} stages, {N} microbatches)")

    def programs(self, s: Schedule) -> list[list[Action]]:
        return _chimera_programs(s)


class ZeroBubbleH1(ScheduleKind):
    """1F1B with the backward split into input and weight gradients, the weight
    gradients deferred into the cooldown (Qi et al. 2024, ZB-H1)."""

    name = "zb-h1"
    split_backward = True

    def programs(self, s: Schedule) -> list[list[Action]]:
        return _zb_h1(s)


SCHEDULES: dict[str, ScheduleKind] = {k.name: k() for k in (
    GPipe, OneFOneB, Interleaved, Chimera, ZeroBubbleH1)}


def kind(name: str) -> ScheduleKind:
    if name not in SCHEDULES:
        raise UserError(f"unknown pipeline schedule '{name}'; choose one of "
                        f"{', '.join(SCHEDULES)}")
    return SCHEDULES[name]


def _greedy(s: Schedule, pending: dict[int, dict[Action, None]], key,
            may_start) -> list[list[Action]]:
    """Build programs by a lockstep run: each tick, each rank starts its best ready action
    (least `key` of those `may_start(rank, action, in_flight)` allows; in flight are
    the rank's microbatches between forward and backward). An action is ready once the
    last of its dependencies has run: counted down, and each rank's ready actions kept
    in key order, so a tick looks only as far as the first one that may start (a
    chimera of 16 stages and 1024 microbatches took minutes when every tick searched
    every pending action). `pending` (each rank's actions, an ordered set) loses each
    action as it starts; a `may_start` may read it."""
    users: dict[Action, list[Action]] = {}
    waiting: dict[Action, int] = {}
    rank_of: dict[Action, int] = {}
    order: dict[Action, tuple] = {}
    for r, actions in pending.items():
        for i, a in enumerate(actions):
            rank_of[a], order[a] = r, (key(a), i)  # i: ties go to the earlier action
            deps = s.deps(a)
            waiting[a] = len(deps)
            for d in deps:
                users.setdefault(d, []).append(a)
    ready = {r: sorted((order[a], a) for a in actions if not waiting[a])
             for r, actions in pending.items()}
    inflight = dict.fromkeys(range(s.stages), 0)
    progs: list[list[Action]] = [[] for _ in range(s.stages)]
    ticks, left = 0, sum(len(x) for x in pending.values())
    while left:
        started = []
        for r in range(s.stages):
            for i, (_, a) in enumerate(ready[r]):
                if may_start(r, a, inflight[r]):
                    del ready[r][i]
                    del pending[r][a]
                    progs[r].append(a)
                    inflight[r] += 1 if a.kind == F else -1 if a.kind in (B, W) else 0
                    started.append(a)
                    break
        for a in started:  # ready from the next tick on: lockstep
            for u in users.get(a, ()):
                waiting[u] -= 1
                if not waiting[u]:
                    bisect.insort(ready[rank_of[u]], (order[u], u))
        left -= len(started)
        ticks += 1
        if ticks > 8 * sum(len(p) for p in progs) + 64:
            raise AssertionError(f"{s.name} schedule does not make progress")
    return progs


def _by_rank(s: Schedule, microbatches: int, pipe_of) -> dict[int, dict[Action, None]]:
    """Each rank's forward and backward of every microbatch through its pipe
    (`pipe_of(m)`), in microbatch order."""
    pending: dict[int, dict[Action, None]] = {r: {} for r in range(s.stages)}
    for m in range(microbatches):
        p = pipe_of(m)
        for st in range(s.stages):
            pending[s.rank_of(p, st)].update({Action(F, p, st, m): None, Action(B, p, st, m): None})
    return pending


def _chimera_unit(s: Schedule) -> list[list[Action]]:
    """One basic unit (N = D): each pipe takes D/2 microbatches. Greedy: backward
    first, then the stage nearest the end of its pipe; at most D in flight per rank.
    Its peaks run from D/2 + 1 (the end ranks) to D (the middle), as in the paper."""
    D = s.stages
    return _greedy(s, _by_rank(s, D, lambda m: int(m >= D // 2)),
                   key=lambda a: (a.kind != B, -a.stage, a.mb),
                   may_start=lambda r, a, inflight: a.kind == B or inflight < D)


def _chimera_programs(s: Schedule) -> list[list[Action]]:
    """N = kD: k basic units concatenated, the next unit's work filling the previous
    unit's tail (Li & Hoefler 2021, section 3.5). A rank starts the next unit only
    once its current unit has no forward left, and keeps the basic unit's peak in
    flight, so memory stays the unit's ([D/2 + 1, D] microbatches per rank) while
    ticks and bubble are those of one long unit: 2N + D - 2 ticks."""
    D, N = s.stages, s.microbatches
    unit = Schedule(s.kind, D, D, 1)
    unit.programs = _chimera_unit(unit)
    if N == D:
        return unit.programs
    unit.table = _lockstep(unit)
    cap = peak_inflight(unit)
    pending = _by_rank(s, N, lambda m: int(m % D >= D // 2))

    def may_start(r: int, a: Action, inflight: int) -> bool:
        # pending[r] is in microbatch order: its oldest unit comes first.
        unit, oldest = a.mb // D, next(iter(pending[r])).mb // D
        if unit == oldest:
            return a.kind == B or inflight < D
        return unit == oldest + 1 and (a.kind == B or inflight < cap[r]) and not any(
            x.kind == F for x in itertools.takewhile(lambda x: x.mb // D == oldest, pending[r]))

    return _greedy(s, pending, key=lambda a: (a.kind != B, a.mb // D, -a.stage, a.mb),
                   may_start=may_start)


def _zb_h1(s: Schedule) -> list[list[Action]]:
    """ZB-H1 (Qi et al. 2024): 1F1B's warm-up (D - 1 - r forwards on rank r), then
    forward, input gradient, and the weight gradient of the microbatch r places
    earlier: rank r defers r weight gradients, which fill its cooldown. Every rank
    then holds at most D microbatches from forward to weight gradient (1F1B's
    peak) and idles a third of 1F1B's time (T_F = T_Bx = T_W)."""
    D, N = s.stages, s.microbatches
    progs = []
    for r in range(D):
        warm = min(D - 1 - r, N)
        prog = [Action(F, 0, r, m) for m in range(warm)]
        w_next = 0
        for i in range(N):
            if warm + i < N:
                prog.append(Action(F, 0, r, warm + i))
            prog.append(Action(BX, 0, r, i))
            while w_next <= i - r:
                prog.append(Action(W, 0, r, w_next))
                w_next += 1
        prog += [Action(W, 0, r, m) for m in range(w_next, N)]
        progs.append(prog)
    return progs


def _timed(s: Schedule) -> dict:
    """Run the programs with the papers' durations; idle time and makespan per rank.

    Forward 1, whole backward 2, input and weight gradient 1 each (the zero-bubble
    paper's T_F = T_B = T_W). Chimera's published bubble assumes forward and
    backward of equal length, so its figures use 1 and 1.
    """
    duration = s.kind.durations
    finish: dict[Action, int] = {}
    free = [0] * s.stages
    pos = [0] * s.stages
    remaining = sum(len(p) for p in s.programs)
    t = 0
    busy = [0] * s.stages
    while remaining:
        for r in range(s.stages):
            if pos[r] >= len(s.programs[r]) or free[r] > t:
                continue
            a = s.programs[r][pos[r]]
            if all(d in finish and finish[d] <= t for d in s.deps(a)):
                finish[a] = t + duration[a.kind]
                free[r] = finish[a]
                busy[r] += duration[a.kind]
                pos[r] += 1
                remaining -= 1
        t += 1
    makespan = max(finish.values())
    idle = [makespan - b for b in busy]
    return {"makespan": makespan, "idle": idle, "busy": busy}


def _lockstep(s: Schedule) -> list[list[Action | None]]:
    done_at: dict[Action, int] = {}
    pos = [0] * s.stages
    table: list[list[Action | None]] = []
    total = sum(len(p) for p in s.programs)
    while len(done_at) < total:
        t = len(table)
        row: list[Action | None] = []
        for r in range(s.stages):
            a = s.programs[r][pos[r]] if pos[r] < len(s.programs[r]) else None
            if a is not None and all(done_at.get(d, t) < t for d in s.deps(a)):
                row.append(a)
                pos[r] += 1
            else:
                row.append(None)
        for a in row:
            if a is not None:
                done_at[a] = t
        table.append(row)
        if t > 4 * total + 16:  # a program order that deadlocks is a bug here
            raise AssertionError(f"{s.name} schedule does not make progress")
    return table


def peak_inflight(s: Schedule) -> list[int]:
    """Per rank, most microbatches whose forward ran and whose weight gradient has not."""
    peaks = []
    for r in range(s.stages):
        live = peak = 0
        for row in s.table:
            a = row[r]
            if a is None:
                continue
            if a.kind == F:
                live += 1
                peak = max(peak, live)
            elif a.kind in (B, W):
                live -= 1
        peaks.append(peak)
    return peaks


def check(name: str, D: int, N: int, v: int) -> None:
    """One-line errors for a schedule these sizes cannot run."""
    kind(name).check(D, N, v)


def build(name: str, stages: int, microbatches: int, virtual: int = 0) -> Schedule:
    """The schedule `name` for D = stages ranks and N microbatches (and v virtual stages,
    0 = the schedule's default), with its figures."""
    k = kind(name)
    D, N, v = stages, microbatches, virtual or k.default_virtual
    k.check(D, N, v)
    s = Schedule(k, D, N, v)
    s.programs = k.programs(s)
    s.table = _lockstep(s)
    timed = _timed(s)
    idle, busy = max(timed["idle"]), timed["busy"][0]
    s.figures = {
        "schedule": name, "stages": D, "microbatches": N, "virtual_stages": v,
        "bubble": idle / timed["makespan"],
        "bubble_ratio": idle / busy,
        "idle_time": idle,
        "makespan": timed["makespan"],
        "ticks": len(s.table),
        "peak_inflight": peak_inflight(s),
        # What each rank computes, in one stage's forward (F 1, B 2, Bx 1, W 1): a split
        # backward costs what the whole one does.
        "work_per_rank": [sum(DURATION[a.kind] for a in prog) for prog in s.programs],
    }
    return s
