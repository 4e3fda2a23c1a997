"""Training across slow links: flat vs hierarchical allreduce vs Sync EASGD vs DiLoCo.

Two parts.

1. Predicted share of step time in communication (compile-only: nothing here is
   timed). Each method's train step is compiled on simulated CPU devices for a
   mesh (default data=4@dcn,data=8: one replica per GPU of 4 nodes x 8, the
   EASGD paper's setting, laid out as 4 simulated hosts); per-device matmul
   FLOPs and collective bytes, each classed within a host or across hosts, are
   read from the compiled HLO (plait inspect) and priced by the sweep's cost
   model (plait.sweep.cost) on a hardware description (default h100-4node:
   450 GB/s inside a node, 50 GB/s across). For EASGD and DiLoCo the average
   step is a local step plus a sync step / period (their exchange is
   hierarchical on this mesh). Compute time = FLOPs / (peak x the
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

from report import run_script  # benchmarks/ is the script's directory

ROOT = Path(__file__).resolve().parent.parent
# (method, period, sync.reduce)
METHODS = [("allreduce", None, "flat"), ("allreduce", None, "hierarchical"),
           ("easgd", 4, "auto"), ("easgd", 16, "auto"), ("diloco", 4, "auto"),
           ("diloco", 16, "auto")]


def _experiment(name: str, method: str, period: int | None, extra: list[str]):
    from plait.config_files import load_experiment

    sets = [f'sync.method="{method}"'] + ([f"sync.period={period}"] if period else [])
    return load_experiment(ROOT / "experiments" / f"{name}.toml", sets + extra)


def predict(models: list[str], mesh_text: str, hardware: str) -> list[dict]:
    from plait import mesh as mesh_lib
    from plait.hardware import load_hardware
    from plait.inspect import inspect_step

    hw = load_hardware(hardware)
    spec = mesh_lib.load_spec(mesh_text)
    n = mesh_lib.provision_devices(spec)
    mesh = mesh_lib.build_mesh(mesh_lib.resolve(spec, n), n, spec.dcn)
    rows = []
    for name in models:
        # The quickstart's batch of 16 does not split over 32 devices: 2 rows each.
        extra = ["train.global_batch=64"] if name == "quickstart" else []
        for method, period, reduce in METHODS:
            exp = _experiment(name, method, period, extra + [f'sync.reduce="{reduce}"'])
            report = inspect_step(exp, mesh, hw)
            compute = report["flops_per_device"] / (hw.peak(exp.precision.compute, n)
                                                    * hw.efficiency)
            phases = report.get("phases") or {"step": report}
            per_step = {k: {link: {"s": v["link_seconds"][link],
                                   "wire": v["wire_by_link"][link]}
                            for link in ("within_host", "across_hosts")}
                        for k, v in phases.items()}

            def mean(link: str, what: str, steps=per_step, every=period) -> float:
                if every is None:
                    return steps["step"][link][what]
                return steps["local_step"][link][what] + steps["sync_step"][link][what] / every

            comm = mean("within_host", "s") + mean("across_hosts", "s")
            label = f"{method} ({reduce})" if method == "allreduce" else method
            row = {"model": name, "method": method, "period": period, "reduce": reduce,
                   "mesh": mesh_text, "hardware": hardware, "compute_s": compute,
                   "comm_s": comm, "comm_share": comm / (comm + compute),
                   "comm_across_hosts_s": mean("across_hosts", "s"),
                   "wire_across_hosts_bytes": mean("across_hosts", "wire"),
                   "wire_within_host_bytes": mean("within_host", "wire"),
                   "by_step": per_step, "parameters": report["parameters"]}
            rows.append(row)
            print(f"{name:11s} {label:24s} period {period or '-':>3}: compute "
                  f"{compute * 1e3:7.2f} ms, comm {comm * 1e3:7.2f} ms per step (across "
                  f"hosts {row['comm_across_hosts_s'] * 1e3:7.2f} ms, "
                  f"{row['wire_across_hosts_bytes'] / 2**20:8.2f} MiB) "
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
    ap.add_argument("--mesh", default="data=4@dcn,data=8")
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
    run_script(main)
