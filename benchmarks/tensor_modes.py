"""Compile one experiment under every tensor mode at several device counts; a markdown table.

    python benchmarks/tensor_modes.py experiments/gpt2-1.3b.toml --devices 8 64 \
        --set model.heads=64 --json out.json

Each device count runs `plait inspect --compare-tensor-modes` in its own process
(simulated CPU devices are fixed when JAX starts). Nothing is trained: the
figures are read from the compiled programs, per device per step.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from report import run_script  # benchmarks/ is the script's directory


def compare(experiment: str, devices: int, sets: list[str]) -> dict:
    cmd = [sys.executable, "-m", "plait", "inspect", experiment, "--mesh", "data=-1",
           "--devices", str(devices), "--compare-tensor-modes", "--json"]
    for s in sets:
        cmd += ["--set", s]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    out = json.loads(proc.stdout)
    out["wall_s"] = time.perf_counter() - t0
    return out


def gib(x: float) -> str:
    return f"{x / 2**30:.2f}"


def markdown(result: dict) -> str:
    lines = [
        f"{result['devices']} devices ({result['wall_s'] / 60:.1f} min to compile all modes):",
        "",
        "| mode | mesh | tensor-axis GiB (HLO) | formula GiB | HLO / formula "
        "| weights GiB | temp GiB | compile s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["modes"]:
        if "error" in r:
            lines.append(f"| {r['mode']} | `{r['mesh']}` | {r['error']} | | | | | |")
            continue
        formula = r["tensor_formula_bytes"]  # None: not modelled (a mixture of experts)
        ratio = f"{r['tensor_wire_bytes'] / formula:.3f}" if formula else "-"
        lines.append(
            f"| {r['mode']} | `{r['mesh']}` | {gib(r['tensor_wire_bytes'])} "
            f"| {'-' if formula is None else gib(formula)} | {ratio} "
            f"| {gib(r['param_bytes_per_device'])} | {gib(r['temp_bytes'])} "
            f"| {r['compile_s']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("experiment")
    ap.add_argument("--devices", type=int, nargs="+", default=[8])
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--json", help="write the raw results here")
    args = ap.parse_args()
    results = []
    for n in args.devices:
        print(f"compiling {args.experiment} on {n} simulated devices ...", file=sys.stderr)
        results.append(compare(args.experiment, n, args.sets))
        print(markdown(results[-1]) + "\n", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    run_script(main)
