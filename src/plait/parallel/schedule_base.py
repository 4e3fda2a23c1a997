"""The vocabulary of pipeline schedules: actions, a schedule's shape over ranks and
chunks, what each action waits for, and the interface every schedule kind fills in
(the kinds, their programs and their figures: `parallel.schedules`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple

from plait.errors import UserError

F, B, BX, W = "F", "B", "Bx", "W"  # forward, whole backward, input grad, weight grad
DURATION = {F: 1, B: 2, BX: 1, W: 1}
# The most actions (every rank's forwards and backwards) a schedule is laid out for:
# zb-h1 of 64 stages x 4096 microbatches (786k) takes 18 s on a 2-core VM, and one of
# 1000 x 100000 would take hours and ~9 GB before anything ran or printed.
MAX_ACTIONS = 2**21


class Action(NamedTuple):
    """One rank's step of a schedule. A named tuple, not a dataclass: building a 64-stage
    schedule hashes actions millions of times, and a tuple's hash is C's (chimera of 64
    stages x 2048 microbatches: 8M hashes, 4.6 s of the dataclass's Python one)."""

    kind: str
    pipe: int
    stage: int
    mb: int

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}" + (f".{self.pipe}" if self.pipe else "")


class ScheduleKind:
    """One pipeline schedule: its attributes, its constraints and its per-rank programs.

    A new schedule is a subclass registered in SCHEDULES; the executor, the
    figures, `plait schedule` and the sweep read only these attributes.
    """

    name: ClassVar[str]
    pipes: ClassVar[int] = 1  # pipelines through the ranks (Chimera: a down and an up pipe)
    split_backward: ClassVar[bool] = False  # backward as input gradient (Bx) + weight (W)
    default_virtual: ClassVar[int] = 1  # stages per rank per pipe when the config says 0
    interleaves: ClassVar[bool] = False  # accepts virtual stages > 1
    # Durations the figures use (the papers' units: forward 1, whole backward 2).
    durations: ClassVar[dict[str, int]] = DURATION

    def check(self, D: int, N: int, v: int) -> None:
        """One-line errors for sizes this schedule cannot run."""
        if D < 1 or N < 1:
            raise UserError(f"a pipeline needs at least 1 stage and 1 microbatch (got {D}, {N})")
        if v != 1 and not self.interleaves:
            raise UserError(f"pipeline.virtual_stages = {v} is only for schedules that "
                            f"interleave stages (interleaved); {self.name} takes 1")
        actions = D * N * v * (3 if self.split_backward else 2)
        if actions > MAX_ACTIONS:
            virtual = f" x {v} virtual stages" if v > 1 else ""
            raise UserError(f"the {self.name} schedule of {D} stages x {N} microbatches{virtual} "
                            f"is {actions:,} actions to lay out, more than plait takes "
                            f"({MAX_ACTIONS:,}: about a minute); use fewer microbatches or "
                            "stages" + (" or virtual stages" if v > 1 else ""))

    def programs(self, s: Schedule) -> list[list[Action]]:
        raise NotImplementedError


@dataclass
class Schedule:
    kind: ScheduleKind
    stages: int  # D: pipeline ranks
    microbatches: int  # N
    virtual: int  # v: stages per rank per pipe
    programs: list[list[Action]] = field(default_factory=list)  # per rank, in order
    table: list[list[Action | None]] = field(default_factory=list)  # [tick][rank]
    figures: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.kind.name

    @property
    def pipes(self) -> int:
        return self.kind.pipes

    @property
    def num_stages(self) -> int:
        """Stages of one pipe."""
        return self.stages * self.virtual

    @property
    def chunks(self) -> int:
        """Stages each rank holds: one per pipe and virtual stage."""
        return self.pipes * self.virtual

    def rank_of(self, pipe: int, stage: int) -> int:
        r = stage % self.stages
        return r if pipe == 0 else self.stages - 1 - r

    def chunk_of(self, pipe: int, stage: int) -> int:
        return pipe * self.virtual + stage // self.stages

    def stage_of(self, rank: int, chunk: int) -> tuple[int, int]:
        """(pipe, stage) of a rank's chunk."""
        pipe, c = divmod(chunk, self.virtual)
        return pipe, c * self.stages + (rank if pipe == 0 else self.stages - 1 - rank)

    def deps(self, a: Action) -> list[Action]:
        last = self.num_stages - 1
        if a.kind == F:
            return [Action(F, a.pipe, a.stage - 1, a.mb)] if a.stage else []
        if a.kind == W:
            return [Action(BX, a.pipe, a.stage, a.mb)]
        before = [Action(F, a.pipe, a.stage, a.mb)]
        if a.stage < last:
            before.append(Action(a.kind, a.pipe, a.stage + 1, a.mb))
        return before

    @property
    def backward_kind(self) -> str:
        """The action that consumes the loss gradient: B, or Bx when it is split."""
        return BX if self.kind.split_backward else B

    @property
    def last_use_kind(self) -> str:
        """The action after which a microbatch's forward residuals are free: B, or W."""
        return W if self.kind.split_backward else B
