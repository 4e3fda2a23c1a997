"""What the backward keeps: the activations autodiff saves between an experiment's
forward and backward (jax.ad_checkpoint's saved residuals of plait's loss), summed.

    python benchmarks/residuals.py experiments/llama3.2-1b.toml [--set KEY=VALUE ...] \
        [--top 12] [--json out.json]

It traces the loss on one device at the experiment's full batch and sequence without
allocating anything (abstract shapes), so it runs on a CPU for any model, and counts
what any backend must keep unless its compiler fuses an intermediate away: a GPU's
activation memory, measured where no GPU is. XLA's unfused attention keeps
[S, S] score arrays that cuDNN's fused attention does not; they are counted apart
(`attention_scores_gib`). The weights' compute-dtype copies and the step's arguments
are left out.
"""

from __future__ import annotations

import argparse
import collections
import time

from report import report, run_script  # benchmarks/ is the script's directory


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("experiment")
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--top", type=int, default=12, help="largest residual kinds listed")
    ap.add_argument("--json", help="write the result here too")
    args = ap.parse_args()

    import jax
    import numpy as np
    from jax._src.ad_checkpoint import saved_residuals  # the public one only prints

    from plait import mesh as mesh_lib
    from plait.config_files import load_experiment
    from plait.tasks import make_task

    exp = load_experiment(args.experiment, args.sets)
    task = make_task(exp, mesh_lib.build_mesh({"data": 1}, 1))
    params = task.layout.shapes["params"]  # shapes and dtypes, no sharding
    b = task.abstract_batch()  # [microbatches, rows, seq + 1]
    tokens = jax.ShapeDtypeStruct(b.shape[1:], b.dtype)
    kept, scores, kinds = 0, 0, collections.Counter()
    for aval, why in saved_residuals(task.loss, params, tokens):
        if why.startswith("from the argument") or "_cast" in why:
            continue  # the parameters, and their compute-dtype copies
        n = int(np.prod(aval.shape)) * aval.dtype.itemsize
        if len(aval.shape) >= 2 and aval.shape[-1] == aval.shape[-2] == exp.model.seq_len:
            scores += n
            continue
        kept += n
        kinds[f"{aval.dtype}{list(aval.shape)} {why.split(' from ')[0]}"] += n
    report({"date": time.strftime("%Y-%m-%d"), "experiment": exp.name, "sets": args.sets,
            "tokens": int(np.prod(tokens.shape[:-1])) * exp.model.seq_len,
            "residuals_gib": kept / 2**30, "attention_scores_gib": scores / 2**30,
            "largest": {k: v / 2**30 for k, v in kinds.most_common(args.top)}}, args.json)
    return 0


if __name__ == "__main__":
    run_script(main)
