"""`plait inspect`: compile the train step without running it and report per-device figures."""

from __future__ import annotations

import math
import time

import jax
from jax.sharding import Mesh
from rich.console import Console
from rich.table import Table

from plait import analysis
from plait import mesh as mesh_lib
from plait.config import Experiment
from plait.errors import UserError
from plait.models import flops_per_token
from plait.parallel import formulas
from plait.train.build import Job

TENSOR_AXES = frozenset(a for axes in mesh_lib.TENSOR_MODES.values() for a in axes)
MODE_NAMES = {None: "none", "1d": "1-D", "2d": "2-D", "2.5d": "2.5-D", "3d": "3-D"}


def tensor_wire_bytes(report: dict) -> float:
    """Ring wire bytes of the collectives that run over tensor axes only."""
    return sum(b for axes, b in report["wire_by_axes"].items()
               if axes != "-" and set(axes.split(",")) <= TENSOR_AXES)


def param_bytes_per_device(job: Job) -> int:
    """Bytes of this device's shards of the parameters (fp32 master weights)."""
    total = 0
    for shape, sh in zip(jax.tree.leaves(job.layout.shapes["params"]),
                         jax.tree.leaves(job.layout.params), strict=True):
        total += math.prod(sh.shard_shape(shape.shape)) * shape.dtype.itemsize
    return total


def inspect_step(exp: Experiment, mesh: Mesh) -> dict:
    """Compile-only report: FLOPs, collective bytes by kind, memory (all per device)."""
    if exp.model.kind == "dlrm":
        return _inspect_dlrm(exp, mesh)
    job = Job(exp, mesh)
    t0 = time.perf_counter()
    compiled = job.compile()
    compile_s = time.perf_counter() - t0
    weights = job.pipe.plan.branch_weights() if job.pipe else None
    report = analysis.analyze(compiled, dict(mesh.shape), weights)
    n = mesh.devices.size
    sizes = dict(mesh.shape)
    platform = mesh.devices.flat[0].platform
    report.update(
        experiment=exp.name,
        mesh=mesh_lib.inline(sizes),
        mesh_shape=sizes,
        devices=n,
        platform=platform,
        parameters=job.model.num_params(),
        tokens_per_step=job.tokens_per_step,
        model_flops_per_device=flops_per_token(exp.model) * job.tokens_per_step / n,
        compile_s=compile_s,
        tensor_mode=MODE_NAMES[mesh_lib.tensor_mode(sizes)],
        tensor_wire_bytes=tensor_wire_bytes(report),
        # The formulas describe tensor parallelism without a pipeline.
        tensor_formula_bytes=(None if job.pipe else
                              formulas.tensor_bytes(exp, sizes, platform)),
        param_bytes_per_device=param_bytes_per_device(job),
        pipeline=job.pipe.figures if job.pipe else None,
    )
    return report


def _inspect_dlrm(exp: Experiment, mesh: Mesh) -> dict:
    from plait.train.dlrm_job import DLRMJob

    job = DLRMJob(exp, mesh)
    t0 = time.perf_counter()
    compiled = job.compile()
    compile_s = time.perf_counter() - t0
    report = analysis.analyze(compiled, dict(mesh.shape))
    sizes = dict(mesh.shape)
    lay = job.lay
    report.update(
        experiment=exp.name, mesh=mesh_lib.inline(sizes), mesh_shape=sizes,
        devices=mesh.devices.size, platform=mesh.devices.flat[0].platform,
        parameters=job.num_params(), samples_per_step=job.units_per_step,
        compile_s=compile_s, tensor_mode="none",
        tables=[{"table": t, "rows": r, "kind": k} for t, (r, k) in
                enumerate(zip(lay.rows, lay.kinds, strict=True))],
        largest_table_bytes=max(lay.rows) * lay.dim * 4,
        largest_collective_bytes=max((op["bytes"] for op in report["collective_ops"]),
                                     default=0),
    )
    return report


def tensor_mode_meshes(n: int) -> list[tuple[str, dict[str, int]]]:
    """One mesh per tensor mode on n devices; leftover devices go to `data`."""
    def largest(power: int, at_least: int = 1) -> int:
        return max((q for q in range(2, n + 1) if n % q**power == 0 and n // q**power >= at_least),
                   default=1)

    out: list[tuple[str, dict[str, int]]] = [("1d", {"tensor": n})]
    q = largest(2)
    if q > 1:
        out.append(("2d", {"data": n // q**2, "tensor_row": q, "tensor_col": q}))
    q = largest(2, at_least=2)
    if q > 1:
        out.append(("2.5d", {"tensor_depth": n // q**2, "tensor_row": q, "tensor_col": q}))
    q = largest(3)
    if q > 1:
        out.append(("3d", {"data": n // q**3, "tensor_x": q, "tensor_y": q, "tensor_z": q}))
    return out


def compare_tensor_modes(exp: Experiment, n: int) -> list[dict]:
    """Compile the step once per tensor mode on n devices; measured vs formula bytes, memory."""
    console = Console(stderr=True, highlight=False)
    rows = []
    for mode, axes in tensor_mode_meshes(n):
        sizes = mesh_lib.resolve(mesh_lib.MeshSpec(axes, "--compare-tensor-modes"), n)
        row = {"mode": MODE_NAMES[mode], "mesh": mesh_lib.inline(sizes)}
        with console.status(f"compiling {row['mode']} on {row['mesh']} ..."):
            try:
                r = inspect_step(exp, mesh_lib.build_mesh(sizes, n))
            except UserError as e:
                rows.append({**row, "error": str(e)})
                continue
        rows.append({**row, **{k: r[k] for k in (
            "tensor_wire_bytes", "tensor_formula_bytes", "param_bytes_per_device", "compile_s",
            "flops_per_device")},
            "wire_bytes": sum(r["collectives_wire"].values()),
            "temp_bytes": r["memory"].get("temp_bytes", 0)})
    return rows


def render_comparison(exp: Experiment, rows: list[dict]) -> None:
    c = Console(highlight=False, soft_wrap=True)
    if not c.is_terminal:
        c = Console(highlight=False, width=150)
    t = Table(title=f"{exp.name}: tensor modes, per device per step")
    for col in ("mode", "mesh", "tensor-axis bytes (HLO)", "formula", "HLO/formula",
                "all collectives", "weights", "temp (activations)", "compile"):
        t.add_column(col, justify="left" if col in ("mode", "mesh") else "right")
    for r in rows:
        if "error" in r:
            t.add_row(r["mode"], r["mesh"], f"[red]{r['error']}[/red]", *[""] * 6)
            continue
        ratio = (r["tensor_wire_bytes"] / r["tensor_formula_bytes"]
                 if r["tensor_formula_bytes"] else float("nan"))
        t.add_row(r["mode"], r["mesh"], _gib(r["tensor_wire_bytes"]),
                  _gib(r["tensor_formula_bytes"]), f"{ratio:.3f}", _gib(r["wire_bytes"]),
                  _gib(r["param_bytes_per_device"]), _gib(r["temp_bytes"]),
                  f"{r['compile_s']:.0f}s")
    c.print(t)


def _gib(x: float) -> str:
    return f"{x / 2**20:,.2f} MiB" if x < 2**30 else f"{x / 2**30:,.2f} GiB"


def render(r: dict) -> None:
    c = Console(highlight=False, soft_wrap=True)
    if "tables" in r:  # a DLRM
        c.print(f"[bold]{r['experiment']}[/bold] on mesh {r['mesh']} ({r['devices']} "
                f"{r['platform']} devices), {r['parameters'] / 1e6:.2f}M parameters, "
                f"{r['samples_per_step']:,} samples/step, compiled in {r['compile_s']:.1f}s")
        kinds = ", ".join(f"t{x['table']} {x['kind']}" for x in r["tables"])
        c.print(f"tables: {kinds}; largest collective {_gib(r['largest_collective_bytes'])} "
                f"against a largest table of {_gib(r['largest_table_bytes'])}")
    else:
        c.print(f"[bold]{r['experiment']}[/bold] on mesh {r['mesh']} ({r['devices']} "
                f"{r['platform']} devices), {r['parameters'] / 1e6:.2f}M parameters, "
                f"{r['tokens_per_step']:,} tokens/step, compiled in {r['compile_s']:.1f}s")
        c.print(f"FLOPs per device per step: {r['flops_per_device']:.4g} from the HLO matmuls "
                f"(model FLOPs {r['model_flops_per_device']:.4g})")
    if r.get("pipeline"):
        p = r["pipeline"]
        c.print(f"pipeline {p['schedule']}: {p['stages']} stages, {p['microbatches']} "
                f"microbatches, bubble {p['bubble']:.3f}, {p['ticks']} ticks, peak in flight "
                f"{p['peak_inflight']}")
    if "tensor_formula_bytes" in r:
        formula = (f" (formula {_gib(r['tensor_formula_bytes'])})"
                   if r["tensor_formula_bytes"] is not None else "")
        c.print(f"tensor mode {r['tensor_mode']}: {_gib(r['tensor_wire_bytes'])} over tensor "
                f"axes per device per step{formula}; parameters "
                f"{_gib(r['param_bytes_per_device'])} per device")
    if r["wire_by_axes"]:
        ax = Table(title="wire bytes per device per step, by mesh axes")
        ax.add_column("axes")
        ax.add_column("bytes", justify="right")
        for axes, b in r["wire_by_axes"].items():
            ax.add_row(axes, _gib(b))
        c.print(ax)
    t = Table(title="collectives per device per step")
    for col in ("kind", "bytes", "wire bytes (ring)"):
        t.add_column(col, justify="right" if col != "kind" else "left")
    for kind in analysis.KINDS:
        t.add_row(kind, _gib(r["collectives"][kind]), _gib(r["collectives_wire"][kind]))
    c.print(t)
    if r["collective_ops"]:
        ops = Table(title="largest collective ops")
        for col in ("kind", "shape", "axes", "group", "count", "bytes"):
            ops.add_column(col)
        for op in r["collective_ops"][:12]:
            ops.add_row(op["kind"], op["shape"][:48], ",".join(op["axes"]) or "-",
                        str(op["group_size"]), f"{op['count']:g}", _gib(op["bytes"]))
        c.print(ops)
    m = r["memory"]
    if m:
        mt = Table(title="memory per device")
        mt.add_column("kind")
        mt.add_column("bytes", justify="right")
        for key in ("argument_bytes", "output_bytes", "temp_bytes", "alias_bytes", "total_bytes"):
            mt.add_row(key.removesuffix("_bytes"), _gib(m[key]))
        c.print(mt)
