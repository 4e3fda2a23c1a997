"""`plait inspect`: compile the train step without running it and report per-device figures."""

from __future__ import annotations

import time

from jax.sharding import Mesh
from rich.console import Console
from rich.table import Table

from plait import analysis
from plait import mesh as mesh_lib
from plait.config import Experiment
from plait.models import flops_per_token
from plait.train.build import Job


def inspect_step(exp: Experiment, mesh: Mesh) -> dict:
    """Compile-only report: FLOPs, collective bytes by kind, memory (all per device)."""
    job = Job(exp, mesh)
    t0 = time.perf_counter()
    compiled = job.compile()
    compile_s = time.perf_counter() - t0
    report = analysis.analyze(compiled, dict(mesh.shape))
    n = mesh.devices.size
    report.update(
        experiment=exp.name,
        mesh=mesh_lib.inline(dict(mesh.shape)),
        mesh_shape=dict(mesh.shape),
        devices=n,
        platform=mesh.devices.flat[0].platform,
        parameters=job.model.num_params(),
        tokens_per_step=job.tokens_per_step,
        model_flops_per_device=flops_per_token(exp.model) * job.tokens_per_step / n,
        compile_s=compile_s,
    )
    return report


def _gib(x: float) -> str:
    return f"{x / 2**20:,.2f} MiB" if x < 2**30 else f"{x / 2**30:,.2f} GiB"


def render(r: dict) -> None:
    c = Console(highlight=False, soft_wrap=True)
    c.print(f"[bold]{r['experiment']}[/bold] on mesh {r['mesh']} ({r['devices']} {r['platform']} "
            f"devices), {r['parameters'] / 1e6:.2f}M parameters, {r['tokens_per_step']:,} "
            f"tokens/step, compiled in {r['compile_s']:.1f}s")
    c.print(f"FLOPs per device per step: {r['flops_per_device']:.4g} from the HLO matmuls "
            f"(model FLOPs {r['model_flops_per_device']:.4g})")
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
