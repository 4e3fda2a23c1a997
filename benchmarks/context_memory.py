"""Temporary memory per device of a long-sequence step: context=8 against data=8.

Compiles (does not run) the train step of a 2-layer Llama (d_model 64, 4 heads over
2 key/value heads) with 8 sequences per step on 8 simulated CPU devices, at each
sequence length: on data=8 (one whole sequence per device) and on context=8 (every
sequence split over the 8 devices), ring and all-gather attention. Reads the compiled
program's temporaries per device (XLA's buffer assignment, what `plait inspect`
prints). Attention's scores dominate at these lengths, so the model's width barely
matters; the ratio is the point.

    python benchmarks/context_memory.py [--seq 4096 16384 32768] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
from report import run_script  # benchmarks/ is the script's directory

SHAPES = (("data=8", "ring"), ("context=8", "ring"), ("context=8", "allgather"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[4096, 16384, 32768])
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    jax.config.update("jax_num_cpu_devices", 8)
    from plait import mesh as mesh_lib
    from plait.config import Experiment
    from plait.inspect import inspect_step

    def mesh(spec: str):
        s = mesh_lib.load_spec(spec)
        n = mesh_lib.provision_devices(s)
        return mesh_lib.build_mesh(mesh_lib.resolve(s, n), n, s.dcn)

    rows = []
    for seq in args.seq:
        for spec, attention in SHAPES:
            exp = Experiment.model_validate({
                "name": "context-memory",
                "model": {"kind": "llama", "layers": 2, "d_model": 64, "heads": 4,
                          "kv_heads": 2, "d_ff": 128, "vocab": 256, "seq_len": seq,
                          "rope_theta": 10000.0},
                "train": {"global_batch": 8}, "context": {"attention": attention}})
            r = inspect_step(exp, mesh(spec))
            rows.append({"seq_len": seq, "mesh": spec, "attention": attention,
                         "temp_bytes": r["memory"]["temp_bytes"],
                         "total_bytes": r["memory"]["total_bytes"]})
        base = next(x["temp_bytes"] for x in rows if x["seq_len"] == seq
                    and x["mesh"] == "data=8")
        for x in rows:
            if x["seq_len"] == seq:
                x["temp_over_data8"] = x["temp_bytes"] / base
                print(f"seq {seq:6d}  {x['mesh']:10s} {x['attention']:9s} temp "
                      f"{x['temp_bytes'] / 2**20:10.1f} MiB  {x['temp_over_data8']:.3f} x data=8",
                      flush=True)
    out = {"date": time.strftime("%Y-%m-%d"), "jax": jax.__version__,
           "platform": jax.devices()[0].platform, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    run_script(main)
