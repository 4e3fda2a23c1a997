"""The shapes a sweep considers: every factorisation of N devices over the task's mesh
axes that the task accepts, times the settings it wants swept (pipeline schedules and
microbatches, embedding placements); and which of them compile to the same program."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from plait import mesh as mesh_lib
from plait.config import Experiment
from plait.errors import UserError

MICROBATCHES = "pipeline.microbatches"


@dataclass
class Candidate:
    """A mesh shape and the config settings (dotted keys) that go with it: the task's own
    (pipeline schedule and microbatches, embedding placement) and those the user asked to
    try (`--vary`, named in `varied`)."""

    sizes: dict[str, int]
    settings: dict[str, Any] = field(default_factory=dict)
    varied: tuple[str, ...] = ()

    @property
    def mesh(self) -> str:
        return mesh_lib.inline(self.sizes)

    @property
    def label(self) -> str:
        shown = [str(v) for k, v in self.settings.items()
                 if k not in (MICROBATCHES, "pipeline.virtual_stages", *self.varied)]
        return " ".join(x for x in [self.mesh, *shown, self.varied_text] if x)

    @property
    def varied_settings(self) -> dict[str, Any]:
        return {k: self.settings[k] for k in self.varied}

    @property
    def varied_text(self) -> str:
        return settings_text(self.varied_settings)

    @property
    def pipeline(self) -> dict[str, Any]:
        """The pipeline settings the sweep chose (schedule, microbatches, virtual_stages);
        {} for a shape without a pipeline (whatever `--vary` sets, e.g. recompute)."""
        if "pipeline.schedule" not in self.settings:
            return {}
        return {k.split(".", 1)[1]: v for k, v in self.settings.items()
                if k.startswith("pipeline.") and k not in self.varied}

    def program_group(self) -> tuple:
        """Candidates of one group differ only in the pipeline's microbatch count: one
        executor at other tick counts and microbatch sizes, priced from compiles at the
        fewest and the most (`anchors`, `compiled.between`)."""
        return (self.mesh, tuple((k, _hashable(v)) for k, v in self.settings.items()
                                 if k != MICROBATCHES))

    @property
    def microbatches(self) -> int:
        return int(self.settings.get(MICROBATCHES, 1))

    def experiment(self, exp: Experiment) -> Experiment:
        for key, value in self.settings.items():
            exp = with_setting(exp, key.split("."), value)
        return exp

    def columns(self) -> dict[str, Any]:
        """The settings as result columns: pipeline.schedule -> pipeline_schedule."""
        return {k.replace(".", "_"): v for k, v in self.settings.items()}


def settings_text(settings: dict[str, Any]) -> str:
    """`--vary` settings as KEY=VALUE, the one spelling of labels, tables and sweep.csv."""
    return " ".join(f"{k}={v}" for k, v in settings.items())


def _hashable(value: Any) -> Any:
    """A setting as part of a dict key: a list or table (`--vary` allows any) as text."""
    return value if isinstance(value, (str, int, float, bool)) else repr(value)


def with_setting(node, path: list[str], value):
    """A copy of a config model with the setting at `path` (a dotted key's parts) set;
    the value is one the config validated already (`sweep.vary`)."""
    if len(path) == 1:
        return node.model_copy(update={path[0]: value})
    return node.model_copy(update={path[0]: with_setting(getattr(node, path[0]), path[1:],
                                                          value)})


def factorisations(n: int, axes: tuple[str, ...]):
    """Every assignment of sizes to `axes` whose product is n."""
    divisors = [d for d in range(1, n + 1) if n % d == 0]

    def rec(i: int, left: int):
        if i == len(axes) - 1:
            yield (left,)
            return
        for d in divisors:
            if left % d == 0:
                for rest in rec(i + 1, left // d):
                    yield (d, *rest)

    for combo in rec(0, n):
        yield dict(zip(axes, combo, strict=True))


def enumerate_shapes(exp: Experiment, n: int, combos: list[dict[str, Any]] | None = None
                     ) -> tuple[list[Candidate], list[str]]:
    """Every valid shape with its settings, and why others fail (most frequent first).
    `combos`: the settings the user asked to try (`sweep.vary`), each crossed with every
    shape it allows."""
    from plait import tasks

    task = tasks.task_class(exp.model.kind)
    out: list[Candidate] = []
    seen: set[tuple] = set()
    reasons: dict[str, int] = {}
    for combo in combos or [{}]:
        e = Candidate({}, combo).experiment(exp)
        for sizes in factorisations(n, task.sweep_axes_for(e)):
            try:  # a grid that is not square, a cube that is not a cube: not a shape at
                mesh_lib.tensor_mode(sizes)  # all, and no reason this model fits none
            except UserError:
                continue
            try:
                variants = task.sweep_variants(e, sizes)
            except UserError as err:
                reasons[str(err)] = reasons.get(str(err), 0) + 1
                continue
            for v in variants:
                # a pipeline's own setting (pipeline.recompute) means nothing without one:
                # such shapes are tried once, not once per value
                mine = {k: x for k, x in combo.items()
                        if "pipeline.schedule" in v or not k.startswith("pipeline.")}
                cand = Candidate(sizes, {**mine, **v}, tuple(mine))
                key = (cand.mesh, repr(sorted(cand.settings.items())))
                if key not in seen:
                    seen.add(key)
                    out.append(cand)
    return out, sorted(reasons, key=lambda r: -reasons[r])


def anchors(group: list[Candidate]) -> list[Candidate]:
    """The candidates of a group (`Candidate.program_group`) to compile: those with the
    fewest and the most microbatches. The microbatch count changes more than the bubble:
    the executor's loop runs more ticks (kernels and collectives grow with them) over
    smaller microbatches (collective bytes and activation memory shrink as 1/N). Measured
    on llama-tiny's pipeline=2,tensor=4 1F1B at N = 2, 4, 8: 1152, 1901, 3399 kernels and
    12.2, 6.4, 3.4 MiB; the middle count lies on both lines to 0.2% (compiled.between)."""
    fewest = min(group, key=lambda c: c.microbatches)
    most = max(group, key=lambda c: c.microbatches)
    return [fewest] if most is fewest else [fewest, most]


@functools.lru_cache(maxsize=4096)
def _laid_out(schedule: str, stages: int, microbatches: int, virtual: int, layers: int,
              recompute: bool):
    from plait.parallel import schedules
    from plait.parallel.tick_table import tick_table

    s = schedules.build(schedule, stages, microbatches, virtual)
    return s, tick_table(s, layers, recompute)


def laid_out(exp: Experiment, c: Candidate, microbatches: int | None = None):
    """(schedule, tick table) of a pipeline candidate, at its own microbatch count or the
    one given; read-only, and built once per sweep: many meshes share a pipeline size
    and count, and a Chimera of 64 microbatches takes ~60 ms to schedule (programs_of
    for mixtral-8x7b on 64 devices spent 33 s building the same tables again)."""
    p, e = c.pipeline, c.experiment(exp) if c.varied else exp
    return _laid_out(p["schedule"], c.sizes["pipeline"], microbatches or p["microbatches"],
                     p.get("virtual_stages", 0), e.model.layers, e.pipeline.recompute)


def program_key(exp: Experiment, c: Candidate) -> tuple:
    """Candidates with equal keys compile to the same program (up to the table's values).

    The pipeline executor compiles one switch over the action kinds (whole or
    split backwards); its buffers follow the tick table's slots, its loop the
    ticks, and what the analysis weights follow the branch frequencies. GPipe and
    1F1B at N = D, for instance, agree on all of them.
    """
    pipe = c.pipeline
    if not pipe:
        return c.program_group()
    s, t = laid_out(exp, c)
    weights = tuple(round(w, 12) for ws in t.branch_weights().values() for w in ws)
    return (c.mesh, c.microbatches, s.pipes, s.kind.split_backward, t.chunks, len(t.table),
            t.inbox_slots, t.stash_slots, t.keep_slots, weights,
            *((k, _hashable(v)) for k, v in c.varied_settings.items()))
