"""FP8 matmuls against bf16, side by side: tokens/s and the loss curves of one run each.

Trains the experiment twice with `plait train`'s loop (data included, no
checkpoints), precision.compute = "bfloat16" both times, precision.matmul
"default" then "fp8", same seed and data. Prints one JSON object: the median
step time and tokens/s of each (the first `--warmup` steps left out), their
ratio, and the largest relative gap between the two loss curves from step
`--from-step` on (each curve smoothed over `--window` steps: single steps of
two runs differ by their batches' noise more than by the precision).

    python benchmarks/fp8_vs_bf16.py experiments/gpt2-1.3b.toml --steps 300 \
        --set train.global_batch=8 --json gpu-out/fp8.json

On CPUs FP8 is refused; PLAIT_FP8_EMULATE=1 runs XLA's emulation (numbers only).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from report import run_script  # benchmarks/ is the script's directory
from throughput import speed, timed_run  # benchmarks/ is the script's directory


def _train(path: str, sets: list[str], matmul: str, steps: int, mesh_text: str) -> dict:
    exp, _, summary = timed_run(path, [*sets, "precision.compute='bfloat16'",
                                       f"precision.matmul='{matmul}'"], steps, mesh_text)
    return {"exp": exp, "summary": summary}


def _smooth(x: np.ndarray, w: int) -> np.ndarray:
    return np.convolve(x, np.ones(w) / w, mode="valid") if w > 1 else x


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("experiment")
    ap.add_argument("--mesh", default="data=1")
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--from-step", type=int, default=100)
    ap.add_argument("--window", type=int, default=10)
    ap.add_argument("--json", help="write the result here too")
    args = ap.parse_args()

    import jax

    from plait.models import fp8

    fp8.check_devices(jax.devices())  # before the bf16 run, not after it
    runs = {m: _train(args.experiment, args.sets, m, args.steps, args.mesh)
            for m in ("default", "fp8")}
    exp = runs["default"]["exp"]
    out: dict = {"date": time.strftime("%Y-%m-%d"), "device": jax.devices()[0].device_kind,
                 "jax": jax.__version__, "experiment": exp.name, "mesh": args.mesh,
                 "global_batch": exp.train.global_batch, "seq_len": exp.model.seq_len,
                 "steps": args.steps, "remat": exp.model.remat}
    curves = {}
    for m, r in runs.items():
        out[m] = speed(r["exp"], r["summary"], args.warmup)
        curves[m] = np.array([x["loss"] for x in r["summary"]["records"]])
        out[m]["losses"] = curves[m].tolist()
    out["fp8_speedup"] = out["fp8"]["tokens_per_s"] / out["default"]["tokens_per_s"]
    a, b = (_smooth(curves[m][args.from_step - 1:], args.window) for m in ("default", "fp8"))
    if len(a):
        out["max_rel_loss_gap_from_step"] = {"step": args.from_step, "window": args.window,
                                             "gap": float(np.max(np.abs(b - a) / np.abs(a)))}
    text = json.dumps(out)
    print(json.dumps({k: v for k, v in out.items() if k not in ("default", "fp8")}
                     | {m: {k: v for k, v in out[m].items() if k != "losses"}
                        for m in ("default", "fp8")}))
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    run_script(main)
