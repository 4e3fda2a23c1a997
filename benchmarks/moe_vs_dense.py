"""Tokens/s of a mixture of experts against its dense twin, with plait train's loop.

The twin replaces each sparse MLP by one dense MLP of top_k x the experts' hidden size
(plus the shared expert's): the same weights in every token's matrix multiplies (the
router's d x E aside), so the FLOPs per token are equal and the ratio of tokens/s is
what routing, sorting and grouped matmuls cost. Both train alternating for `--rounds`
(each round trains each model `--steps` steps, data included, no checkpoints; the
first `--warmup` steps of each are dropped), each training in a Python process of its
own (this script with `--only NAME`), as `plait train` runs: on an H200 a training
after another in one process measured 363 ms a step against 240 in a process of its
own (docs/benchmarks.md, "An eighth GPU session"); until 2026-11-27 both ran in one
process. The result is the median ratio of the rounds, side by side on one device.
Issue 28 asks for >= 0.70 (dropless, on a GPU). `--variant NAME:KEY=VALUE,...` adds
the mixture of experts with those settings to every round (e.g.
`pallas:model.moe.grouped="pallas"`), with its own ratio to the same twin;
`--pallas-blocks FILE` takes the kernels' tiling from `pallas_blocks.py`'s JSON.

    python benchmarks/moe_vs_dense.py experiments/mixtral-mini.toml [--rounds 3] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from report import json_of_own_process, report, run_script
from throughput import speed, train_loop  # benchmarks/ is the script's directory


def dense_twin(exp):
    """The experiment with each sparse MLP replaced by a dense one of the same active
    weights."""
    m = exp.model
    f = m.moe.top_k * m.expert_d_ff + m.moe.shared_d_ff
    return exp.model_copy(update={"name": f"{exp.name}-dense",
                                  "model": m.model_copy(update={"moe": None, "d_ff": f})})


def timed(exp, mesh, steps: int, warmup: int) -> dict:
    return speed(exp, train_loop(exp, mesh, steps), warmup)


def in_own_process(name: str) -> dict:
    """`timed` of the model `name` (moe, dense or a variant) in a fresh process: this
    script, as called, with `--only name` (`report.json_of_own_process`)."""
    return json_of_own_process(__file__, [*sys.argv[1:], "--only", name],
                               stdout=subprocess.DEVNULL)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("experiment")
    ap.add_argument("--mesh", default="data=1")
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                    help="another mixture of experts measured in every round")
    ap.add_argument("--pallas-blocks", help="pallas_blocks.py's JSON: the tiling of "
                    "model.moe.grouped = \"pallas\"'s kernels")
    ap.add_argument("--json", help="write the result here too")
    ap.add_argument("--only", help=argparse.SUPPRESS)  # one model's run, in its process
    args = ap.parse_args()

    import jax

    from plait import mesh as mesh_lib
    from plait.config_files import load_experiment
    from plait.errors import UserError
    from plait.hardware import peak_flops
    from plait.models import gpt_counts

    moe = load_experiment(args.experiment, args.sets)
    if moe.model.kind not in ("gpt", "llama") or moe.model.moe is None:
        raise UserError(f"{args.experiment} has no [model.moe]; pass a mixture of experts, "
                        "e.g. experiments/mixtral-mini.toml")
    variants, variant_sets = {}, {}
    for text in args.variant:
        name, _, sets = text.partition(":")
        if not name or not sets or name in ("moe", "dense", *variants):
            raise UserError(f"--variant {text!r}: give NAME:KEY=VALUE[,KEY=VALUE], a name "
                            "of its own (not moe or dense)")
        variants[name] = load_experiment(args.experiment, args.sets + sets.split(","))
        variant_sets[name] = sets
    if args.pallas_blocks:
        from plait.parallel import grouped_pallas

        grouped_pallas.BLOCKS.update(json.loads(Path(args.pallas_blocks).read_text())["best"])
    dense = dense_twin(moe)
    models = {"moe": moe, **variants, "dense": dense}
    spec = mesh_lib.load_spec(args.mesh)
    if args.only is not None:  # one run, in the process in_own_process started
        n = mesh_lib.provision_devices(spec)
        mesh = mesh_lib.build_mesh(mesh_lib.resolve(spec, n), n)
        got = timed(models[args.only], mesh, args.steps, args.warmup)
        Path(args.json).write_text(json.dumps({**got, "pid": os.getpid()}) + "\n")
        return 0
    rounds = []
    for i in range(args.rounds):
        got = {name: in_own_process(name) for name in models}
        got["ratio"] = got["moe"]["tokens_per_s"] / got["dense"]["tokens_per_s"]
        for name in variants:
            got[f"ratio_{name}"] = got[name]["tokens_per_s"] / got["dense"]["tokens_per_s"]
        print(f"round {i + 1}: " + ", ".join(
            f"{name} {got[name]['tokens_per_s']:,.0f} tokens/s" for name in
            ("moe", *variants, "dense")) + f": {got['ratio']:.3f}" + "".join(
            f", {name} {got[f'ratio_{name}']:.3f}" for name in variants), flush=True)
        rounds.append(got)
    n = mesh_lib.provision_devices(spec)  # after the runs: this process holds no device
    device = jax.devices()[0]
    peak = peak_flops(device.device_kind, moe.precision.compute)

    def mfu(exp, key: str) -> float | None:
        tps = statistics.median(r[key]["tokens_per_s"] for r in rounds)
        return gpt_counts.flops_per_token(exp.model) * tps / (n * peak) if peak else None

    result = {
        "date": time.strftime("%Y-%m-%d"), "device": device.device_kind, "devices": n,
        "jax": jax.__version__, "experiment": moe.name,
        "mesh": mesh_lib.inline(mesh_lib.resolve(spec, n)),
        "precision": moe.precision.compute, "capacity_factor": moe.model.moe.capacity_factor,
        "global_batch": moe.train.global_batch, "seq_len": moe.model.seq_len,
        "params": {"moe": gpt_counts.param_count(moe.model),
                   "dense": gpt_counts.param_count(dense.model)},
        "active_matmul_params": {"moe": gpt_counts.active_matmul_params(moe.model),
                                 "dense": gpt_counts.active_matmul_params(dense.model)},
        "dense_d_ff": dense.model.d_ff,
        "median_ratio": statistics.median(r["ratio"] for r in rounds),
        "variants": {name: {"sets": variant_sets[name], "mfu": mfu(exp, name),
                            "median_ratio": statistics.median(r[f"ratio_{name}"] for r in rounds)}
                     for name, exp in variants.items()},
        "mfu": {"moe": mfu(moe, "moe"), "dense": mfu(dense, "dense")},
        "rounds": rounds,
    }
    report(result, args.json)
    return 0


if __name__ == "__main__":
    run_script(main)
