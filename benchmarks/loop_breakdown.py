"""Where the training loop's time goes beyond the compiled step, one piece at a time.

    python benchmarks/loop_breakdown.py [EXPERIMENT] [--mesh data=1] [--steps 200] \
        [--rounds 3] [--set KEY=VALUE ...] [--json out.json]

Each variant dispatches `--steps` steps back to back and synchronises once at
the end (what a loop that syncs only at log steps can reach), in alternating
rounds so noise hits all alike; printed: median ms/step of each and its ratio
to the step alone.

- step: the compiled step on batches made beforehand;
- batch: making the batches alone (task.batch);
- batch+step: both, in one thread;
- prefetched: batches made on a helper thread one step ahead, as the loop does;
- +guard: that plus the loop's non-finite guard (a small jitted fold per step);
- loop: plait's training loop itself (train.loop.train, no checkpoints, logging
  every log.every_steps of the experiment), its metrics.jsonl step times.

The default experiment is dlrm-bench, whose step is short enough on a GPU
(~2.5 ms) for the host's per-step work to show.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from report import run_script  # benchmarks/ is the script's directory

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("experiment", nargs="?", default=str(ROOT / "experiments/dlrm-bench.toml"))
    ap.add_argument("--mesh", default="data=1")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--json")
    a = ap.parse_args()

    import jax

    from plait import mesh as mesh_lib
    from plait.config_files import load_experiment
    from plait.tasks import make_task
    from plait.train.loop import train
    from plait.train.nonfinite import NonFiniteGuard

    exp = load_experiment(a.experiment, a.sets)
    spec = mesh_lib.load_spec(a.mesh)
    n = mesh_lib.provision_devices(spec)
    mesh = mesh_lib.build_mesh(mesh_lib.resolve(spec, n), n)
    task = make_task(exp, mesh)
    source = task.source()
    state = task.init_state()
    compiled = task.compile()
    made = [jax.block_until_ready(task.batch(source, k)) for k in range(4)]
    N = a.steps

    def timed(body) -> float:
        nonlocal state
        body(2)  # warm: every program compiled, the pools settled
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        out = body(N)
        jax.block_until_ready((state, out))
        return 1e3 * (time.perf_counter() - t0) / N

    def step_only(k):
        nonlocal state
        m = None
        for i in range(k):
            state, m = compiled(state, made[i % len(made)])
        return m

    def batch_only(k):
        return [task.batch(source, i) for i in range(k)][-1]

    def batch_step(k):
        nonlocal state
        m = None
        for i in range(k):
            state, m = compiled(state, task.batch(source, i))
        return m

    def prefetched(k, guard=None):
        nonlocal state
        m = None
        with ThreadPoolExecutor(1) as pool:
            nxt = pool.submit(task.batch, source, 0)
            for i in range(k):
                batch = nxt.result()
                nxt = pool.submit(task.batch, source, i + 1)
                state, m = compiled(state, batch)
                if guard is not None:
                    guard.after(m, i + 1)
        return m

    guard = NonFiniteGuard(mesh)

    def loop_ms() -> float:
        every = exp.log.every_steps
        run = exp.model_copy(update={
            "train": exp.train.model_copy(update={"steps": N + every}),
            "checkpoint": exp.checkpoint.model_copy(update={"enabled": False}),
            "log": exp.log.model_copy(update={"console": "none", "tensorboard": False})})
        with tempfile.TemporaryDirectory() as tmp:
            recs = train(run, mesh, Path(tmp) / "run")["records"]
        return 1e3 * statistics.median(r["step_time_s"] for r in recs
                                       if r["step"] > every and "step_time_s" in r)

    variants = {"step": lambda: timed(step_only), "batch": lambda: timed(batch_only),
                "batch+step": lambda: timed(batch_step),
                "prefetched": lambda: timed(prefetched),
                "+guard": lambda: timed(lambda k: prefetched(k, guard)), "loop": loop_ms}
    results: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(a.rounds):
        for name, fn in variants.items():
            results[name].append(fn())
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in results.items())
              + " ms/step", flush=True)
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"{exp.name} on {jax.devices()[0].device_kind} x{n}, {N} steps per variant, "
          f"medians of {a.rounds} rounds:")
    for k, v in med.items():
        print(f"  {k:<11} {v:8.3f} ms/step  {v / med['step']:6.3f}x the step")
    if a.json:
        Path(a.json).write_text(json.dumps({"experiment": exp.name, "mesh": a.mesh,
                                            "device": jax.devices()[0].device_kind,
                                            "date": time.strftime("%Y-%m-%d"), "steps": N,
                                            "rounds": results, "median_ms": med}, indent=1))
    return 0


if __name__ == "__main__":
    run_script(main)
