"""plait's DLRM against the reference PyTorch DLRM (facebookresearch/dlrm), same shape.

    python benchmarks/dlrm_vs_reference.py --reference PATH/TO/dlrm \
        [--torch-python PYTHON] [--mesh data=1] [--rounds 3] [--steps 10] [--json out.json]
    python benchmarks/dlrm_vs_reference.py --scaling --rows 1000000 10000000 --tables 2

The first form runs `dlrm_s_pytorch.py --data-generation=random` with the
dlrm-bench shape (8 tables x 1M rows x 64, 100 ids per bag, fixed; bottom
512-512-64, top 1024-1024-1024-1; batch 2048; SGD lr 0.01; float32) and
plait's `experiments/dlrm-bench.toml` in alternating rounds, so machine noise
hits both alike. The reference's own per-iteration times are read from its
log (`--print-freq=1 --print-time`: forward, backward and optimizer, data
loading excluded); plait's are timed three ways: the compiled step on batches
generated beforehand (data excluded likewise, compile excluded), synchronised
after every step and dispatched back to back with one sync at the end, and plait's
training loop as `plait train` runs it (`train.loop.train`: batches made each
step, metrics, no checkpoints; the step times metrics.jsonl records, after
--warmup, logging every --log-every steps). Reported: the median ms/step and
samples/s of each per round, and the medians of the per-round ratios
(reference / plait's loop is the end-to-end figure). The checkout of the
reference is not part of plait: pass its path.
Without --reference, plait alone: its loop against its step.

`--scaling` times plait's step with every table at each of --rows (fewer
tables, --tables, so 10M rows fit in memory): a sparse update should make the
step time follow the batch, not the table size.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from report import run_script  # benchmarks/ is the script's directory

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "experiments" / "dlrm-bench.toml"


def reference_ms(ref: Path, python: str, steps: int, warmup: int, rows: list[int],
                 gpu: bool, env: dict | None = None) -> list[float]:
    """Per-iteration ms of the reference, iterations after `warmup`."""
    args = [python, "dlrm_s_pytorch.py", "--arch-sparse-feature-size=64",
            "--arch-mlp-bot=512-512-64", "--arch-mlp-top=1024-1024-1024-1",
            "--arch-embedding-size=" + "-".join(str(r) for r in rows),
            "--data-generation=random", "--mini-batch-size=2048",
            f"--num-batches={warmup + steps}", "--num-indices-per-lookup=100",
            "--num-indices-per-lookup-fixed=True", "--arch-interaction-op=dot",
            "--numpy-rand-seed=727", "--print-freq=1", "--print-time", "--learning-rate=0.01"]
    if gpu:
        args.append("--use-gpu")
    out = subprocess.run(args, cwd=ref, capture_output=True, text=True,
                         env={**os.environ, **(env or {})})
    if out.returncode:
        sys.exit(f"reference failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    times = [float(m) for m in re.findall(r"([0-9.]+) ms/it", out.stdout)]
    if len(times) < warmup + steps:
        sys.exit(f"reference printed {len(times)} iteration times:\n{out.stdout[-2000:]}")
    return times[warmup:]


class PlaitBench:
    """The dlrm-bench step compiled once; timed on pre-generated batches."""

    def __init__(self, mesh_text: str, sets: list[str], n_batches: int = 3):
        import jax

        from plait import mesh as mesh_lib
        from plait.config_files import load_experiment
        from plait.tasks.dlrm import DLRMTask

        spec = mesh_lib.load_spec(mesh_text)
        n = mesh_lib.provision_devices(spec)
        self.mesh = mesh_lib.build_mesh(mesh_lib.resolve(spec, n), n)
        self.exp = load_experiment(BENCH, sets)
        self.job = DLRMTask(self.exp, self.mesh)
        source = self.job.source()
        self.batches = [self.job.batch(source, k) for k in range(n_batches)]
        self.state = self.job.init_state()
        t0 = time.perf_counter()
        self.step = self.job.compile()
        self.compile_s = time.perf_counter() - t0
        self.jax = jax

    def loop_ms(self, steps: int, warmup: int, log_every: int = 1) -> list[float]:
        """Per-step ms of the training loop a user runs, data included.

        With `log_every` = 1 the loop synchronises with the device every step, as the
        step alone is timed; a user's run (log.every_steps = 10 in dlrm-bench) syncs
        only at log steps, and each record is then the mean over its interval.
        """
        import tempfile

        from plait.train.loop import train

        exp = self.exp.model_copy(update={
            "train": self.exp.train.model_copy(update={"steps": warmup + steps}),
            "checkpoint": self.exp.checkpoint.model_copy(update={"enabled": False}),
            "log": self.exp.log.model_copy(update={"every_steps": log_every, "console": "none",
                                                   "tensorboard": False})})
        with tempfile.TemporaryDirectory() as tmp:
            records = train(exp, self.mesh, Path(tmp) / "run")["records"]
        return [1e3 * r["step_time_s"] for r in records if r["step"] > warmup
                and "step_time_s" in r]

    def ms(self, steps: int, warmup: int) -> list[float]:
        out = []
        for k in range(warmup + steps):
            t0 = time.perf_counter()
            self.state, m = self.step(self.state, self.batches[k % len(self.batches)])
            self.jax.block_until_ready((self.state, m))
            if k >= warmup:
                out.append(1e3 * (time.perf_counter() - t0))
        return out


    def pipelined_ms(self, steps: int) -> float:
        """Mean ms of `steps` steps dispatched back to back, one sync at the end (what a
        loop that syncs only at log steps can at best reach)."""
        self.ms(0, 2)
        t0 = time.perf_counter()
        for k in range(steps):
            self.state, m = self.step(self.state, self.batches[k % len(self.batches)])
        self.jax.block_until_ready((self.state, m))
        return 1e3 * (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reference", help="path of a facebookresearch/dlrm checkout")
    ap.add_argument("--torch-python", default=sys.executable,
                    help="python with torch (and the reference's imports) installed")
    ap.add_argument("--mesh", default="data=1", help="plait's mesh (default: one device)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--gpu", action="store_true", help="run the reference with --use-gpu")
    ap.add_argument("--reference-hugepages", action="store_true",
                    help="also run the reference with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 "
                    "(its tensors in 2 MiB pages, as plait puts its tables on CPUs)")
    ap.add_argument("--scaling", action="store_true", help="plait only: step time vs rows")
    ap.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 10_000_000])
    ap.add_argument("--tables", type=int, default=8)
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--log-every", type=int, default=1,
                    help="the loop's log.every_steps (1: a device sync every step, like the "
                    "step alone; 10: what dlrm-bench runs)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    result: dict = {"machine": platform.processor() or platform.machine(),
                    "date": time.strftime("%Y-%m-%d"), "mesh": a.mesh,
                    "log_every": a.log_every}
    if a.scaling:
        per_rows = {}
        for rows in a.rows:
            sets = [*a.sets, f"model.embedding_rows={[rows] * a.tables}"]
            bench = PlaitBench(a.mesh, sets)
            times = [statistics.median(bench.ms(a.steps, a.warmup)) for _ in range(a.rounds)]
            per_rows[rows] = {"median_ms": statistics.median(times), "rounds_ms": times,
                              "compile_s": bench.compile_s}
            print(f"plait {a.tables} tables x {rows:,} rows: {statistics.median(times):.1f} "
                  f"ms/step (rounds {', '.join(f'{t:.1f}' for t in times)})", flush=True)
            del bench
        lo, hi = min(a.rows), max(a.rows)
        result.update(scaling=per_rows, tables=a.tables,
                      ratio=per_rows[hi]["median_ms"] / per_rows[lo]["median_ms"])
        print(f"step time at {hi:,} rows / at {lo:,} rows: {result['ratio']:.3f}")
    else:
        rows = [1_000_000] * 8
        bench = PlaitBench(a.mesh, a.sets)
        rounds = []
        for r in range(a.rounds):
            step = statistics.median(bench.ms(a.steps, a.warmup))
            loop = statistics.median(bench.loop_ms(a.steps, a.warmup, a.log_every))
            piped = bench.pipelined_ms(a.steps)
            row = {"plait_step_ms": step, "plait_step_pipelined_ms": piped,
                   "plait_loop_ms": loop, "loop_over_step": loop / step}
            text = (f"round {r + 1}: plait step alone {step:.2f} ms ({2048e3 / step:,.0f} "
                    f"samples/s; {piped:.2f} ms back to back), plait loop {loop:.2f} ms "
                    f"({2048e3 / loop:,.0f} samples/s, {loop / step:.3f}x the step)")
            if a.reference:
                ref = statistics.median(reference_ms(Path(a.reference), a.torch_python,
                                                     a.steps, a.warmup, rows, a.gpu))
                row.update(reference_ms=ref, speedup=ref / loop, step_speedup=ref / step)
                text += (f"; reference {ref:.1f} ms ({2048e3 / ref:,.0f} samples/s): loop "
                         f"{ref / loop:.2f}x, step {ref / step:.2f}x")
            if a.reference and a.reference_hugepages:
                ref_h = statistics.median(reference_ms(
                    Path(a.reference), a.torch_python, a.steps, a.warmup, rows, a.gpu,
                    {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}))
                row.update(reference_hugetlb_ms=ref_h, speedup_hugetlb=ref_h / loop)
                text += f"; reference in 2 MiB pages {ref_h:.1f} ms: loop {ref_h / loop:.2f}x"
            rounds.append(row)
            print(text, flush=True)
        med = {k: statistics.median(x[k] for x in rounds) for k in rounds[0]}
        result.update(rounds=rounds, median=med, plait_compile_s=bench.compile_s)
        print(f"medians: plait loop / step {med['loop_over_step']:.3f}"
              + (f"; reference / plait loop {med['speedup']:.2f}x, reference / plait step "
                 f"{med['step_speedup']:.2f}x" if a.reference else "")
              + (f"; reference in 2 MiB pages / plait loop {med['speedup_hugetlb']:.2f}x"
                 if "speedup_hugetlb" in med else ""))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    run_script(main)
