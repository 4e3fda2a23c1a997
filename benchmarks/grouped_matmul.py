"""Forward + backward time of dropless's grouped matmuls alone, beside a dense product of
the same FLOPs: where an MoE step's time over its dense twin's goes.

This times one grouped product and its gradients, not a training step: it says which
part of `benchmarks/moe_vs_dense.py`'s gap is the grouped matmul (and, with routing
exactly balanced, what the tiles' scatters and the loop cost when no row overflows).
Variants, alternating for `--rounds` in one process, each the median of `--repeat`
jitted calls of value-and-grad:

  dense           x [M, K] @ w [K, N]: the FLOPs of the routed rows, one product
  batched         [G, M/G, K] x [G, K, N]: a perfectly balanced grouped product
  tiles-bulkB     parallel.grouped.tiles with model.moe.bulk = B (0: the loop alone)
  ragged_dot      jax.lax.ragged_dot (the backend's own)

Routing: group sizes proportional to exp(skew x z), z standard normal (seed 0);
--skew 0 is exactly balanced. Shapes default to mixtral-mini's gate/up product (8 x 2048
tokens, 2 experts each, d_model 1024, 2 x 3584).

    python benchmarks/grouped_matmul.py [--skew 0.3] [--rows 32768 --k 1024 --n 7168]
"""

from __future__ import annotations

import argparse
import statistics
import time

from report import report, run_script  # benchmarks/ is the script's directory


def group_sizes(rows: int, groups: int, skew: float):
    """Sizes summing to `rows`, proportional to exp(skew x z)."""
    import numpy as np

    share = np.exp(skew * np.random.default_rng(0).standard_normal(groups))
    sizes = np.floor(rows * share / share.sum()).astype(np.int32)
    sizes[np.argmax(sizes)] += rows - sizes.sum()
    return sizes


def variants(x, w, sizes, bulks: list[float]) -> dict:
    """name -> f(x, w) -> [M, N] for every variant."""
    import jax
    import jax.numpy as jnp

    from plait.parallel.grouped import grouped_matmul

    G, K, N = w.shape
    M = x.shape[0]
    out = {"dense": lambda x, w: x @ w[0],
           "batched": lambda x, w: jnp.einsum("gck,gkn->gcn", x.reshape(G, M // G, K),
                                               w).reshape(M, N)}
    for b in bulks:
        out[f"tiles-bulk{b:g}"] = (
            lambda x, w, b=b: grouped_matmul(x, w, sizes, "tiles", M, b))
    out["ragged_dot"] = lambda x, w: jax.lax.ragged_dot(x, w, sizes)
    return out


def timed(f, x, w, dy, repeat: int) -> float:
    """Median seconds of one jitted forward + backward of f."""
    import jax

    step = jax.jit(lambda x, w: jax.vjp(f, x, w)[1](dy))
    jax.block_until_ready(step(x, w))
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        jax.block_until_ready(step(x, w))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32768)
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--n", type=int, default=7168)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--skew", type=float, default=0.3)
    ap.add_argument("--bulk", type=float, action="append", help="default: 0, 1, 1.25")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", help="write the result here too")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    from plait.errors import UserError

    if args.rows % args.groups:
        raise UserError(f"--rows {args.rows} must be a multiple of --groups {args.groups}")
    sizes = group_sizes(args.rows, args.groups, args.skew)
    keys = jax.random.split(jax.random.key(0), 3)
    dt = jnp.dtype(args.dtype)
    x = jax.random.normal(keys[0], (args.rows, args.k), dt)
    w = (jax.random.normal(keys[1], (args.groups, args.k, args.n)) / args.k ** 0.5).astype(dt)
    dy = jax.random.normal(keys[2], (args.rows, args.n), dt)
    fs = variants(x, w, jnp.asarray(sizes), args.bulk or [0.0, 1.0, 1.25])
    want = jax.jit(fs["ragged_dot"])(x, w).astype(jnp.float32)
    error = {k: float(jnp.linalg.norm(jax.jit(f)(x, w).astype(jnp.float32) - want)
                      / jnp.linalg.norm(want)) for k, f in fs.items() if k.startswith("tiles")}
    rounds = []
    for i in range(args.rounds):
        rounds.append({name: timed(f, x, w, dy, args.repeat) for name, f in fs.items()})
        print(f"round {i + 1}: " + ", ".join(f"{k} {v * 1e3:.2f} ms"
                                              for k, v in rounds[-1].items()), flush=True)
    ms = {k: statistics.median(r[k] for r in rounds) * 1e3 for k in fs}
    flops = 6 * args.rows * args.k * args.n
    report({"date": time.strftime("%Y-%m-%d"), "device": jax.devices()[0].device_kind,
            "jax": jax.__version__, "what": "one grouped product, forward + backward",
            "rows": args.rows, "k": args.k, "n": args.n, "groups": args.groups,
            "dtype": args.dtype, "skew": args.skew, "sizes": sizes.tolist(),
            "largest_over_mean": float(sizes.max() * args.groups / args.rows),
            "relative_error_vs_ragged_dot": error, "median_ms": ms,
            "over_dense": {k: v / ms["dense"] for k, v in ms.items()},
            "tflops_per_s": {k: flops / (v * 1e-3) / 1e12 for k, v in ms.items()},
            "rounds": rounds}, args.json)
    return 0


if __name__ == "__main__":
    run_script(main)
