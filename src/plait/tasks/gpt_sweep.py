"""What `plait sweep` tries for a decoder (GPTTask.sweep_*): which axes, which
pipeline schedules and microbatch counts per mesh shape, and which programs to compile
to extrapolate a shape's costs to the full depth."""

from __future__ import annotations

import math
from typing import Any

from plait import mesh as mesh_lib
from plait import sharding
from plait.config import Experiment
from plait.errors import UserError
from plait.models.gpt import abstract_model
from plait.parallel import schedules
from plait.tasks.gpt_checks import check_fits, decoder_rules

# The sweep tries a context axis only where each rank keeps at least this many tokens of
# a sequence.
SWEEP_MIN_CONTEXT_CHUNK = 1024


def axes_for(exp: Experiment, axes: tuple[str, ...]) -> tuple[str, ...]:
    """Every axis, but `context` only for sequences it can split into blocks of
    SWEEP_MIN_CONTEXT_CHUNK tokens or more, and `expert` only for a mixture of
    experts."""
    skip = set()
    if exp.model.seq_len < 2 * SWEEP_MIN_CONTEXT_CHUNK:
        skip.add("context")
    if exp.model.moe is None:
        skip.add("expert")
    return tuple(a for a in axes if a not in skip)


def variants(exp: Experiment, sizes: dict[str, int]) -> list[dict[str, Any]]:
    """Every shape the model divides; a pipeline axis adds each schedule x microbatch
    count (D, 2D, 4D) the layers and the batch split into."""
    mesh_lib.tensor_mode(sizes)  # one-line errors for shapes no mode runs
    C = sizes.get("context", 1)
    if C > 1 and exp.model.seq_len // C < SWEEP_MIN_CONTEXT_CHUNK:
        raise UserError(f"context={C} leaves fewer than {SWEEP_MIN_CONTEXT_CHUNK} tokens "
                        "per rank: not swept (a block that small cannot hide the ring's "
                        "sends; the batch axes split such sequences for less)")
    check_fits(exp, sizes, decoder_rules(sizes, exp.model, exp.context.attention),
               abstract_model(exp.model))
    D = sizes.get("pipeline", 1)
    if D == 1:
        return [{}]
    if exp.train.microbatches != 1:
        raise UserError(f"a pipeline splits the batch by pipeline.microbatches: pipeline "
                        f"shapes are not tried with train.microbatches = "
                        f"{exp.train.microbatches}")
    rules = decoder_rules(sizes, exp.model)
    replicas = math.lcm(*(n for _, n in sharding.batch_splits(rules, sizes)))
    out = []
    for name, kind in schedules.SCHEDULES.items():
        v = kind.default_virtual
        for N in (D, 2 * D, 4 * D):
            if exp.model.layers % (D * v) or exp.train.global_batch % (N * replicas):
                continue
            try:
                kind.check(D, N, v)
            except UserError:
                continue
            out.append({"pipeline.schedule": name, "pipeline.microbatches": N,
                        "pipeline.virtual_stages": v})
    return out


def programs(exp: Experiment, sizes: dict[str, int]
             ) -> tuple[list[Experiment], float | None]:
    """Scanned layers make every per-layer cost linear in depth: without a pipeline,
    compile at 2 and 4 layers and extrapolate. A pipeline stacks its stage parameters,
    so its program does not grow with depth: compile it at the full depth. So is a model
    of at most 4 layers: one exact compile, cheaper than the two."""
    def scanned(layers: int) -> Experiment:
        model = exp.model.model_copy(update={"layers": layers, "scan_layers": True})
        return exp.model_copy(update={"model": model})

    L = exp.model.layers
    if sizes.get("pipeline", 1) > 1 or L <= 4:
        return [scanned(L)], None
    return [scanned(2), scanned(4)], (L - 2) / 2
