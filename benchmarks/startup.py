"""Start-up time of `plait train` (launch to its first step) against depth.

    python benchmarks/startup.py [EXPERIMENT] [--layers 8 64] [--rounds 3] \
        [--set model.d_model=256 ...] [--json out.json]

Each round launches `plait train EXPERIMENT --set model.layers=L --set
train.steps=1` once per depth, alternating depths, in a fresh process with an
empty compilation cache (what a user's first run pays). Start-up is launch to
the moment the first step is ready to run (the loop's "step compiled" line):
importing plait, building and initialising the state, compiling the step.
The first step's own run time (which grows with depth as any step does) is
printed beside it, not counted. Printed per depth: medians of start-up, the
step's compile time (summary.json's compile_s) and the first step; the ratio
of the deepest to the shallowest.

By default it is the 1.3B's shape (experiments/gpt2-1.3b.toml: sequence 1024,
vocabulary 50257, scanned layers, remat) at d_model 256, 8 heads and
d_ff 1024 with one row per batch, so the CPU runs it in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from report import run_script  # benchmarks/ is the script's directory

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SETS = ["model.d_model=256", "model.heads=8", "model.d_ff=1024",
                "train.global_batch=1", "precision.compute='float32'"]


def one_start(experiment: Path, layers: int, sets: list[str], mesh: str | None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        args = [sys.executable, "-m", "plait", "train", str(experiment), "--run-dir",
                str(run_dir), "--set", f"model.layers={layers}", "--set", "train.steps=1",
                "--set", "checkpoint.enabled=false", "--set", "log.tensorboard=false"]
        if mesh:
            args += ["--mesh", mesh]
        for s in sets:
            args += ["--set", s]
        env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION")}
        env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
        t0 = time.perf_counter()
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=env)
        lines, ready = [], None
        for line in proc.stdout:  # the loop says when the step is compiled, then runs it
            lines.append(line)
            if ready is None and "step compiled in" in line:
                ready = time.perf_counter() - t0
        proc.wait()
        wall = time.perf_counter() - t0
        if proc.returncode or ready is None:
            sys.exit(f"plait train failed (exit {proc.returncode}):\n{''.join(lines)[-3000:]}")
        summary = json.loads((run_dir / "summary.json").read_text())
    return {"start_s": ready, "first_step_s": wall - ready, "compile_s": summary["compile_s"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("experiment", nargs="?", default=str(ROOT / "experiments/gpt2-1.3b.toml"))
    ap.add_argument("--layers", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mesh", default="data=1", help="as plait train --mesh")
    ap.add_argument("--set", dest="sets", action="append", default=None,
                    help=f"overrides (default: {' '.join(DEFAULT_SETS)})")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    sets = DEFAULT_SETS if args.sets is None else args.sets
    runs: dict[int, list[dict]] = {n: [] for n in args.layers}
    for r in range(args.rounds):
        for n in args.layers:
            runs[n].append(one_start(Path(args.experiment), n, sets, args.mesh))
            last = runs[n][-1]
            print(f"round {r + 1}: {n} layers: start-up {last['start_s']:.1f}s (step compile "
                  f"{last['compile_s']:.1f}s), first step {last['first_step_s']:.1f}s", flush=True)
    keys = ("start_s", "compile_s", "first_step_s")
    med = {n: {k: statistics.median(x[k] for x in v) for k in keys} for n, v in runs.items()}
    lo, hi = min(args.layers), max(args.layers)
    print(f"machine: {platform.node()} ({os.cpu_count()} cores), {args.rounds} rounds, "
          f"{Path(args.experiment).name} with {' '.join(sets)}")
    for n in args.layers:
        print(f"  {n:4d} layers: start-up {med[n]['start_s']:.1f}s (median), "
              f"step compile {med[n]['compile_s']:.1f}s, first step {med[n]['first_step_s']:.1f}s")
    ratio = med[hi]["start_s"] / med[lo]["start_s"]
    print(f"  {hi} / {lo} layers: start-up x{ratio:.2f}, "
          f"compile x{med[hi]['compile_s'] / med[lo]['compile_s']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"sets": sets, "runs": runs, "median": med,
                                               "ratio": ratio}, indent=2))
    return 0


if __name__ == "__main__":
    run_script(main)
