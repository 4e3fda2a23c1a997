"""Pipeline schedules side by side: bubble, lockstep cost from measured stage times, memory.

    python benchmarks/pipeline_schedules.py --json out.json

1. Times one pipeline stage of a GPT (forward with residuals, whole backward,
   input-gradient only, weight-gradient only) on one CPU device, medians of
   several runs.
2. For D = 4 and 8 pipeline ranks and N = D .. 4D microbatches, builds every
   schedule's table and weighs each lockstep tick by its slowest action (every
   rank waits for the exchange at the end of a tick): the lockstep cost.
3. Compiles the pipelined train step of a small GPT for each schedule on D
   simulated devices and reads the stash the executor allocates (slots x
   residual bytes of one microbatch) and XLA's temporary memory per device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from plait.config import Experiment  # noqa: E402
from plait.models import build, gpt, layer_stack  # noqa: E402
from plait.parallel import schedules  # noqa: E402

STAGE_MODEL = {"layers": 2, "d_model": 512, "heads": 8, "d_ff": 2048, "vocab": 4096,
               "seq_len": 256}


def _median_ms(fn, *args, repeats: int = 7) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def stage_times(batch: int) -> dict:
    """Milliseconds of one stage's forward, backward, input-gradient and weight-gradient."""
    exp = Experiment.model_validate({"model": STAGE_MODEL})
    cfg = exp.model
    stack = layer_stack(gpt.Block, cfg)
    params = build(gpt.GPT, cfg).init(0)["blocks"]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *(params[k] for k in sorted(params)))
    x = jax.random.normal(jax.random.key(0), (batch, cfg.seq_len, cfg.d_model))
    g = jax.random.normal(jax.random.key(1), x.shape)

    fwd = jax.jit(lambda p, x: jax.vjp(stack.apply, p, x))
    _, vjp_fn = fwd(stacked, x)

    @jax.jit
    def whole(vjp_fn, g):
        return vjp_fn(g)

    @jax.jit
    def input_grad(vjp_fn, g):
        return vjp_fn(g)[1]

    @jax.jit
    def weight_grad(vjp_fn, g):
        return vjp_fn(g)[0]

    return {"F": _median_ms(fwd, stacked, x), "B": _median_ms(whole, vjp_fn, g),
            "Bx": _median_ms(input_grad, vjp_fn, g), "W": _median_ms(weight_grad, vjp_fn, g)}


def lockstep_cost(s: schedules.Schedule, ms: dict) -> float:
    return sum(max((ms[a.kind] for a in row if a is not None), default=0.0) for row in s.table)


def compiled_memory(name: str, D: int, N: int, v: int) -> dict:
    from plait.mesh import build_mesh
    from plait.tasks.gpt import GPTTask

    exp = Experiment.model_validate({
        "model": {"layers": 8, "d_model": 128, "heads": 4, "d_ff": 512, "vocab": 512,
                  "seq_len": 64},
        "train": {"global_batch": 4 * N, "steps": 10},
        "pipeline": {"schedule": name, "microbatches": N, "virtual_stages": v}})
    job = GPTTask(exp, build_mesh({"pipeline": D}, D))
    mem = job.compile().memory_analysis()
    plan = job.pipeline.ticks
    x_bytes = 4 * 4 * exp.model.seq_len * exp.model.d_model
    return {"stash_slots": plan.stash_slots, "inbox_slots": plan.inbox_slots,
            "temp_bytes": int(mem.temp_size_in_bytes), "activation_bytes": x_bytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=2, help="sequences per microbatch (timing)")
    ap.add_argument("--json")
    args = ap.parse_args()
    ms = stage_times(args.batch)
    print(f"one stage ({STAGE_MODEL['layers']} layers, d_model {STAGE_MODEL['d_model']}, "
          f"{args.batch} x {STAGE_MODEL['seq_len']} tokens), CPU, median ms: "
          + ", ".join(f"{k} {v:.1f}" for k, v in ms.items()), file=sys.stderr)
    rows = []
    for D in (4, 8):
        for N in (D, 2 * D, 3 * D, 4 * D):
            base = None
            for name in schedules.SCHEDULES:
                v = 2 if name == "interleaved" else 1
                if name == "interleaved" and N % D:
                    continue
                s = schedules.build(name, D, N, v)
                times = dict(ms)
                if v > 1:  # a chunk is 1/v of a stage
                    times = {k: t / v for k, t in ms.items()}
                cost = lockstep_cost(s, times)
                if name == "1f1b":
                    base = cost
                rows.append({"D": D, "N": N, "schedule": name, **s.figures,
                             "lockstep_ms": cost})
            for r in rows:
                if r["D"] == D and r["N"] == N:
                    r["vs_1f1b"] = r["lockstep_ms"] / base
    memory = {}
    for D, N in ((4, 4), (4, 8)):
        for name in schedules.SCHEDULES:
            memory[f"{name} D={D} N={N}"] = compiled_memory(name, D, N,
                                                            2 if name == "interleaved" else 1)
            print(f"compiled {name} D={D} N={N}", file=sys.stderr)
    print("| D | N | schedule | bubble | ticks | lockstep ms | vs 1F1B | peak in flight per rank |")
    print("|---:|---:|---|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['D']} | {r['N']} | {r['schedule']} | {r['bubble']:.3f} | {r['ticks']} "
              f"| {r['lockstep_ms']:.0f} | {r['vs_1f1b']:.2f} | {r['peak_inflight']} |")
    print()
    print("| schedule, D, N | stash slots | inbox slots | XLA temp / device |")
    print("|---|---:|---:|---:|")
    for k, m in memory.items():
        print(f"| {k} | {m['stash_slots']} | {m['inbox_slots']} "
              f"| {m['temp_bytes'] / 2**20:.1f} MiB |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"stage_ms": ms, "rows": rows, "memory": memory}, f, indent=1,
                      default=lambda o: o.tolist() if isinstance(o, np.ndarray) else str(o))


if __name__ == "__main__":
    main()
