"""Pipeline schedules side by side: bubble, lockstep cost, compiled FLOPs and memory,
measured step time.

    python benchmarks/pipeline_schedules.py --json out.json

1. Times one pipeline stage of a GPT as the executor runs it (forward keeping
   its residuals, whole backward, and the split backward's input-gradient and
   weight-gradient halves) on one CPU device, medians of several runs.
2. For D = 4 and 8 pipeline ranks and N = D, 2D microbatches, builds every
   schedule's table and weighs each lockstep tick by its slowest action (on a
   device per rank, every rank waits for the exchange at the end of a tick):
   the lockstep cost, relative to 1F1B.
3. Compiles the pipelined train step of a 16-layer GPT for each schedule on D
   simulated devices: matmul FLOPs and XLA's temporary memory per device
   relative to 1F1B's (as `plait inspect` reads them), and the step's measured
   time, median of several runs. The D simulated devices share this machine's
   cores, so a rank's idle tick frees a core for another: the measured time
   follows the total work and the per-tick overhead, not the bubble.
4. Compiles (without running) every schedule's step of an 8-layer GPT of GPT-2 small's width
   and sequence (d_model 768, 12 heads, 1024 tokens) at D = 4, N = 8: temporary
   memory per device relative to 1F1B's where activations, not the test GPT's
   small widths, fill the stash. XLA's unfused attention on CPU keeps the
   [heads, seq, seq] probabilities; a fused kernel (cuDNN on a GPU) would not.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
from report import run_script  # benchmarks/ is the script's directory

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from plait.config import Experiment  # noqa: E402
from plait.models import build, gpt, layer_stack  # noqa: E402
from plait.parallel import schedules  # noqa: E402

STAGE_MODEL = {"layers": 2, "d_model": 512, "heads": 8, "d_ff": 2048, "vocab": 4096,
               "seq_len": 256}
STEP_MODEL = {"layers": 16, "d_model": 128, "heads": 4, "d_ff": 512, "vocab": 512,
              "seq_len": 64}
ROWS_PER_MICROBATCH = 4
WIDE_MODEL = {"layers": 8, "d_model": 768, "heads": 12, "d_ff": 3072, "vocab": 4096,
              "seq_len": 1024}


def _median_ms(fn, *args, repeats: int = 7) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def stage_times(batch: int, rounds: int = 5) -> dict:
    """Milliseconds of one stage's forward, backward, input-gradient and weight-gradient,
    each the function the executor runs (parallel.pipeline._Stage)."""
    from plait.parallel.pipeline import _Stage
    from plait.parallel.split_backward import LayerGrad

    exp = Experiment.model_validate({"model": STAGE_MODEL})
    cfg = exp.model
    stack = layer_stack(gpt.Block, cfg)
    params = build(gpt.GPT, cfg).init(0)["blocks"]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *(params[k] for k in sorted(params)))
    x = jax.random.normal(jax.random.key(0), (batch, cfg.seq_len, cfg.d_model))
    g = jax.random.normal(jax.random.key(1), x.shape)
    st = _Stage(LayerGrad(stack.layer_fn(), jax.tree.map(lambda a: a[0], stacked), x))
    lg = st.lg

    fwd = jax.jit(st.forward)
    _, stashed = fwd(stacked, x)
    res_b, res_w = st.pick(stashed, lg.res_b), st.pick(stashed, lg.res_w)
    whole = jax.jit(st.backward)
    input_grad = jax.jit(st.backward_input)
    _, frontier = input_grad(stacked, res_b, res_w, g)
    weight_grad = jax.jit(st.backward_weight)
    runs = {"F": (fwd, stacked, x), "B": (whole, stacked, stashed, g),
            "Bx": (input_grad, stacked, res_b, res_w, g),
            "W": (weight_grad, stacked, res_w, frontier)}
    # Rounds taken in turn, so a slow spell of this noisy machine hits every action.
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(rounds):
        for k, (fn, *args) in runs.items():
            times[k].append(_median_ms(fn, *args, repeats=5))
    return {k: statistics.median(v) for k, v in times.items()}


def lockstep_cost(s: schedules.Schedule, ms: dict) -> float:
    return sum(max((ms[a.kind] for a in row if a is not None), default=0.0) for row in s.table)


def _pipelined(name: str, D: int, N: int, v: int, model: dict, rows: int):
    from plait.mesh import build_mesh
    from plait.tasks.gpt import GPTTask

    exp = Experiment.model_validate({
        "model": model, "train": {"global_batch": rows * N, "steps": 10},
        "pipeline": {"schedule": name, "microbatches": N, "virtual_stages": v}})
    job = GPTTask(exp, build_mesh({"pipeline": D}, D))
    return job, job.compile()


def wide_memory(D: int = 4, N: int = 8) -> list[dict]:
    """Every schedule's temporary memory per device at WIDE_MODEL, one row a microbatch."""
    rows = []
    for name in schedules.SCHEDULES:
        job, compiled = _pipelined(name, D, N, 2 if name == "interleaved" else 1,
                                   WIDE_MODEL, 1)
        temp = compiled.memory_analysis().temp_size_in_bytes
        rows.append({"D": D, "N": N, "schedule": name, "temp_bytes": temp,
                     "stash_slots": job.pipeline.ticks.held["stash"]})
        print(f"compiled {name} at GPT-2 small's width: {temp / 2**20:.0f} MiB",
              file=sys.stderr)
    base = next(r for r in rows if r["schedule"] == "1f1b")["temp_bytes"]
    for r in rows:
        r["temp_bytes_vs_1f1b"] = r["temp_bytes"] / base
    return rows


def compiled_step(name: str, D: int, N: int, v: int, repeats: int) -> dict:
    """FLOPs, temporary memory and measured step time of the pipelined step."""
    from plait import analysis

    job, compiled = _pipelined(name, D, N, v, STEP_MODEL, ROWS_PER_MICROBATCH)
    report = analysis.analyze(compiled, dict(job.mesh.shape), job.pipeline.ticks.branch_weights())
    state, source = job.init_state(), job.source()
    batch = job.batch(source, 0)

    def step(state):
        return compiled(state, batch)[0]

    state = jax.block_until_ready(step(state))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        state = jax.block_until_ready(step(state))
        times.append((time.perf_counter() - t0) * 1e3)
    held = job.pipeline.ticks.held
    return {"flops": report["flops_per_device"], "temp_bytes": report["memory"]["temp_bytes"],
            "step_ms": statistics.median(times), "stash_slots": held["stash"],
            "keep_slots": held["keep"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=2, help="sequences per microbatch (timing)")
    ap.add_argument("--repeats", type=int, default=5, help="timed steps per compiled program")
    ap.add_argument("--no-compile", action="store_true",
                    help="only the stage times and the lockstep costs (no compiled steps)")
    ap.add_argument("--wide-only", action="store_true",
                    help="only part 4, the memory at GPT-2 small's width (about 30 s)")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.wide_only:
        ms, rows, wide = {}, [], wide_memory()
        _report_wide(wide)
        _dump(args.json, ms, rows, wide)
        return
    ms = stage_times(args.batch)
    print(f"one stage ({STAGE_MODEL['layers']} layers, d_model {STAGE_MODEL['d_model']}, "
          f"{args.batch} x {STAGE_MODEL['seq_len']} tokens), CPU, median ms: "
          + ", ".join(f"{k} {v:.1f}" for k, v in ms.items()), file=sys.stderr)
    rows = []
    for D in (4, 8):
        for N in (D, 2 * D):
            group = []
            for name in schedules.SCHEDULES:
                v = 2 if name == "interleaved" else 1
                s = schedules.build(name, D, N, v)
                times = dict(ms)
                if v > 1:  # a chunk is 1/v of a stage
                    times = {k: t / v for k, t in ms.items()}
                step = {"flops": 1.0, "temp_bytes": 1.0, "step_ms": 1.0}
                if not args.no_compile:
                    step = compiled_step(name, D, N, v, args.repeats)
                    print(f"compiled and timed {name} D={D} N={N}: {step['step_ms']:.0f} ms",
                          file=sys.stderr)
                group.append({"D": D, "N": N, "schedule": name, **s.figures,
                              "lockstep_ms": lockstep_cost(s, times), **step})
            base = next(r for r in group if r["schedule"] == "1f1b")
            for r in group:
                for k in ("lockstep_ms", "flops", "temp_bytes", "step_ms"):
                    r[f"{k}_vs_1f1b"] = r[k] / base[k]
            rows += group
    print("| D | N | schedule | bubble | ticks | peak in flight per rank | lockstep vs 1F1B "
          "| FLOPs vs 1F1B | temp memory vs 1F1B | measured step ms (vs 1F1B) |")
    print("|---:|---:|---|---:|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['D']} | {r['N']} | {r['schedule']} | {r['bubble']:.3f} | {r['ticks']} "
              f"| {r['peak_inflight']} | {r['lockstep_ms_vs_1f1b']:.2f} "
              f"| {r['flops_vs_1f1b']:.3f} | {r['temp_bytes_vs_1f1b']:.2f} "
              f"| {r['step_ms']:.0f} ({r['step_ms_vs_1f1b']:.2f}) |")
    wide = [] if args.no_compile else wide_memory()
    _report_wide(wide)
    _dump(args.json, ms, rows, wide)


def _report_wide(wide: list[dict]) -> None:
    if not wide:
        return
    m = WIDE_MODEL
    print(f"\n{m['layers']} layers, d_model {m['d_model']}, {m['seq_len']} tokens, "
          "1 row a microbatch, D = 4, N = 8 (compiled, not run):\n")
    print("| schedule | peak in flight per rank | temp memory MiB | vs 1F1B |")
    print("|---|---|---:|---:|")
    for r in wide:
        print(f"| {r['schedule']} | {list(r['stash_slots'])} "
              f"| {r['temp_bytes'] / 2**20:.0f} | {r['temp_bytes_vs_1f1b']:.2f} |")


def _dump(path: str | None, ms: dict, rows: list, wide: list) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"stage_ms": ms, "rows": rows, "wide": wide}, f, indent=1,
                      default=lambda o: o.tolist() if isinstance(o, np.ndarray) else str(o))


if __name__ == "__main__":
    run_script(main)
