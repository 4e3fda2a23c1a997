"""Forward + backward time of dropless's grouped products alone, beside dense ones of
the same FLOPs: where an MoE step's time over its dense twin's goes.

This times one grouped product (or, with --mlp, one grouped SwiGLU MLP, what an MoE
layer runs) and its gradients, not a training step: it says which part of
`benchmarks/moe_vs_dense.py`'s gap is the experts' arithmetic (and, with routing
exactly balanced, what the scatters and the loop cost when no row overflows).
Variants, alternating for `--rounds` in one process, each the median of `--repeat`
jitted forward + backward calls:

  dense           every row through expert 0: the routed rows' FLOPs, one product/MLP
  batched         [G, M/G, K] through every expert: a perfectly balanced grouped one
  tiles-bB-sS     parallel.grouped with model.moe.bulk = B and spill = S (both 0: the
                  loop alone; b1-s1.25 is plait's default)
  ragged_dot      jax.lax.ragged_dot's grouped matmuls (the backend's own)

Routing: group sizes proportional to exp(skew x z), z standard normal (seed 0);
--skew 0 is exactly balanced. Shapes default to mixtral-mini's (8 x 2048 tokens, 2
experts each, d_model 1024; one product: the gate/up one, 1024 -> 2 x 3584; --mlp:
d_ff 3584).

    python benchmarks/grouped_matmul.py [--skew 0.3] [--mlp] [--rows 32768 --k 1024 --n 7168]
"""

from __future__ import annotations

import argparse
import statistics
import time

from report import median_seconds, report, run_script  # benchmarks/ is the script's directory


def group_sizes(rows: int, groups: int, skew: float):
    """Sizes summing to `rows`, proportional to exp(skew x z)."""
    import numpy as np

    share = np.exp(skew * np.random.default_rng(0).standard_normal(groups))
    sizes = np.floor(rows * share / share.sum()).astype(np.int32)
    sizes[np.argmax(sizes)] += rows - sizes.sum()
    return sizes


SPLITS = [(0.0, 0.0), (1.0, 0.0), (1.0, 0.25), (1.0, 1.25), (0.0, 1.25)]


def split(text: str) -> tuple[float, float]:
    """--split BULK:SPILL."""
    try:
        bulk, spill = (float(v) for v in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}': give BULK:SPILL, e.g. 1:0.125") from None
    return bulk, spill


def variants(sizes, splits: list[tuple[float, float]], mlp: bool) -> dict:
    """name -> f(x, w) -> [M, N] for every variant; w: {"w": [G, K, N]}, or with `mlp`
    SwiGLU's {"w13": [G, K, 2, F], "w2": [G, F, K]}."""
    from plait.parallel.grouped import expert_mlp, grouped_mlp, ragged_mlp

    act = "swiglu" if mlp else None

    def batched(x, w):
        G = next(iter(w.values())).shape[0]
        return expert_mlp(w, x.reshape(G, -1, x.shape[1]), act).reshape(x.shape[0], -1)

    def ragged(x, w):
        return ragged_mlp(x, w, sizes, act)

    M = int(sizes.sum())
    out = {"dense": lambda x, w: expert_mlp({k: v[:1] for k, v in w.items()}, x[None],
                                            act)[0],
           "batched": batched}
    for b, s in splits:
        out[f"tiles-b{b:g}-s{s:g}"] = lambda x, w, b=b, s=s: grouped_mlp(x, w, sizes, act,
                                                                          M, b, s)
    out["ragged_dot"] = ragged
    return out


def timed(f, x, w, dy, repeat: int) -> float:
    """Median seconds of one jitted forward + backward of f."""
    import jax

    step = jax.jit(lambda x, w: jax.vjp(f, x, w)[1](dy))
    return median_seconds(lambda: step(x, w), repeat)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32768)
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--n", type=int, help="outputs of the product (default 7168), or with "
                    "--mlp the experts' hidden size (default 3584)")
    ap.add_argument("--mlp", action="store_true", help="a grouped SwiGLU MLP, not one product")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--skew", type=float, default=0.3)
    ap.add_argument("--split", type=split, action="append", metavar="BULK:SPILL",
                    help="model.moe.bulk and spill of a tiles variant (default: 0:0, 1:0, "
                         "1:0.25, 1:1.25, 0:1.25)")
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
    n = args.n or (3584 if args.mlp else 7168)
    keys = jax.random.split(jax.random.key(0), 4)
    dt = jnp.dtype(args.dtype)
    G, K = args.groups, args.k

    def normal(key, shape, fan_in):
        return (jax.random.normal(key, shape) / fan_in ** 0.5).astype(dt)

    x = normal(keys[0], (args.rows, K), 1)
    if args.mlp:
        w = {"w13": normal(keys[1], (G, K, 2, n), K), "w2": normal(keys[3], (G, n, K), n)}
        out, flops = K, 18 * args.rows * K * n
    else:
        w = {"w": normal(keys[1], (G, K, n), K)}
        out, flops = n, 6 * args.rows * K * n
    dy = normal(keys[2], (args.rows, out), 1)
    fs = variants(jnp.asarray(sizes), args.split or SPLITS, args.mlp)
    want = jax.jit(fs["ragged_dot"])(x, w).astype(jnp.float32)
    error = {k: float(jnp.linalg.norm(jax.jit(f)(x, w).astype(jnp.float32) - want)
                      / jnp.linalg.norm(want)) for k, f in fs.items() if k.startswith("tiles")}
    rounds = []
    for i in range(args.rounds):
        rounds.append({name: timed(f, x, w, dy, args.repeat) for name, f in fs.items()})
        print(f"round {i + 1}: " + ", ".join(f"{k} {v * 1e3:.2f} ms"
                                              for k, v in rounds[-1].items()), flush=True)
    ms = {k: statistics.median(r[k] for r in rounds) * 1e3 for k in fs}
    what = "one grouped SwiGLU MLP" if args.mlp else "one grouped product"
    report({"date": time.strftime("%Y-%m-%d"), "device": jax.devices()[0].device_kind,
            "jax": jax.__version__, "what": what + ", forward + backward",
            "rows": args.rows, "k": K, "n": n, "groups": G,
            "dtype": args.dtype, "skew": args.skew, "sizes": sizes.tolist(),
            "largest_over_mean": float(sizes.max() * args.groups / args.rows),
            "relative_error_vs_ragged_dot": error, "median_ms": ms,
            "over_dense": {k: v / ms["dense"] for k, v in ms.items()},
            "tflops_per_s": {k: flops / (v * 1e-3) / 1e12 for k, v in ms.items()},
            "rounds": rounds}, args.json)
    return 0


if __name__ == "__main__":
    run_script(main)
