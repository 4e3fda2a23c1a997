"""The census's estimate beside a GPU's measurement, JAX operation by JAX operation: which
operations the roofline misprices, and by how much.

    python benchmarks/ops_compare.py CENSUS.json PROFILE.json [--top 30] [--json F]

CENSUS.json: `gpu_census.py ... --top 200 --json` (its `ops`, estimated ms a step);
PROFILE.json: `kernel_profile.py ... --top 200 --json` on a GPU (its `ops`, measured ms a
step), both of the same experiment and tree. Operations either side lacks count as 0
there; a row's ratio is measured / estimated.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from report import report, run_script  # benchmarks/ is the script's directory


def compare(census: dict, profile: dict, top: int) -> dict:
    """Rows of (op, estimated ms, measured ms, ratio), the largest measured first, and the
    totals over every operation either side names."""
    estimated = {o["op"]: o["ms"] for o in census.get("ops", [])}
    measured = {o["op"]: o["ms_per_step"] for o in profile.get("ops", [])}
    rows = [{"op": op, "estimated_ms": estimated.get(op, 0.0),
             "measured_ms": measured.get(op, 0.0),
             "ratio": round(measured[op] / estimated[op], 2)
             if estimated.get(op) and op in measured else None}
            for op in sorted(set(estimated) | set(measured),
                             key=lambda o: (-measured.get(o, 0.0), -estimated.get(o, 0.0)))]
    return {"estimated_ms": round(sum(estimated.values()), 3),
            "measured_ms": round(sum(measured.values()), 3), "rows": rows[:top]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("census", type=Path)
    ap.add_argument("profile", type=Path)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--json")
    args = ap.parse_args()
    from plait.errors import UserError

    loaded = []
    for path, key in ((args.census, "gpu_census.py"), (args.profile, "kernel_profile.py")):
        if not path.exists():
            raise UserError(f"{path} does not exist: give the JSON {key} wrote (--json)")
        data = json.loads(path.read_text())
        if "ops" not in data:
            raise UserError(f"{path} has no ops: write it with {key} of this checkout")
        loaded.append(data)
    report(compare(*loaded, args.top), args.json)
    return 0


if __name__ == "__main__":
    run_script(main)
