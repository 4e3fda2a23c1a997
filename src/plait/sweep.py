"""`plait sweep`: every mesh shape for N devices, compiled ahead of time, predicted, ranked.

Shapes: every assignment of sizes to the mesh axes `plait.mesh` implements whose
product is N, that selects a valid tensor mode and that the model divides (the
same checks `plait train` makes); a pipeline axis also varies its schedule and
microbatches. New axes or modes appear here without edits.

Each shape is compiled on N simulated CPU devices at two small depths (scanned
layers) and its per-device FLOPs, collective bytes per mesh-axis group and
memory are extrapolated linearly to the experiment's depth: with scanned
layers every per-layer cost is linear in the layer count (XLA's temporaries
only roughly, so they are floored at the deeper compile's). A pipeline mesh is
compiled once per schedule (Chimera's second weight copy, ZB-H1's weight
gradient and interleaving all change the program), with the fewest
microbatches; its other microbatch counts share those costs and differ only
by the bubble.

Prediction (stated model, per step, per device):
- compute = matmul FLOPs / (peak FLOP/s of the compute dtype x efficiency);
- each collective = count x ring steps x latency + wire bytes / bandwidth of
  the links its group crosses (within a node, or across nodes by the device
  order of the mesh); bf16 collectives count at 2 bytes per element on
  accelerators (the CPU compile runs them in fp32);
- no overlap of compute and communication;
- a pipeline multiplies the busy time by 1 + its bubble_ratio from the
  schedule table;
- a shape fits if arguments + outputs + temporaries - aliases <= device memory.
"""

from __future__ import annotations

import csv
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from plait import mesh as mesh_lib
from plait.config import Experiment, read_toml
from plait.errors import UserError

MAX_SIMULATED = 512
RING_STEPS = {"all-reduce": lambda g: 2 * (g - 1), "all-gather": lambda g: g - 1,
              "reduce-scatter": lambda g: g - 1, "all-to-all": lambda g: g - 1,
              "collective-permute": lambda g: 1}


@dataclass
class Hardware:
    name: str
    peak_bf16_flops: float
    peak_fp32_flops: float
    memory_bytes: float
    devices_per_node: int
    intra_node_bandwidth: float
    intra_node_latency: float
    inter_node_bandwidth: float
    inter_node_latency: float
    efficiency: float = 0.5
    # Bytes/s of device memory: prices a DLRM's row gathers and sparse updates.
    memory_bandwidth: float = 0.0
    shared_compute: bool = False
    extra: dict = field(default_factory=dict)

    def peak(self, dtype: str, n: int) -> float:
        p = self.peak_bf16_flops if dtype == "bfloat16" else self.peak_fp32_flops
        return p / n if self.shared_compute else p

    def bandwidth(self, n: int) -> float:
        """Memory bandwidth per device (inf where the description has none)."""
        b = self.memory_bandwidth or float("inf")
        return b / n if self.shared_compute else b

    def memory(self, n: int) -> float:
        return self.memory_bytes / n if self.shared_compute else self.memory_bytes


def load_hardware(name: str, root: Path | None = None) -> Hardware:
    """A hardware description: the [hardware] table of meshes/NAME.toml (or a path)."""
    root = root or Path(__file__).resolve().parents[2] / "meshes"
    path = Path(name)
    if not path.is_file():
        path = root / f"{name}.toml"
    if not path.is_file():
        known = sorted(p.stem for p in root.glob("*.toml")
                       if "hardware" in read_toml(p, "mesh file"))
        raise UserError(f"unknown hardware '{name}'; known: {', '.join(known)} "
                        "(or a path to a TOML file with a [hardware] table)")
    raw = read_toml(path, "hardware file").get("hardware")
    if not isinstance(raw, dict):
        raise UserError(f"'{path}' has no [hardware] table")
    fields = set(Hardware.__dataclass_fields__) - {"extra"}
    missing = sorted(f for f in fields - set(raw)
                     if f not in ("efficiency", "shared_compute", "memory_bandwidth"))
    if missing:
        raise UserError(f"hardware '{path}' lacks {', '.join(missing)}")
    known = {k: v for k, v in raw.items() if k in fields}
    return Hardware(**known, extra={k: v for k, v in raw.items() if k not in fields})


@dataclass
class Candidate:
    sizes: dict[str, int]
    pipeline: dict = field(default_factory=dict)  # schedule, microbatches, virtual_stages
    embedding: str | None = None  # a DLRM's embedding.sharding

    @property
    def mesh(self) -> str:
        return mesh_lib.inline(self.sizes)

    @property
    def label(self) -> str:
        if self.pipeline:
            return f"{self.mesh} {self.pipeline['schedule']}"
        return f"{self.mesh} {self.embedding}" if self.embedding else self.mesh

    def experiment(self, exp: Experiment) -> Experiment:
        if self.embedding:
            return exp.model_copy(update={"embedding": exp.embedding.model_copy(
                update={"sharding": self.embedding})})
        if not self.pipeline:
            return exp
        return exp.model_copy(update={"pipeline": exp.pipeline.model_copy(update=self.pipeline)})


def _factorisations(n: int, axes: tuple[str, ...]):
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


EMBEDDING_PLACEMENTS = ("auto", "table", "row", "column", "replicated")


def _enumerate_dlrm(exp: Experiment, n: int) -> tuple[list[Candidate], list[str]]:
    """A DLRM: its batch axes (data x fsdp) x every embedding placement the model allows."""
    from plait.planner import plan_tables
    from plait.train.dlrm_job import BATCH_AXES, check_dlrm

    out: list[Candidate] = []
    reasons: dict[str, int] = {}
    for sizes in _factorisations(n, BATCH_AXES):
        for kind in EMBEDDING_PLACEMENTS:
            c = Candidate(sizes, embedding=kind)
            try:
                e = c.experiment(exp)
                check_dlrm(e, sizes)
                plan_tables(e, n, BATCH_AXES)
            except UserError as err:
                reasons[str(err)] = reasons.get(str(err), 0) + 1
                continue
            out.append(c)
    return out, sorted(reasons, key=lambda r: -reasons[r])


def enumerate_shapes(exp: Experiment, n: int) -> tuple[list[Candidate], list[str]]:
    """Every valid shape (with pipeline schedule and microbatch choices, or a DLRM's
    embedding placements), and why others fail."""
    if exp.model.kind == "dlrm":
        return _enumerate_dlrm(exp, n)
    from plait import sharding
    from plait.models import build
    from plait.parallel import schedules
    from plait.train.build import check_fits

    model = build(exp.model)
    out: list[Candidate] = []
    reasons: dict[str, int] = {}
    for sizes in _factorisations(n, mesh_lib.IMPLEMENTED_AXES):
        try:
            mode = mesh_lib.tensor_mode(sizes)
            rules = sharding.rules_for_sizes(sizes)
            check_fits(exp, sizes, rules, model)
        except UserError as e:
            reasons[str(e)] = reasons.get(str(e), 0) + 1
            continue
        D = sizes.get("pipeline", 1)
        if D == 1:
            out.append(Candidate(sizes))
            continue
        if mode not in (None, "1d"):
            reasons["pipeline with 2-D/3-D tensor axes"] = 1
            continue
        for name in schedules.SCHEDULES:
            for N in (D, 2 * D, 4 * D):
                v = 2 if name == "interleaved" else 1
                replicas = sizes.get("data", 1) * sizes.get("fsdp", 1)
                if exp.model.layers % (D * v) or exp.train.global_batch % (N * replicas):
                    continue
                try:
                    schedules.check(name, D, N, v)
                except UserError:
                    continue
                out.append(Candidate(sizes, {"schedule": name, "microbatches": N,
                                             "virtual_stages": v}))
    return out, sorted(reasons, key=lambda r: -reasons[r])


def _sweep_exp(exp: Experiment, layers: int) -> Experiment:
    model = exp.model.model_copy(update={"layers": layers, "scan_layers": True})
    return exp.model_copy(update={"model": model})


# What the sweep reads (partitioned HLO, buffer assignment) is fixed before LLVM
# runs; optimising the machine code only costs compile time (about 30%).
COMPILER_OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _figures(r: dict) -> dict:
    """What a prediction needs from an analysis report: FLOPs, collectives grouped by
    (kind, mesh axes, group size) as [count, wire bytes], and memory."""
    groups: dict[tuple, list[float]] = {}
    for op in r["collective_ops"]:
        key = (op["kind"], ",".join(op["axes"]), op["group_size"])
        acc = groups.setdefault(key, [0.0, 0.0])
        acc[0] += op["count"]
        acc[1] += op["wire_bytes"]
    m = r["memory"]
    return {"flops": r["flops_per_device"], "groups": groups, "memory_parts": m,
            "memory": m.get("argument_bytes", 0.0) + m.get("output_bytes", 0.0)
            + m.get("temp_bytes", 0.0) - m.get("alias_bytes", 0.0)}


def _read_program(exp: Experiment, c: Candidate, n: int, layers: int) -> dict:
    from plait import analysis
    from plait.train.build import Job

    mesh = mesh_lib.build_mesh(c.sizes, n)
    job = Job(_sweep_exp(c.experiment(exp), layers), mesh)
    weights = job.pipe.plan.branch_weights() if job.pipe else None
    r = analysis.analyze(job.compile(COMPILER_OPTIONS), dict(mesh.shape), weights)
    return {**_figures(r), "figures": job.pipe.figures if job.pipe else None}


def _read_dlrm(exp: Experiment, c: Candidate, n: int) -> dict:
    """A DLRM step compiled as is (no layers to extrapolate); the plan's memory is judged
    by the target hardware, not by this machine."""
    from plait import analysis
    from plait.train.dlrm_job import DLRMJob

    e = c.experiment(exp)
    e = e.model_copy(update={"embedding": e.embedding.model_copy(update={"memory_gib": 1e9})})
    mesh = mesh_lib.build_mesh(c.sizes, n)
    job = DLRMJob(e, mesh)
    r = analysis.analyze(job.compile(COMPILER_OPTIONS), dict(mesh.shape))
    return {**_figures(r), "figures": None, "lookup_bytes": job.lookup_bytes_per_device(),
            "kinds": list(job.lay.kinds)}


def _measure(exp: Experiment, c: Candidate, n: int) -> dict:
    """Per-device FLOPs, collectives and memory of the shape's step at the full depth.

    A pipeline mesh stacks its stage parameters, so its program (and compile
    time) does not grow with depth: it is compiled at the full depth. Without
    a pipeline every layer owns its parameters and optimizer update, so the
    step is compiled at 2 and 4 scanned layers and extrapolated linearly.
    """
    if exp.model.kind == "dlrm":
        return _read_dlrm(exp, c, n)
    L = exp.model.layers
    if c.sizes.get("pipeline", 1) > 1:
        return _read_program(exp, c, n, L)
    depths = (2, 4)
    points = [_read_program(exp, c, n, d) for d in depths]
    t = (L - depths[0]) / (depths[1] - depths[0])

    def lerp(a: float, b: float) -> float:
        return a + (b - a) * t

    keys = set(points[0]["groups"]) | set(points[1]["groups"])
    groups = {k: [lerp(points[0]["groups"].get(k, [0, 0])[i], points[1]["groups"].get(k, [0, 0])[i])
                  for i in range(2)] for k in keys}
    m0, m1 = points[0]["memory_parts"], points[1]["memory_parts"]

    def mem(key: str) -> float:
        return lerp(m0.get(key, 0.0), m1.get(key, 0.0))

    # Parameters, optimizer state and outputs grow exactly linearly with depth;
    # XLA's temporaries only roughly (buffer reuse), so they never drop below
    # what the deeper compile needed.
    temp = max(mem("temp_bytes"), float(m1.get("temp_bytes", 0.0)))
    memory = mem("argument_bytes") + mem("output_bytes") + temp - mem("alias_bytes")
    return {"flops": lerp(points[0]["flops"], points[1]["flops"]), "groups": groups,
            "memory": memory, "figures": None}


def _program_key(exp: Experiment, c: Candidate) -> tuple:
    """Shapes with equal keys compile to the same program (up to the table's values).

    The pipeline executor compiles one switch over every action kind whatever
    the schedule; its buffers follow the plan's slots, its loop the ticks, and
    what the analysis weights follow the branch frequencies. GPipe and 1F1B
    at N = D, for instance, agree on all of them.
    """
    if not c.pipeline:
        return (c.mesh, c.embedding)
    from plait.parallel import pipeline, schedules

    s = schedules.build(c.pipeline["schedule"], c.sizes["pipeline"],
                        c.pipeline["microbatches"], c.pipeline["virtual_stages"])
    p = pipeline.plan(s, exp.model.layers)
    weights = tuple(round(w, 12) for ws in p.branch_weights().values() for w in ws)
    return (c.mesh, s.pipes, p.chunks, len(p.table), p.inbox_slots, p.stash_slots, weights)


def _crosses_nodes(sizes: dict[str, int], axes: list[str], per_node: int) -> bool:
    names = list(sizes)
    ids = np.arange(math.prod(sizes.values())).reshape([sizes[a] for a in names])
    index = tuple(slice(None) if a in axes else 0 for a in names)
    return len(set((ids[index].ravel() // per_node).tolist())) > 1


def predict(exp: Experiment, c: Candidate, measured: dict, hw: Hardware, n: int) -> dict:
    width = 0.5 if exp.precision.compute == "bfloat16" and hw.extra.get("device") != "cpu" \
        and not hw.shared_compute else 1.0
    compute = measured["flops"] / (hw.peak(exp.precision.compute, n) * hw.efficiency)
    comm = 0.0
    wire = 0.0
    for (kind, axes, g), (count, nbytes) in measured["groups"].items():
        axis_list = [a for a in axes.split(",") if a]
        cross = _crosses_nodes(c.sizes, axis_list, hw.devices_per_node) if axis_list else False
        bw = hw.inter_node_bandwidth if cross else hw.intra_node_bandwidth
        lat = hw.inter_node_latency if cross else hw.intra_node_latency
        comm += count * RING_STEPS.get(kind, lambda g: g - 1)(int(g)) * lat + nbytes * width / bw
        wire += nbytes * width
    bubble = measured["figures"]["bubble_ratio"] if measured["figures"] else 0.0
    # A DLRM's lookups and sparse updates are memory-bound: their bytes at the memory
    # bandwidth (gathers, and the read and write of each updated row).
    lookup = measured.get("lookup_bytes", 0.0) / hw.bandwidth(n)
    compute += lookup
    step = (compute + comm) * (1 + bubble)
    memory = measured["memory"]
    extra = ({"embedding_sharding": c.embedding, "embedding_kinds": "/".join(measured["kinds"]),
              "lookup_s": lookup} if c.embedding else {})
    units = exp.train.global_batch * (1 if exp.model.kind == "dlrm" else exp.model.seq_len)
    return {"mesh": c.mesh, **{f"pipeline_{k}": v for k, v in c.pipeline.items()}, **extra,
            "tensor_mode": mesh_lib.tensor_mode(c.sizes) or "none",
            "flops_per_device": measured["flops"], "collective_bytes": wire,
            "compute_s": compute, "comm_s": comm, "bubble_ratio": bubble,
            "predicted_step_s": step,
            "predicted_tokens_per_s": units / step,
            "memory_bytes": memory, "fits": memory <= hw.memory(n)}


def _expand_pipeline_rows(exp: Experiment, c: Candidate, measured: dict, hw: Hardware,
                          n: int, others: list[Candidate]) -> list[dict]:
    """Microbatch counts of a pipeline mesh and schedule share its compiled costs (compiled
    with the fewest microbatches); only the bubble differs."""
    from plait.parallel import schedules

    rows = []
    for o in others:
        s = schedules.build(o.pipeline["schedule"], c.sizes["pipeline"],
                            o.pipeline["microbatches"], o.pipeline["virtual_stages"])
        m = dict(measured, figures=s.figures)
        rows.append(predict(exp, o, m, hw, n))
    return rows


def candidate_of(row: dict, n: int) -> Candidate:
    """The shape a result row stands for (its mesh and pipeline settings)."""
    sizes = mesh_lib.resolve(mesh_lib.load_spec(row["mesh"]), n)
    pipe = {k.removeprefix("pipeline_"): row[k] for k in (
        "pipeline_schedule", "pipeline_microbatches", "pipeline_virtual_stages") if row.get(k)}
    return Candidate(sizes, pipe, row.get("embedding_sharding") or None)


def measure_runs(exp: Experiment, rows: list[dict], n: int, steps: int = 6) -> None:
    """Train each row's shape for a few steps on the devices at hand; add its median step time."""
    import tempfile

    from plait.train.loop import train

    for r in rows:
        cand = candidate_of(r, n)
        short = cand.experiment(exp).model_copy(update={
            "train": exp.train.model_copy(update={"steps": steps}),
            "checkpoint": exp.checkpoint.model_copy(update={"enabled": False}),
            "log": exp.log.model_copy(update={"every_steps": 1, "tensorboard": False,
                                              "console": "none"})})
        with tempfile.TemporaryDirectory() as tmp:
            summary = train(short, mesh_lib.build_mesh(cand.sizes, n), Path(tmp))
        times = [rec["step_time_s"] for rec in summary["records"][1:]]
        r["measured_step_s"] = float(np.median(times)) if times else None


def _worker_init(n: int) -> None:
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", n)


def default_workers(programs: int) -> int:
    """Compiles run in parallel processes when there are enough of them to pay for the
    start of each (about 5 s to import JAX); XLA's compile uses ~1.4 cores of its own."""
    import os

    return max(1, min(os.cpu_count() or 1, 4, programs // 6))


def run_sweep(exp: Experiment, n: int, hw: Hardware, progress: bool = True,
              workers: int | None = None) -> list[dict]:
    """Compile every distinct program once, predict every shape, rank."""
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from multiprocessing import get_context

    from rich.progress import Progress

    if n > MAX_SIMULATED:
        raise UserError(f"--devices {n} is more than plait simulates on one CPU "
                        f"({MAX_SIMULATED}); sweep a smaller slice or on the target machine")
    cands, reasons = enumerate_shapes(exp, n)
    if not cands:
        why = "; ".join(reasons[:3]) or "no factorisation"
        raise UserError(f"no mesh shape of {n} devices fits {exp.name}: {why}")
    # Microbatch counts of a mesh and schedule share the program compiled with the
    # fewest (their bubble differs); schedules whose programs coincide share one compile.
    by_schedule: dict[tuple, list[Candidate]] = {}
    for c in cands:
        by_schedule.setdefault((c.mesh, c.pipeline.get("schedule"), c.embedding),
                               []).append(c)
    programs: dict[tuple, list[list[Candidate]]] = {}
    for group in by_schedule.values():
        programs.setdefault(_program_key(exp, group[0]), []).append(group)
    workers = workers or default_workers(len(programs))
    rows: list[dict] = []

    def add(groups: list[list[Candidate]], measured: dict, seconds: float) -> None:
        for group in groups:
            rep = group[0]
            new = (_expand_pipeline_rows(exp, rep, measured, hw, n, group) if rep.pipeline
                   else [predict(exp, rep, measured, hw, n)])
            for r in new:
                r["compile_s"] = seconds
                r["shares_program_with"] = groups[0][0].label
            rows.extend(new)

    def label(groups: list[list[Candidate]]) -> str:
        rep = groups[0][0]
        if rep.pipeline:
            return f"{rep.mesh} " + "/".join(g[0].pipeline["schedule"] for g in groups)
        return rep.label

    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task(f"compiling {len(programs)} programs", total=len(programs))
        if workers == 1:
            for groups in programs.values():
                bar.update(task, description=f"compiling {label(groups)}")
                t0 = time.perf_counter()
                add(groups, _measure(exp, groups[0][0], n), time.perf_counter() - t0)
                bar.advance(task)
        else:
            bar.update(task, description=f"compiling {len(programs)} programs "
                                         f"in {workers} processes")
            with ProcessPoolExecutor(workers, mp_context=get_context("spawn"),
                                     initializer=_worker_init, initargs=(n,)) as pool:
                futures = {pool.submit(_timed_measure, exp, groups[0][0], n): groups
                           for groups in programs.values()}
                for fut in as_completed(futures):
                    measured, seconds = fut.result()
                    add(futures[fut], measured, seconds)
                    bar.update(task, description=f"compiled {label(futures[fut])}")
                    bar.advance(task)
    rows.sort(key=lambda r: (not r["fits"], r["predicted_step_s"], r["mesh"],
                             str(r.get("pipeline_schedule")),
                             r.get("pipeline_microbatches") or 0))
    for i, r in enumerate(rows, 1):
        r["rank"] = i
    return rows


def _timed_measure(exp: Experiment, c: Candidate, n: int) -> tuple[dict, float]:
    t0 = time.perf_counter()
    return _measure(exp, c, n), time.perf_counter() - t0


COLUMNS = ["rank", "mesh", "pipeline_schedule", "pipeline_microbatches", "embedding_sharding",
           "embedding_kinds", "tensor_mode",
           "predicted_step_s", "predicted_tokens_per_s", "compute_s", "comm_s", "bubble_ratio",
           "flops_per_device", "collective_bytes", "memory_bytes", "fits", "measured_step_s"]


def write_outputs(rows: list[dict], out: Path, meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "sweep.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in COLUMNS})
    (out / "sweep.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    plot(rows, out / "sweep.png", meta)


def plot(rows: list[dict], path: Path, meta: dict, top: int = 25) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = rows[:top]
    labels = [r["mesh"] + (f" {r['pipeline_schedule']} N={r['pipeline_microbatches']}"
                           if r.get("pipeline_schedule") else
                           f" {r['embedding_sharding']}" if r.get("embedding_sharding") else "")
              for r in shown]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 0.32 * len(shown) + 1.6), sharey=True)
    y = list(range(len(shown)))
    colors = ["#4c72b0" if r["fits"] else "#c44e52" for r in shown]
    ax1.barh(y, [r["compute_s"] for r in shown], color=colors, label="compute")
    ax1.barh(y, [r["predicted_step_s"] - r["compute_s"] for r in shown],
             left=[r["compute_s"] for r in shown], color="#dd8452", label="communication + bubble")
    ax1.set_yticks(y, labels, fontsize=7)
    ax1.invert_yaxis()
    ax1.set_xlabel("predicted step time (s)")
    ax1.legend(fontsize=7)
    ax2.barh(y, [r["memory_bytes"] / 2**30 for r in shown], color=colors)
    ax2.axvline(meta["device_memory_bytes"] / 2**30, color="black", linestyle="--", linewidth=1)
    ax2.set_xlabel("memory per device (GiB); dashed: device memory; red: does not fit")
    fig.suptitle(f"{meta['experiment']} on {meta['devices']} x {meta['hardware']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)



def render(rows: list[dict], meta: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    c = Console(highlight=False)
    if not c.is_terminal:
        c = Console(highlight=False, width=160)
    t = Table(title=f"{meta['experiment']}: {meta['devices']} devices, predicted on "
                    f"{meta['hardware']} (sweep {meta['sweep_s']:.0f}s)")
    cols = ["rank", "mesh", "pipeline", "tensor", "step s", "tokens/s", "compute s", "comm s",
            "bubble", "GiB/device", "fits"]
    if any("measured_step_s" in r for r in rows):
        cols.append("measured s")
    for col in cols:
        t.add_column(col, justify="left" if col in ("mesh", "pipeline", "tensor") else "right")
    for r in rows:
        pipe = (f"{r['pipeline_schedule']} N={r['pipeline_microbatches']}"
                if r.get("pipeline_schedule") else
                f"tables {r['embedding_kinds']}" if r.get("embedding_sharding") else "-")
        cells = [str(r["rank"]), r["mesh"], pipe, r["tensor_mode"],
                 f"{r['predicted_step_s']:.4g}", f"{r['predicted_tokens_per_s']:,.0f}",
                 f"{r['compute_s']:.3g}", f"{r['comm_s']:.3g}", f"{r['bubble_ratio']:.3f}",
                 f"{r['memory_bytes'] / 2**30:.2f}", "yes" if r["fits"] else "[red]no[/red]"]
        if "measured s" in cols:
            m = r.get("measured_step_s")
            cells.append(f"{m:.4g}" if m else "")
        t.add_row(*cells)
    c.print(t)
