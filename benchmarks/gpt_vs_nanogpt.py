"""plait against nanoGPT's `bench.py` at the same model shape and batch, side by side.

    python benchmarks/gpt_vs_nanogpt.py --reference PATH/TO/nanoGPT \
        [--torch-python PYTHON] [--batch 32] [--seq 1024] [--rounds 3] [--steps 30] \
        [--set model.attention=cudnn ...] [--no-matched] [--no-nanogpt-biases] [--json F]

nanoGPT's `bench.py` (a checkout the user passes; not part of plait) trains
GPT-2 124M (12 layers, 12 heads, d_model 768, vocabulary 50304, no biases) on
fixed random tokens (`--real_data=False`) with torch.compile, fused AdamW and
bf16 autocast, and prints its time per iteration over 20 steps after 10 of
burn-in. plait runs `benchmarks/throughput.py` on `experiments/gpt2-124m.toml`
at the same batch, sequence length and vocabulary twice a round: as shipped
(GPT-2's biases in every linear layer and norm) and with nanoGPT's architecture
(`model.bias=false`, what bench.py trains: the same matrix products, no bias adds
and no bias gradients); `--no-matched` runs only the first. bench.py runs a second
time each round with GPT-2's biases (`--bias=True`), so that plait as shipped is also
measured against the same model (`ratio_biases`; `--no-nanogpt-biases` skips it).
Either plait run is the training loop as `plait train` runs it: tokens made each
step, gradient clipping, metrics logged, compile excluded (bench.py reuses one batch
and does not clip). The runs
alternate for `--rounds` rounds so machine noise hits all; printed: tokens/s of
each per round, the medians and the median of the per-round ratios (plait /
nanoGPT).

bench.py calls torch.cuda.synchronize(), so it needs a CUDA build of torch and
a GPU.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
from pathlib import Path

from report import report, run_script  # benchmarks/ is the script's directory
from throughput import in_own_process  # benchmarks/ is the script's directory

ROOT = Path(__file__).resolve().parent.parent
# bench.py's GPTConfig(bias=False): no bias in any linear layer or LayerNorm
MATCHED = "model.bias=false"


def nanogpt_tokens_per_s(ref: Path, python: str, batch: int, seq: int,
                         biases: bool = False) -> float:
    """bench.py's tokens/s: its own architecture (no biases), or with `biases` GPT-2's
    (`--bias=True`: a bias in every linear layer and LayerNorm, as plait ships)."""
    args = [python, "bench.py", f"--batch_size={batch}", f"--block_size={seq}",
            "--real_data=False", "--profile=False"] + (["--bias=True"] if biases else [])
    out = subprocess.run(args, cwd=ref, capture_output=True, text=True)
    found = re.findall(r"time per iteration: ([0-9.]+)ms", out.stdout)
    if out.returncode or not found:
        sys.exit(f"nanoGPT bench.py failed (exit {out.returncode}):\n{out.stdout[-2000:]}\n"
                 f"{out.stderr[-3000:]}")
    return batch * seq / (float(found[-1]) / 1e3)


def plait_tokens_per_s(batch: int, seq: int, steps: int, sets: list[str]) -> dict:
    return in_own_process(str(ROOT / "experiments" / "gpt2-124m.toml"),
                          [f"train.global_batch={batch}", f"model.seq_len={seq}",
                           "model.vocab=50304", *sets], steps, quiet=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reference", required=True, help="a nanoGPT checkout (has bench.py)")
    ap.add_argument("--torch-python", default=sys.executable,
                    help="the Python with torch for bench.py (default: this one)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30, help="plait steps per round")
    ap.add_argument("--set", dest="sets", action="append", default=[],
                    help="extra plait --set overrides, e.g. model.scan_layers=false")
    ap.add_argument("--no-matched", dest="matched", action="store_false",
                    help="skip the run with nanoGPT's architecture (model.bias=false)")
    ap.add_argument("--no-nanogpt-biases", dest="nanogpt_biases", action="store_false",
                    help="skip bench.py with GPT-2's biases (--bias=True)")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    ref = Path(args.reference)
    if not (ref / "bench.py").is_file():
        from plait.errors import UserError

        raise UserError(f"{ref} has no bench.py; pass a nanoGPT checkout with --reference")
    rounds = []
    for i in range(args.rounds):
        ref_tps = nanogpt_tokens_per_s(ref, args.torch_python, args.batch, args.seq)
        mine = plait_tokens_per_s(args.batch, args.seq, args.steps, args.sets)
        row = {"nanogpt_tokens_per_s": ref_tps, "plait_tokens_per_s": mine["tokens_per_s"],
               "plait_mfu": mine["mfu"],
               "plait_peak_device_memory_gib": mine.get("peak_device_memory_gib"),
               "ratio": mine["tokens_per_s"] / ref_tps}
        line = (f"round {i + 1}: nanoGPT {ref_tps:,.0f} tokens/s, plait "
                f"{mine['tokens_per_s']:,.0f} tokens/s ({row['ratio']:.3f})")
        if args.matched:
            same = plait_tokens_per_s(args.batch, args.seq, args.steps,
                                      [*args.sets, MATCHED])
            row.update(plait_nobias_tokens_per_s=same["tokens_per_s"],
                       plait_nobias_mfu=same["mfu"],
                       ratio_nobias=same["tokens_per_s"] / ref_tps)
            line += (f", plait with nanoGPT's architecture (no biases) "
                     f"{same['tokens_per_s']:,.0f} tokens/s ({row['ratio_nobias']:.3f})")
        if args.nanogpt_biases:
            ref_b = nanogpt_tokens_per_s(ref, args.torch_python, args.batch, args.seq, True)
            row.update(nanogpt_biases_tokens_per_s=ref_b,
                       ratio_biases=mine["tokens_per_s"] / ref_b)
            line += (f"; nanoGPT with GPT-2's biases {ref_b:,.0f} tokens/s, plait as shipped "
                     f"against it {row['ratio_biases']:.3f}")
        rounds.append(row)
        print(line, flush=True)
    result = {"device": mine["device"], "date": mine["date"], "batch": args.batch,
              "seq": args.seq, "plait_sets": args.sets, "rounds": rounds}
    if args.matched:
        result["plait_nobias_sets"] = [*args.sets, MATCHED]
    for key in ("nanogpt_tokens_per_s", "plait_tokens_per_s", "ratio",
                "plait_nobias_tokens_per_s", "ratio_nobias", "nanogpt_biases_tokens_per_s",
                "ratio_biases"):
        if key in rounds[0]:
            name = key.removesuffix("_tokens_per_s")
            result[f"{name}_median"] = statistics.median(r[key] for r in rounds)
    report(result, args.json)
    return 0


if __name__ == "__main__":
    run_script(main)
