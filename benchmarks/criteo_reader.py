"""How fast Criteo data is converted and read: `plait data criteo`'s rate, and the
binary reader's samples/s against the TSV reader's, on one core.

    python benchmarks/criteo_reader.py [--lines 200000] [--batch 128 2048] [--rounds 5]

Makes a Criteo-shaped TSV file (label, 13 integers, 26 hex values; the Kaggle
shape's 26 tables from experiments/dlrm-kaggle.toml), converts it, then reads
consecutive batches as training does (`rows(step, 0, batch)`: one process
holding every row) for about a second per round and reports the median
samples/s of each reader. Python runs one thread: this is one core.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from report import run_script  # benchmarks/ is the script's directory

ROOT = Path(__file__).resolve().parent.parent


def write_tsv(path: Path, lines: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for start in range(0, lines, 10000):
            n = min(10000, lines - start)
            labels = rng.integers(0, 2, n)
            dense = rng.integers(0, 5000, (n, 13))
            cats = rng.integers(0, 2**32, (n, 26), dtype=np.uint64)
            for i in range(n):
                f.write("\t".join([str(labels[i]), *map(str, dense[i]),
                                   *(format(int(c), "08x") for c in cats[i])]) + "\n")


def rate(source, batch: int, seconds: float = 1.0) -> float:
    n, t0, step = 0, time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        source.rows(step, 0, batch)
        n, step = n + batch, step + 1
    return n / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", type=int, default=200_000)
    ap.add_argument("--batch", type=int, nargs="+", default=[128, 2048])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    from plait.config_files import load_experiment
    from plait.data.criteo import CriteoTSV
    from plait.data.criteo_bin import CriteoBinary, convert

    rows = load_experiment(ROOT / "experiments" / "dlrm-kaggle.toml").model.table_rows
    with tempfile.TemporaryDirectory() as tmp:
        tsv = Path(tmp) / "day.tsv"
        write_tsv(tsv, args.lines)
        t0 = time.perf_counter()
        convert([str(tsv)], str(Path(tmp) / "bin"), report=lambda _: None)
        conv = time.perf_counter() - t0
        print(f"convert: {args.lines:,} lines in {conv:.1f}s ({args.lines / conv:,.0f} lines/s, "
              f"{tsv.stat().st_size / conv / 2**20:.1f} MiB/s)")
        for batch in args.batch:
            binary = CriteoBinary(str(Path(tmp) / "bin"), rows, batch)
            text = CriteoTSV(str(tsv), rows, batch, "skip")
            b = [rate(binary, batch) for _ in range(args.rounds)]
            t = [rate(text, batch, 0.5) for _ in range(max(1, args.rounds // 2))]
            print(f"batch {batch}: binary {statistics.median(b):,.0f} samples/s, "
                  f"TSV {statistics.median(t):,.0f} samples/s "
                  f"({statistics.median(b) / statistics.median(t):,.0f}x)")
    return 0


if __name__ == "__main__":
    run_script(main)
