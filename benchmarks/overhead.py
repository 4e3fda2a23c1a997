"""plait's train step against a minimal hand-written JAX train step of the same model.

Same shapes, same batch, same optimizer (AdamW + clipping from optax), one
device. Two baselines:

- `hand`: the model written again in plain jax.numpy, in a bare jit step;
- `bare`: a bare jit step (value_and_grad + optax) around plait's own model
  code, which isolates what plait's step machinery costs (NNX rebuild from the
  parameter dict, sharding pins, accumulation, metrics) from how XLA happens to
  compile two different model codes.
 The two are timed in alternating rounds inside one process, so machine
noise hits both alike; each round runs `--steps` steps and blocks at the end.
Reported: the median per-step time of each, and their ratio, plus plait's whole
loop (data generation, metrics, no checkpoints) for the host-side overhead.

    python benchmarks/overhead.py                       # default CPU-sized model
    python benchmarks/overhead.py experiments/gpt2-124m.toml --set train.global_batch=8
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from report import report, run_script  # benchmarks/ is the script's directory

DEFAULT_SETS = [
    "model.layers=4", "model.d_model=256", "model.heads=8", "model.d_ff=1024",
    "model.vocab=4096", "model.seq_len=256", "train.global_batch=8", "train.microbatches=1",
    "precision.compute='float32'",
]


# --------------------------- the hand-written baseline ---------------------------

def hand_init(cfg, key):
    d, f, v, h = cfg.d_model, cfg.d_ff, cfg.padded_vocab, cfg.heads
    keys = iter(jax.random.split(key, 4 + 4 * cfg.layers))
    n = lambda shape, std=0.02: std * jax.random.normal(next(keys), shape, jnp.float32)
    layers = []
    for _ in range(cfg.layers):
        layers.append({
            "ln1": (jnp.ones(d), jnp.zeros(d)), "ln2": (jnp.ones(d), jnp.zeros(d)),
            "wqkv": n((d, 3, h, d // h)), "bqkv": jnp.zeros((3, h, d // h)),
            "wo": n((h, d // h, d)), "bo": jnp.zeros(d),
            "w1": n((d, f)), "b1": jnp.zeros(f), "w2": n((f, d)), "b2": jnp.zeros(d),
        })
    return {"emb": n((v, d)), "pos": n((cfg.seq_len, d), 0.01), "layers": layers,
            "lnf": (jnp.ones(d), jnp.zeros(d))}


def _ln(x, p, eps):
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * p[0] + p[1]


def hand_loss(params, tokens, cfg, gather_loss=False):
    inp, tgt = tokens[:, :-1], tokens[:, 1:]
    x = params["emb"][inp] + params["pos"][: inp.shape[1]]
    for p in params["layers"]:
        y = _ln(x, p["ln1"], cfg.norm_eps)
        q, k, v = jnp.einsum("bsd,dthk->tbshk", y, p["wqkv"]) + p["bqkv"][:, None, None]
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        x = x + jnp.einsum("bshk,hkd->bsd", o, p["wo"]) + p["bo"]
        y = _ln(x, p["ln2"], cfg.norm_eps)
        y = jax.nn.gelu(y @ p["w1"] + p["b1"], approximate=True)
        x = x + y @ p["w2"] + p["b2"]
    logits = _ln(x, params["lnf"], cfg.norm_eps) @ params["emb"].T
    if gather_loss:  # the textbook form: its backward is a scatter
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(logp, tgt[..., None], axis=-1).mean()
    # the same arithmetic as plait's loss, so the comparison measures the framework
    label = jnp.sum(jnp.where(jnp.arange(logits.shape[-1]) == tgt[..., None], logits, 0.0), -1)
    return (jax.nn.logsumexp(logits, axis=-1) - label).mean()


def hand_step_fn(cfg, tx, gather_loss=False):
    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(hand_loss)(params, tokens, cfg, gather_loss)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


# ------------------------------------- timing -------------------------------------

def time_rounds(run_round, rounds: int) -> list[float]:
    return [run_round() for _ in range(rounds)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("experiment", nargs="?", default="experiments/quickstart.toml")
    ap.add_argument("--set", dest="sets", action="append", default=None)
    ap.add_argument("--steps", type=int, default=5, help="steps per timed round")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("--hand-first", action="store_true",
                    help="time the hand-written step first in each round pair")
    ap.add_argument("--gather-loss", action="store_true",
                    help="baseline uses log_softmax + take_along_axis instead of plait's form")
    args = ap.parse_args()

    from plait import mesh as mesh_lib
    from plait.config_files import load_experiment
    from plait.models import gpt_counts
    from plait.tasks.gpt import GPTTask as Job
    from plait.train.loop import train
    from plait.train.state import optimizer

    sets = DEFAULT_SETS if args.sets is None and args.experiment.endswith("quickstart.toml") \
        else (args.sets or [])
    exp = load_experiment(args.experiment, [*sets, "checkpoint.enabled=false",
                                            "log.console='none'", "log.tensorboard=false"])
    spec = mesh_lib.MeshSpec({"data": 1}, "benchmark")
    n = mesh_lib.provision_devices(spec)
    mesh = mesh_lib.build_mesh(mesh_lib.resolve(spec, n), n)
    job = Job(exp, mesh)
    cfg = exp.model
    from plait import data

    batch = data.global_batch(job.source(), 0, job.batch_shape, job.batch_sharding)
    tokens = jnp.asarray(np.asarray(batch)[0])

    # plait
    plait_step = job.compile()
    state = job.init_state()
    # hand-written: same optimizer definition
    tx, _ = optimizer(exp)
    hparams = hand_init(cfg, jax.random.key(0))
    hopt = tx.init(hparams)
    hstep = hand_step_fn(cfg, tx, args.gather_loss)

    from plait.models.loss import cross_entropy

    def bare_step(params, opt_state, toks):
        loss_fn = lambda p: cross_entropy(job.model.apply(p, toks[:, :-1]), toks[:, 1:])
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    bstep = jax.jit(bare_step, donate_argnums=(0, 1))
    bparams = jax.tree.map(jnp.array, job.init_state()["params"])
    bopt = tx.init(bparams)

    carried = {"plait": state, "hand": (hparams, hopt), "bare": (bparams, bopt)}

    def plait_advance():
        carried["plait"], m = plait_step(carried["plait"], batch)
        return m["loss"]

    def pair_advance(name, step):
        def advance():
            params, opt_state, loss = step(*carried[name], tokens)
            carried[name] = (params, opt_state)
            return loss
        return advance

    def round_of(advance):
        """Seconds per step over `args.steps` steps, device work included."""
        def run():
            t0 = time.perf_counter()
            for _ in range(args.steps):
                last = advance()
            jax.block_until_ready(last)
            return (time.perf_counter() - t0) / args.steps
        return run

    plait_round = round_of(plait_advance)
    hand_round = round_of(pair_advance("hand", hstep))
    bare_round = round_of(pair_advance("bare", bstep))

    order = [("hand", hand_round), ("bare", bare_round), ("plait", plait_round)]
    if not args.hand_first:
        order.reverse()
    times: dict[str, list[float]] = {name: [] for name, _ in order}
    for _, fn in order:  # warm up: compile, and recompile once inputs come back committed
        fn()
        fn()
    for _ in range(args.rounds):
        for name, fn in order:
            times[name].append(fn())
    p_times, h_times, b_times = times["plait"], times["hand"], times["bare"]
    p_med, h_med = statistics.median(p_times), statistics.median(h_times)
    b_med = statistics.median(b_times)
    ratios = [p / h for p, h in zip(p_times, h_times, strict=True)]
    bare_ratios = [p / b for p, b in zip(p_times, b_times, strict=True)]

    # plait's whole loop: data generation in a background thread, metrics every step.
    loop_steps = args.steps * 3
    with tempfile.TemporaryDirectory() as tmp:
        loop_exp = exp.model_copy(update={
            "train": exp.train.model_copy(update={"steps": loop_steps}),
            "log": exp.log.model_copy(update={"every_steps": 1})})
        summary = train(loop_exp, mesh, Path(tmp))
    loop_med = summary["median_step_time_s"]

    tokens_per_step = job.tokens_per_step
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {jax.devices()[0].device_kind}, "
                   f"{jax.devices()[0].platform}, jax {jax.__version__}",
        "model": {k: getattr(cfg, k) for k in ("layers", "d_model", "heads", "d_ff", "vocab",
                                               "seq_len")},
        "batch": exp.train.global_batch, "precision": exp.precision.compute,
        "baseline_loss": "gather" if args.gather_loss else "same as plait",
        "rounds": args.rounds, "steps_per_round": args.steps,
        "plait_step_ms": 1e3 * p_med, "hand_step_ms": 1e3 * h_med,
        "overhead_pct": 100 * (p_med / h_med - 1),
        "overhead_pct_median_of_paired_rounds": 100 * (statistics.median(ratios) - 1),
        "bare_step_ms": 1e3 * b_med,
        "overhead_vs_bare_pct": 100 * (p_med / b_med - 1),
        "overhead_vs_bare_pct_median_of_paired_rounds":
            100 * (statistics.median(bare_ratios) - 1),
        "plait_loop_step_ms": 1e3 * loop_med if loop_med else None,
        "model_gflops_per_step": gpt_counts.flops_per_token(cfg) * tokens_per_step / 1e9,
        "plait_rounds_ms": [1e3 * t for t in p_times],
        "hand_rounds_ms": [1e3 * t for t in h_times],
        "bare_rounds_ms": [1e3 * t for t in b_times],
    }
    report(result, args.json)
    print(f"\nplait step {result['plait_step_ms']:.1f} ms | "
          f"hand-written {result['hand_step_ms']:.1f} ms"
          f" | overhead {result['overhead_pct']:+.2f}% (paired rounds: "
          f"{result['overhead_pct_median_of_paired_rounds']:+.2f}%) | bare step around "
          f"plait's model {result['bare_step_ms']:.1f} ms, overhead "
          f"{result['overhead_vs_bare_pct_median_of_paired_rounds']:+.2f}% | plait loop "
          f"{result['plait_loop_step_ms']:.1f} ms | "
          f"{result['model_gflops_per_step'] / (p_med):.1f} model GFLOP/s", file=sys.stderr)
    if not math.isfinite(result["overhead_pct"]):
        return 1
    return 0


if __name__ == "__main__":
    run_script(main)
