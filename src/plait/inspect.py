"""`plait inspect`: compile the train step without running it and report per-device figures."""

from __future__ import annotations

import time

from jax.sharding import Mesh
from rich.console import Console

from plait import analysis, hosts
from plait import mesh as mesh_lib
from plait.config import Experiment
from plait.errors import UserError
from plait.hardware import Hardware
from plait.kinds import is_decoder
from plait.tasks import make_task


def inspect_step(exp: Experiment, mesh: Mesh, hw: Hardware | None = None) -> dict:
    """Compile-only report: FLOPs, collective bytes by kind and by link (within a host,
    across hosts), memory (all per device), and the task's own figures (Task.report);
    with `hw`, the collectives' time on it per link (`link_seconds`)."""
    task = make_task(exp, mesh)
    t0 = time.perf_counter()
    compiled = task.compile()
    compile_s = time.perf_counter() - t0
    layout = hosts.host_layout(mesh).ravel()
    report = analysis.analyze(compiled, dict(mesh.shape), task.branch_weights(), layout)
    n, sizes = mesh.devices.size, dict(mesh.shape)
    flops = task.flops_per_unit()
    report.update(
        experiment=exp.name, mesh=hosts.mesh_text(mesh), mesh_shape=sizes, devices=n,
        platform=mesh.devices.flat[0].platform, parameters=task.num_params(),
        unit=task.unit, units_per_step=task.units_per_step,
        **{f"{task.unit}_per_step": task.units_per_step},
        model_flops_per_device=flops * task.units_per_step / n if flops else None,
        compile_s=compile_s, tensor_mode="none")
    report.update(task.report(report))
    report["notes"] = _notes(task, exp, mesh)
    phases = task.phases()
    if phases:
        # Steps that differ (a local step, a sync step): each one's collectives.
        report["phases"] = {
            name: {k: v for k, v in analysis.analyze(compiled, sizes, weights, layout).items()
                   if k in ("collectives", "collectives_wire", "wire_by_axes",
                            "bytes_by_link", "wire_by_link", "collective_ops")}
            for name, weights in phases.items()}
    if hw is not None:
        from plait.sweep.cost import collective_width, link_times

        width = collective_width(exp, hw, compiled_on=report["platform"])
        report["hardware"] = hw.name
        for part in [report, *report.get("phases", {}).values()]:
            part["link_seconds"] = link_times(part["collective_ops"], hw, width)
    return report


def _notes(task, exp: Experiment, mesh: Mesh) -> list[str]:
    """What a decoder's step runs here, as plait train's start-up lines say it (the
    attention kernel, scanned layers, experts): a setting this device cannot run
    (model.attention = "cudnn" on a CPU) is compiled as it would be read here, and
    plait train refuses it; said, not silent."""
    if not is_decoder(exp.model):
        return []
    notes = [line.removeprefix("plait: ") for line in task.describe(task.layout.abstract())]
    if exp.precision.matmul == "fp8":
        from plait.models import fp8

        try:
            fp8.check_devices(mesh.devices.flat)
        except UserError:
            notes.append(f"precision.matmul = \"fp8\" compiled for "
                         f"{mesh.devices.flat[0].platform}, which has no FP8 matrix units "
                         "(its quantize-dequantize ops compiled, the matmuls in the "
                         "compute dtype; plait train refuses it here)")
    return notes


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
    if not is_decoder(exp.model):
        raise UserError(f"--compare-tensor-modes compares how a decoder's layers split over "
                        f"the tensor modes; {exp.name} is a {exp.model.kind} model, which "
                        "runs on data and fsdp axes only; drop --compare-tensor-modes")
    console = Console(stderr=True, highlight=False)
    rows = []
    for mode, axes in tensor_mode_meshes(n):
        sizes = mesh_lib.resolve(mesh_lib.MeshSpec(axes, "--compare-tensor-modes"), n)
        row = {"mode": mesh_lib.MODE_NAMES[mode], "mesh": mesh_lib.inline(sizes)}
        with console.status(f"compiling {row['mode']} on {row['mesh']} ..."):
            try:
                r = inspect_step(exp, mesh_lib.build_mesh(sizes, n))
            except UserError as e:
                rows.append({**row, "error": str(e)})
                continue
        rows.append({**row, **{k: r[k] for k in (
            "tensor_wire_bytes", "tensor_formula_bytes", "tensor_formula_unmodelled",
            "param_bytes_per_device", "compile_s", "flops_per_device")},
            "wire_bytes": sum(r["collectives_wire"].values()),
            "temp_bytes": r["memory"].get("temp_bytes", 0)})
    return rows


