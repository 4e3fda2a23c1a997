"""Block sizes for `model.moe.grouped = "pallas"`'s kernels, chosen by timing them on a
Hopper GPU at an MoE's shapes (parallel.grouped_pallas.BLOCKS).

Each candidate tiling of the grouped product (`ragged`: the forward's two products and
the backward's products by transposed weights, four calls a layer) and of its transpose
(`transposed`: the weights' two gradients) is timed on every call of one expert MLP's
forward and backward at once, with the rows skewed over the groups as a router skews
them (sizes proportional to exp(skew x z)); the median of `--repeat` calls. A tiling
the GPU's shared memory cannot hold is reported and skipped; every other one's results
are compared with `jax.lax.ragged_dot`'s (`grouped_pallas.reference_kernels`), and then
the expert MLP's values and gradients on the best tiling with the same VJP on the
reference products (a relative error over 2% fails the script). The best of each kind is
printed as the BLOCKS to use and written with --json; `moe_vs_dense.py --pallas-blocks`
reads that file. Shapes default to mixtral-mini's (8 x 2048 tokens, 2 experts each,
d_model 1024, d_ff 3584, 8 experts).

    python benchmarks/pallas_blocks.py [--rows 32768 --k 1024 --f 3584 --groups 8] [--json F]
"""

from __future__ import annotations

import argparse
import sys
import time

from grouped_matmul import group_sizes
from report import median_seconds, report, run_script  # benchmarks/ is the script's directory

# (block_m, block_n, block_k, max_concurrent_steps, grid_block_n)
RAGGED = [(128, 128, 64, 4, 1), (128, 128, 64, 4, 4), (128, 128, 64, 2, 1),
          (128, 128, 64, 6, 1), (64, 128, 64, 4, 1), (128, 64, 64, 4, 1),
          (192, 128, 64, 4, 1), (64, 64, 64, 4, 1)]
TRANSPOSED = [(128, 128, 64, 4, 1), (128, 128, 64, 4, 4), (128, 128, 64, 2, 1),
              (128, 128, 128, 2, 1), (64, 128, 64, 4, 1), (128, 64, 64, 4, 1),
              (64, 64, 128, 4, 1), (128, 128, 64, 1, 1)]
TOLERANCE = 2e-2  # relative, bf16 products accumulated in float32 both ways
NAMES = ("block_m", "block_n", "block_k", "max_concurrent_steps", "grid_block_n")


def relative_error(a, b) -> float:
    import numpy as np

    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def mlp_check(sizes, M: int, K: int, F: int, G: int) -> dict[str, float]:
    """The expert MLP's output and gradients on the kernels (as BLOCKS tiles them)
    against the same VJP on the reference products: relative errors, bf16."""
    import jax
    import jax.numpy as jnp

    from plait.parallel import grouped_pallas as gp

    keys = jax.random.split(jax.random.key(1), 4)
    x = jax.random.normal(keys[0], (M, K), jnp.bfloat16)
    w = {"w13": (jax.random.normal(keys[1], (G, K, 2, F)) / K ** 0.5).astype(jnp.bfloat16),
         "w2": (jax.random.normal(keys[2], (G, F, K)) / F ** 0.5).astype(jnp.bfloat16)}

    def on(kernels: gp.Kernels) -> dict:
        """The MLP's output and gradients traced with `kernels` in KERNELS' place (a
        function of its own each time: jax.jit would reuse an earlier trace of the same
        function, kernels and all)."""
        def grads(x, w):
            def loss(x, w):
                y = gp.pallas_mlp(x, w, sizes, "swiglu")
                return jnp.sum(jnp.sin(y.astype(jnp.float32))), y
            (_, y), (dx, dw) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, w)
            return {"y": y, "dx": dx, "dw13": dw["w13"], "dw2": dw["w2"]}

        saved, gp.KERNELS = gp.KERNELS, kernels
        try:
            return jax.jit(grads)(x, w)
        finally:
            gp.KERNELS = saved

    got, want = on(gp.KERNELS), on(gp.reference_kernels())
    return {k: relative_error(got[k], want[k]) for k in got}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32768)
    ap.add_argument("--k", type=int, default=1024, help="the model's width (d_model)")
    ap.add_argument("--f", type=int, default=3584, help="the experts' hidden size")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--skew", type=float, default=0.3)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--json", help="write the result here too")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    from plait.errors import UserError
    from plait.parallel import grouped_pallas as gp
    from plait.tasks.gpt_runtime import on_hopper

    if not on_hopper(jax.devices()[0]):
        raise UserError(f"the kernels run on a Hopper GPU, not {jax.devices()[0].device_kind}")
    sizes = jnp.asarray(group_sizes(args.rows, args.groups, args.skew))
    M, K, F, G = args.rows, args.k, args.f, args.groups
    keys = jax.random.split(jax.random.key(0), 6)

    def normal(key, shape):
        return (jax.random.normal(key, shape) / shape[-2 if len(shape) > 2 else -1] ** 0.5
                ).astype(jnp.bfloat16)

    x, dy = normal(keys[0], (M, K)), normal(keys[1], (M, K))
    pre, dpre = normal(keys[2], (M, 2 * F)), normal(keys[3], (M, 2 * F))
    h = normal(keys[4], (M, F))
    up, w2 = normal(keys[5], (G, K, 2 * F)), normal(keys[5], (G, F, K))
    def calls(k: gp.Kernels) -> dict:
        """Every call of one expert MLP's forward and backward, by kernel, on kernels k
        (the Hopper ones read BLOCKS when traced)."""
        return {
            # the forward's two products and the backward's two by transposed weights
            "ragged": lambda: (k.ragged(x, up, sizes), k.ragged(h, w2, sizes),
                               k.ragged(dy, w2, sizes, transpose_rhs=True),
                               k.ragged(dpre, up, sizes, transpose_rhs=True)),
            # the weights' two gradients
            "transposed": lambda: (k.transposed(h, dy, sizes), k.transposed(x, pre, sizes)),
        }

    flops = {"ragged": 2 * M * (K * 2 * F + F * K + K * F + 2 * F * K),
             "transposed": 2 * M * (F * K + K * 2 * F)}
    result = {"date": time.strftime("%Y-%m-%d"), "device": jax.devices()[0].device_kind,
              "jax": jax.__version__, "rows": M, "k": K, "f": F, "groups": G,
              "skew": args.skew, "sizes": [int(s) for s in sizes], "kinds": {}}
    print(f"{len(RAGGED)} + {len(TRANSPOSED)} tilings at {M} rows, {K} -> 2 x {F} -> {K}, "
          f"{G} groups {result['sizes']}", flush=True)
    best = {}
    for kind, candidates in (("ragged", RAGGED), ("transposed", TRANSPOSED)):
        rows, outputs = [], []  # outputs: (a timed row, its results)
        for c in candidates:
            blocks = dict(zip(NAMES, c, strict=True))
            gp.BLOCKS[kind] = blocks
            t0 = time.perf_counter()
            try:
                f = jax.jit(calls(gp.KERNELS)[kind]).lower().compile()
                compile_s = time.perf_counter() - t0
                out = f()
                ms = median_seconds(f, args.repeat) * 1e3
            except Exception as e:  # a tiling the shared memory cannot hold, or refused
                print(f"{kind} {c}: {type(e).__name__}: {str(e).splitlines()[0][:160]}",
                      flush=True)
                rows.append({"blocks": blocks, "failed": str(e).splitlines()[0][:300]})
                continue
            print(f"{kind} {c}: {ms:.3f} ms, {flops[kind] / ms / 1e9:.0f} TFLOP/s (compiled "
                  f"in {compile_s:.1f} s)", flush=True)
            rows.append({"blocks": blocks, "ms": ms, "tflops_per_s": flops[kind] / ms / 1e9,
                         "compile_s": compile_s})
            outputs.append((rows[-1], out))
        # then every tiling's results against the reference products (after the timing:
        # a slow reference costs no tiling its time)
        print(f"{kind}: the reference products (jax.lax.ragged_dot) ...", flush=True)
        t0 = time.perf_counter()
        reference = jax.jit(calls(gp.reference_kernels())[kind])()
        print(f"{kind}: reference in {time.perf_counter() - t0:.1f} s", flush=True)
        for row, out in outputs:
            row["relative_error"] = max(relative_error(a, b) for a, b in
                                        zip(out, reference, strict=True))
            print(f"{kind} {tuple(row['blocks'].values())}: relative error "
                  f"{row['relative_error']:.1e}", flush=True)
        del outputs, reference
        timed_rows = [r for r in rows if "ms" in r and r["relative_error"] < TOLERANCE]
        if timed_rows:
            best[kind] = min(timed_rows, key=lambda r: r["ms"])["blocks"]
        result["kinds"][kind] = rows
    result["best"] = best
    gp.BLOCKS.update(best)
    result["mlp_relative_error"] = mlp_check(sizes, M, K, F, G)
    report(result, args.json)
    worst = max(result["mlp_relative_error"].values())
    if len(best) < 2 or worst > TOLERANCE:
        print(f"pallas_blocks.py: the kernels' results are off (MLP {worst:.1e}) or no "
              "tiling ran", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    run_script(main)
