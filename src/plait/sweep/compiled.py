"""Compile a candidate's step on simulated CPU devices and read its per-device figures.

What to compile is the task's choice (`Task.sweep_programs`): the experiment as
is, or two cheaper ones whose figures are linear in a size (a scanned model at
2 and 4 layers), extrapolated here; a pipeline's microbatch counts between the
fewest and the most, which are compiled, are interpolated here. FLOPs, collective
bytes per mesh-axis group, memory and kernels come from the compiled HLO
(`plait.analysis`).
"""

from __future__ import annotations

import os
import time

from plait import mesh as mesh_lib
from plait.config import Experiment
from plait.sweep.shapes import Candidate

# What the sweep reads (partitioned HLO, buffer assignment) is fixed before LLVM
# runs; optimising the machine code only costs compile time (about 30%).
COMPILER_OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
# XLA:CPU's legacy emitters in place of its MLIR fusion emitters compile 1.7-2.4x faster
# with the same FLOPs and collectives and memory within 1% (docs/architecture.md
# "XLA flags"), but fuse less: a kernel count is read only from the fusion emitters'
# program, which `--run`'s per-kernel calibration needs.
FAST_OPTIONS = {**COMPILER_OPTIONS, "xla_cpu_use_fusion_emitters": False}


def groups_of(ops: list[dict]) -> dict[tuple, list[float]]:
    """An analysis's collective ops as {(kind, mesh axes, group size, crosses hosts):
    [count, wire bytes]}: what pricing needs, and what extrapolation interpolates."""
    groups: dict[tuple, list[float]] = {}
    for op in ops:
        key = (op["kind"], ",".join(op["axes"]), op["group_size"], op["crosses_hosts"])
        acc = groups.setdefault(key, [0.0, 0.0])
        acc[0] += op["count"]
        acc[1] += op["wire_bytes"]
    return groups


def _figures(r: dict) -> dict:
    """What a prediction needs from an analysis report: FLOPs, collectives grouped by
    (kind, mesh axes, group size, crosses hosts) as [count, wire bytes] (`groups_of`),
    and memory."""
    groups = groups_of(r["collective_ops"])
    m = r["memory"]
    return {"flops": r["flops_per_device"], "groups": groups, "memory_parts": m,
            "kernels": r["kernels"],
            "memory": m.get("total_bytes", 0.0)}


def read_program(exp: Experiment, sizes: dict[str, int], n: int,
                 per_node: int | None = None, kernels: bool = False) -> dict:
    """Figures of one compiled step, plus the task's own (`Task.sweep_extras`). With
    `per_node` devices a node, the mesh is laid over n / per_node simulated hosts (its
    outer axes across them), so the step is the one plait runs there (a hierarchical
    reduction) and each collective is classed by the links it crosses. `kernels`:
    compile as plait train does and count its kernels (else None, compiled faster)."""
    import numpy as np

    from plait import analysis, hosts
    from plait.tasks import make_task

    nodes = n // per_node if per_node and n > per_node and n % per_node == 0 else 1
    dcn = hosts.dcn_for(sizes, nodes) if nodes > 1 else None
    mesh = mesh_lib.build_mesh(sizes, n, dcn)
    layout = (hosts.host_layout(mesh).ravel() if dcn or nodes == 1
              else np.arange(n) // per_node)  # axes that do not split by node: by order
    task = make_task(exp, mesh)
    r = analysis.analyze(task.compile(COMPILER_OPTIONS if kernels else FAST_OPTIONS),
                         dict(mesh.shape), task.branch_weights(), layout)
    figures = _figures(r)
    if not kernels:
        figures["kernels"] = None
    return {**figures, "units_per_step": task.units_per_step, **task.sweep_extras()}


def _lerp(x: float, y: float, s: float) -> float:
    return x + (y - x) * s


def _counts(a: dict, b: dict, counts: float, sizes: float) -> dict:
    """FLOPs, kernels and collective counts `counts` of the way from a's to b's, collective
    bytes `sizes` of the way."""
    zero = [0.0, 0.0]
    groups = {k: [_lerp(a["groups"].get(k, zero)[0], b["groups"].get(k, zero)[0], counts),
                  _lerp(a["groups"].get(k, zero)[1], b["groups"].get(k, zero)[1], sizes)]
              for k in set(a["groups"]) | set(b["groups"])}
    return {"flops": _lerp(a["flops"], b["flops"], counts), "groups": groups,
            "kernels": None if a["kernels"] is None
            else _lerp(a["kernels"], b["kernels"], counts)}


def extrapolate(a: dict, b: dict, t: float) -> dict:
    """Figures at a + t (b - a). Parameters, optimizer state and outputs grow exactly
    linearly with the size; XLA's temporaries only roughly (buffer reuse), so they never
    drop below what the larger compile needed."""
    m0, m1 = a["memory_parts"], b["memory_parts"]

    def mem(key: str) -> float:
        return _lerp(m0.get(key, 0.0), m1.get(key, 0.0), t)

    temp = max(mem("temp_bytes"), float(m1.get("temp_bytes", 0.0)))
    memory = mem("argument_bytes") + mem("output_bytes") + temp - mem("alias_bytes")
    return {**b, **_counts(a, b, t, t), "memory": memory}


def between(a: dict, b: dict, ticks: float, size: float) -> dict:
    """Figures of a pipeline's microbatch count between two compiled ones (`shapes.anchors`):
    FLOPs, kernels and collective counts follow the executor's ticks (`ticks` of the way
    from a's to b's), collective bytes and memory the microbatch's size (`size` of the
    way from a's 1/N to b's)."""
    m0, m1 = a["memory_parts"], b["memory_parts"]
    parts = {k: _lerp(m0.get(k, 0.0), m1.get(k, 0.0), size) for k in set(m0) | set(m1)}
    return {**a, **_counts(a, b, ticks, size), "memory_parts": parts,
            "memory": _lerp(a["memory"], b["memory"], size)}


def measure(exp: Experiment, c: Candidate, n: int, per_node: int | None = None,
            kernels: bool = False) -> dict:
    """Per-device FLOPs, collectives and memory of the candidate's step at full size."""
    from plait import tasks

    programs, t = tasks.task_class(exp.model.kind).sweep_programs(c.experiment(exp), c.sizes)
    points = [read_program(e, c.sizes, n, per_node, kernels) for e in programs]
    return points[0] if t is None else extrapolate(points[0], points[1], t)


def timed_measure(exp: Experiment, c: Candidate, n: int, per_node: int | None = None,
                  kernels: bool = False) -> tuple[dict, float]:
    t0 = time.perf_counter()
    return measure(exp, c, n, per_node, kernels), time.perf_counter() - t0


def worker_init(n: int) -> None:
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", n)


def default_workers(programs: int) -> int:
    """Compiles run in parallel processes when there are enough of them to pay for the
    start of each (about 5 s to import JAX); XLA's compile uses ~1.4 cores of its own."""
    return max(1, min(os.cpu_count() or 1, 4, programs // 6))
