"""Tokens/s and MFU of plait's training loop for one experiment on the devices at hand.

Runs `--steps` steps (no checkpoints), drops the first `--warmup` from the
statistics, and prints one JSON object: median step time, tokens/s, MFU (null
where the device's peak is unknown, e.g. CPUs), compile time and the machine.

    python benchmarks/throughput.py experiments/gpt2-124m.toml --steps 30
    python benchmarks/throughput.py experiments/gpt2-1.3b.toml --mesh data=1 --steps 20 \
        --set train.global_batch=8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from report import json_of_own_process, report, run_script  # benchmarks/ is the script's directory


def in_own_process(experiment: str, sets: list[str], steps: int, *, mesh: str = "data=1",
                   warmup: int = 5, losses: bool = False, quiet: bool = False) -> dict:
    """This script's JSON for one run in a Python process of its own, as `plait train`
    runs (with `losses`: each step's loss too; `report.json_of_own_process`). Runs
    compared side by side each get a fresh process: on an H200 on 2026-11-27, gpt2-1.3b's
    FP8 step trained after its bf16 run in one process took 363 ms, and 240 ms in
    `plait train` (docs/benchmarks.md, "An eighth GPU session")."""
    args = [experiment, "--steps", str(steps), "--warmup", str(warmup), "--mesh", mesh]
    args += ["--losses"] if losses else []
    for s in sets:
        args += ["--set", s]
    return json_of_own_process(__file__, args, quiet=quiet)


def timed_run(experiment: str, sets: list[str], steps: int, mesh_text: str,
              log_every: int = 1):
    """(experiment, mesh, summary) of `steps` steps of plait train's loop (data included,
    no checkpoints, every `log_every`-th step logged with its time)."""
    from plait import mesh as mesh_lib
    from plait.config_files import load_experiment

    exp = load_experiment(experiment, sets)  # train_loop sets the steps, logs, no saves
    spec = mesh_lib.load_spec(mesh_text)
    n = mesh_lib.provision_devices(spec)
    mesh = mesh_lib.build_mesh(mesh_lib.resolve(spec, n), n)
    return exp, mesh, train_loop(exp, mesh, steps, log_every)


def train_loop(exp, mesh, steps: int, log_every: int = 1) -> dict:
    """The summary of `steps` steps of plait train's loop for `exp` on `mesh`: data
    included, no checkpoints, every `log_every`-th step logged with its time, in a
    scratch directory."""
    from plait.train.loop import train_briefly

    return train_briefly(exp, mesh, steps, console="line", log_every=log_every)


def step_times(summary: dict, warmup: int) -> list[float]:
    """The logged step times after the first `warmup` (all of them if that is none)."""
    times = [r["step_time_s"] for r in summary["records"] if r.get("step_time_s")]
    return times[warmup:] or times


def speed(exp, summary: dict, warmup: int) -> dict:
    """The median step after `warmup` and the tokens per second it gives."""
    times = step_times(summary, warmup)
    step = statistics.median(times)
    return {"median_step_s": step, "tokens_per_s": exp.train.global_batch * exp.model.seq_len
            / step, "compile_s": summary["compile_s"], "steps_timed": len(times)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("experiment")
    ap.add_argument("--mesh", default="data=1")
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5,
                    help="timed records dropped first (steps, or windows with --log-every)")
    ap.add_argument("--log-every", type=int, default=1,
                    help="log every N-th step (a record's time: the mean of its N steps). "
                         "1 syncs the host on every step; the experiments log every 10")
    ap.add_argument("--losses", action="store_true",
                    help="each logged step's loss in the JSON too (not printed)")
    ap.add_argument("--json", help="write the result here too")
    args = ap.parse_args()

    import jax

    from plait import mesh as mesh_lib
    from plait.hardware import peak_flops
    from plait.models.gpt_counts import flops_per_token

    if args.log_every < 1:
        ap.error("--log-every must be at least 1")
    exp, mesh, summary = timed_run(args.experiment, args.sets, args.steps, args.mesh,
                                   args.log_every)
    n = mesh.devices.size
    measured = speed(exp, summary, args.warmup)
    device = jax.devices()[0]
    peak = peak_flops(device.device_kind, exp.precision.compute)
    tps = measured["tokens_per_s"]
    result = {
        "date": time.strftime("%Y-%m-%d"), "device": device.device_kind, "devices": n,
        "jax": jax.__version__, "experiment": exp.name, "mesh": mesh_lib.inline(dict(mesh.shape)),
        "precision": exp.precision.compute, "global_batch": exp.train.global_batch,
        "seq_len": exp.model.seq_len, "remat": exp.model.remat,
        # the overrides as given (the start-up line of its log says what "auto" chose)
        "sets": args.sets,
        **measured, "log_every": args.log_every,
        "model_tflops_per_s_per_device": flops_per_token(exp.model) * tps / n / 1e12,
        "mfu": flops_per_token(exp.model) * tps / (n * peak) if peak else None,
        # the allocator's high-water mark of the busiest device (None on CPU)
        "peak_device_memory_gib": (summary["peak_device_memory_bytes"] / 2**30
                                   if "peak_device_memory_bytes" in summary else None),
    }
    report(result, None if args.losses else args.json)
    if args.losses and args.json:  # the losses in the file alone: hundreds of numbers
        losses = [r["loss"] for r in summary["records"]]
        Path(args.json).write_text(json.dumps(result | {"losses": losses}) + "\n")
    return 0


if __name__ == "__main__":
    run_script(main)
