"""Host memory of the commands that read a trained run: plait sample, export and eval.

Trains a 125M-parameter Llama-shaped decoder one step on one CPU device (AdamW, so
the checkpoint holds the parameters and two moments: three times the parameters'
bytes), then runs each reader in a fresh process and reads its peak resident memory
(ru_maxrss of the child). With --compare TREE the same commands also run on the code
of another checkout (TREE/src on PYTHONPATH), alternating with this one round by
round, so the two are measured side by side.

    python benchmarks/reader_memory.py [--rounds 3] [--compare OLD_CHECKOUT] [--json out.json]
"""

from __future__ import annotations

import itertools
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from report import HERE, compare_parser, peak_gib, report, run_script, trees

MODEL = {"d_model": 768, "heads": 12, "kv_heads": 4, "d_ff": 2048, "layers": 12,
         "vocab": 32000, "seq_len": 128}


def _one(tree: Path, command: str, work: Path) -> float:
    """Peak resident GiB of one reader run on the code under `tree`."""
    return peak_gib(tree, _args(command, work), work)[0]


_EXPORTS = itertools.count()


def _args(command: str, work: Path) -> list[str]:
    return {"sample": ["sample", "run", "--prompt", "ab", "--tokens", "4"],
            "export": ["export", "run", "--out", str(work / f"hf-{next(_EXPORTS)}")],
            "eval": ["eval", "run", "--data", "val.bin", "--batch", "2", "--max-batches",
                     "2", "--mesh", "data=1"]}[command]


def main() -> None:
    args = compare_parser(__doc__).parse_args()
    measured = trees(args)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        sets = [f"--set=model.{k}={v}" for k, v in MODEL.items()]
        trained = subprocess.run([sys.executable, "-m", "plait", "train",
                        str(HERE / "experiments" / "llama-tiny.toml"), "--run-dir", "run",
                        "--steps", "1", "--mesh", "data=1", *sets,
                        "--set=train.global_batch=2", "--set=checkpoint.every_steps=1",
                        "--set=checkpoint.async_save=false"],
                                 cwd=work, check=True, capture_output=True, text=True,
                                 env=dict(os.environ, PYTHONPATH=str(HERE / "src")))
        millions = float(re.search(r"([0-9.]+)M parameters", trained.stdout + trained.stderr)
                         .group(1))
        np.random.default_rng(0).integers(0, 256, 4096).astype(np.uint16).tofile(
            work / "val.bin")
        state = sum(f.stat().st_size for f in (work / "run" / "checkpoints").rglob("*")
                    if f.is_file())
        peaks: dict[str, dict[str, list[float]]] = {t: {} for t in measured}
        for r in range(args.rounds):
            for name, tree in measured.items():
                commands = ("sample", "export", "eval")
                if name == "compare" and not (tree / "src" / "plait" / "evaluate.py").exists():
                    commands = ("sample", "export")
                for c in commands:
                    peaks[name].setdefault(c, []).append(_one(tree, c, work))
                print(f"round {r + 1}: {name} " + ", ".join(
                    f"{c} {v[-1]:.2f} GiB" for c, v in peaks[name].items()), file=sys.stderr)
    report({"model": MODEL, "parameters": millions * 1e6,
            "parameter_gib_float32": millions * 1e6 * 4 / 2**30, "checkpoint_bytes_on_disk": state,
            "peak_gib": peaks,
            "median_gib": {t: {c: statistics.median(v) for c, v in p.items()}
                           for t, p in peaks.items()}}, args.json)


if __name__ == "__main__":
    run_script(main)
