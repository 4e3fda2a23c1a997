"""FP8 matmuls against bf16, side by side: tokens/s and the loss curves of one run each.

Trains the experiment twice with `plait train`'s loop (data included, no
checkpoints), each in a process of its own (benchmarks/throughput.py: as a user's
`plait train` runs; a second run in one process measured 50% slower on an H200),
precision.compute = "bfloat16" both times, precision.matmul
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
from throughput import in_own_process  # benchmarks/ is the script's directory

# what each run's JSON gives per precision (throughput.py's keys)
KEYS = ("median_step_s", "tokens_per_s", "compile_s", "steps_timed", "mfu",
        "peak_device_memory_gib", "losses")


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

    import os
    from unittest import mock

    import jax

    from plait.models import fp8

    # before the bf16 run, not after it; the check needs the devices, not their memory
    # (the runs' processes take that; they get the environment as it was)
    with mock.patch.dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false"):
        fp8.check_devices(jax.devices())
    runs = {m: in_own_process(args.experiment, [*args.sets, "precision.compute='bfloat16'",
                                                f"precision.matmul='{m}'"], args.steps,
                              mesh=args.mesh, warmup=args.warmup, losses=True)
            for m in ("default", "fp8")}
    first = runs["default"]
    out: dict = {"date": time.strftime("%Y-%m-%d"), "device": first["device"],
                 "jax": first["jax"], "experiment": first["experiment"], "mesh": args.mesh,
                 "global_batch": first["global_batch"], "seq_len": first["seq_len"],
                 "steps": args.steps, "remat": first["remat"], "processes": "one a run"}
    curves = {}
    for m, r in runs.items():
        out[m] = {k: r[k] for k in KEYS}
        curves[m] = np.array(r["losses"])
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
