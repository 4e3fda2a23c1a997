"""Training across slow links: allreduce vs Sync EASGD vs DiLoCo.

Two parts.

1. Predicted share of step time in communication (compile-only: nothing here is
   timed). Each method's train step is compiled on simulated CPU devices for a
   mesh (default data=32: one replica per GPU of 4 nodes x 8, the EASGD paper's
   setting); per-device
   matmul FLOPs and collective bytes per mesh-axis group are read from the
   compiled HLO (plait.inspect) and priced by the sweep's cost model
   (plait.sweep.cost) on a hardware description (default h100-4node: 450 GB/s
   inside a node, 50 GB/s across). For EASGD and DiLoCo the average step is a
   local step plus a sync step / period. Compute time = FLOPs / (peak x the
   description's efficiency); no overlap of compute and communication.

2. `--curves`: trains the quickstart on this machine's CPU for the same number of
   steps with each method (its own mesh, data=2,fsdp=2,tensor=2) and writes the
   loss curves (JSON and a plot).

    python benchmarks/slow_links.py --json out.json
    python benchmarks/slow_links.py --curves --json curves.json --plot docs/img/sync-losses.png
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
METHODS = [("allreduce", None), ("easgd", 4), ("easgd", 16), ("diloco", 4), ("diloco", 16)]


def _experiment(name: str, method: str, period: int | None, extra: list[str]):
    from plait.config import load_experiment

    sets = [f'sync.method="{method}"'] + ([f"sync.period={period}"] if period else [])
    return load_experiment(ROOT / "experiments" / f"{name}.toml", sets + extra)


def _groups(ops: list[dict]) -> dict:
    groups: dict[tuple, list[float]] = {}
    for op in ops:
        acc = groups.setdefault((op["kind"], ",".join(op["axes"]), op["group_size"]), [0.0, 0.0])
        acc[0] += op["count"]
        acc[1] += op["wire_bytes"]
    return groups


def predict(models: list[str], mesh_text: str, hardware: str) -> list[dict]:
    from plait import mesh as mesh_lib
    from plait.hardware import load_hardware
    from plait.inspect import inspect_step
    from plait.sweep.cost import comm_time
    from plait.sweep.shapes import Candidate

    hw = load_hardware(hardware)
    spec = mesh_lib.load_spec(mesh_text)
    n = mesh_lib.provision_devices(spec)
    sizes = mesh_lib.resolve(spec, n)
    mesh = mesh_lib.build_mesh(sizes, n)
    rows = []
    for name in models:
        # The quickstart's batch of 16 does not split over 32 devices: 2 rows each.
        extra = ["train.global_batch=64"] if name == "quickstart" else []
        for method, period in METHODS:
            exp = _experiment(name, method, period, extra)
            report = inspect_step(exp, mesh)
            width = 0.5 if exp.precision.compute == "bfloat16" else 1.0
            compute = report["flops_per_device"] / (hw.peak(exp.precision.compute, n)
                                                    * hw.efficiency)
            cand = Candidate(sizes)
            phases = report.get("phases") or {"step": report}
            comm = {k: comm_time(cand, _groups(v["collective_ops"]), hw, width)[0]
                    for k, v in phases.items()}
            if method == "allreduce":
                mean = comm["step"]
            else:
                mean = comm["local_step"] + comm["sync_step"] / period
            data_bytes = {k: v["wire_by_axes"].get("data", 0.0) * width
                          for k, v in phases.items()}
            data_comm = {k: comm_time(cand, _groups([o for o in v["collective_ops"]
                                                     if o["axes"] == ["data"]]), hw, width)[0]
                         for k, v in phases.items()}
            data_mean = (data_comm["step"] if method == "allreduce" else
                         data_comm["local_step"] + data_comm["sync_step"] / period)
            row = {"model": name, "method": method, "period": period, "mesh": mesh_text,
                   "hardware": hardware, "compute_s": compute, "comm_s": mean,
                   "comm_share": mean / (mean + compute), "data_comm_s": data_mean,
                   "comm_s_by_step": comm, "data_wire_bytes_by_step": data_bytes,
                   "parameters": report["parameters"]}
            rows.append(row)
            print(f"{name:11s} {method:9s} period {period or '-':>3}: compute "
                  f"{compute * 1e3:8.2f} ms, comm {mean * 1e3:8.2f} ms per step (over data "
                  f"{data_mean * 1e3:8.2f} ms) "
                  f"-> {100 * row['comm_share']:5.1f}% communication", flush=True)
    return rows


def curves(steps: int | None) -> list[dict]:
    from plait import mesh as mesh_lib
    from plait.train.loop import train

    out = []
    for method, period in [("allreduce", None), ("easgd", 4), ("diloco", 4), ("diloco", 16)]:
        sets = ['log.console="none"', "log.tensorboard=false", "checkpoint.enabled=false"]
        if steps:
            sets.append(f"train.steps={steps}")
        exp = _experiment("quickstart", method, period, sets)
        spec = mesh_lib.load_spec("data=2,fsdp=2,tensor=2")
        n = mesh_lib.provision_devices(spec)
        mesh = mesh_lib.build_mesh(mesh_lib.resolve(spec, n), n)
        with tempfile.TemporaryDirectory() as tmp:
            summary = train(exp, mesh, Path(tmp))
        losses = [r["loss"] for r in summary["records"]]
        steps_at = [r["step"] for r in summary["records"]]
        out.append({"method": method, "period": period, "steps": steps_at, "loss": losses,
                    "final_loss": losses[-1]})
        print(f"quickstart {method:9s} period {period or '-':>3}: final loss {losses[-1]:.4f} "
              f"after {steps_at[-1]} steps", flush=True)
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        label = r["method"] + (f" (period {r['period']})" if r["period"] else "")
        ax.plot(r["steps"], r["loss"], label=f"{label}: {r['final_loss']:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean over replicas)")
    ax.set_title("quickstart, data=2,fsdp=2,tensor=2, 2-core CPU")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="quickstart,gpt2-124m")
    ap.add_argument("--mesh", default="data=32")
    ap.add_argument("--hardware", default="h100-4node")
    ap.add_argument("--curves", action="store_true", help="train the quickstart instead")
    ap.add_argument("--steps", type=int, default=None, help="--curves: steps (default its own)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path)
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if a.curves:
        rows = curves(a.steps)
        if a.plot:
            plot(rows, a.plot)
    else:
        rows = predict(a.models.split(","), a.mesh, a.hardware)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
