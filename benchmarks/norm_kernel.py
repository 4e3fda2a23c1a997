"""A LayerNorm after a residual add on a GPU: `model.norm_kernel = "pallas"`'s Triton
kernels (parallel.norm_kernel: s = x + h + bias and LN(s) forward, the gradient of both
backward) in a few launch settings against XLA's form (models.norms), at gpt2-124m's
stream ([32 x 1024, 768] bf16) or another shape. The median over `--repeat` samples of
`--calls` calls each, issued back to back (a call takes ~0.2 ms), the bytes moved per
second, and each setting's largest difference from XLA's values; the best setting is
printed as the one to use (ROWS, NUM_WARPS, PROGRAMS). Times the norms alone: the
step's own figure is `throughput.py --set model.norm_kernel=...` (gpu_figures.sh's
kernels stage).

    python benchmarks/norm_kernel.py [--rows 32768 --width 768] [--calls 10] [--json F]
"""

from __future__ import annotations

import argparse
import time

# benchmarks/ is the script's directory
from report import best_setting, failed_setting, median_seconds, nvidia_gpu, report, run_script

# (ROWS, NUM_WARPS, PROGRAMS)
SETTINGS = [(4, 4, 528), (1, 4, 528), (2, 4, 528), (8, 8, 528), (4, 8, 528),
            (4, 4, 264), (4, 4, 1056), (2, 2, 1056)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32768)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--calls", type=int, default=10, help="calls a timed sample")
    ap.add_argument("--json", help="write the result here too")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from plait.models.norms import _KEEP_STATS, _layer_norm
    from plait.parallel import norm_kernel

    device = nvidia_gpu("the kernels run")
    k = jax.random.split(jax.random.key(0), 6)
    shape, n = (args.rows, args.width), args.width
    x, h, dy, ds = (jax.random.normal(k[i], shape).astype(jnp.bfloat16) for i in range(4))
    hb, b = (0.1 * jax.random.normal(k[i], (n,)) for i in (4, 5))
    w = jnp.ones((n,))
    stream = args.rows * n * 2 / 1e9  # GB of one bf16 array of the stream
    eps = 1e-5

    def xla_norm(x, h, hb, w, b):
        s = x + h + hb.astype(x.dtype)
        return s, jax.checkpoint(_layer_norm, policy=_KEEP_STATS, static_argnums=(3,))(
            s, w, b, eps)

    xla_fwd = jax.jit(xla_norm)
    xla_bwd = jax.jit(lambda *a: jax.vjp(xla_norm, *a)[1]((ds, dy)))
    s_want, y_want = (np.float32(a) for a in xla_fwd(x, h, hb, w, b))
    d_want = np.float32(xla_bwd(x, h, hb, w, b)[0])
    result = {"date": time.strftime("%Y-%m-%d"), "device": device.device_kind,
              "rows": args.rows, "width": n, "stream_gb": stream, "repeat": args.repeat,
              "calls": args.calls}
    fwd = median_seconds(lambda: xla_fwd(x, h, hb, w, b), args.repeat, calls=args.calls)
    both = median_seconds(lambda: xla_bwd(x, h, hb, w, b), args.repeat, calls=args.calls)
    result["xla"] = {"forward_ms": fwd * 1e3, "forward_and_backward_ms": both * 1e3}
    print(f"xla: forward {fwd * 1e3:.3f} ms, forward and backward {both * 1e3:.3f} ms",
          flush=True)
    runs = []
    for rows, warps, programs in SETTINGS:
        name = f"{rows} rows a block, {warps} warps, {programs} programs"
        setting = {"rows": rows, "num_warps": warps, "programs": programs}
        try:
            def forward(rows=rows, warps=warps):
                return norm_kernel._forward(x, h, hb, w, b, eps, False, rows, warps)

            s, y, mean, rstd = forward()

            def backward(rows=rows, warps=warps, programs=programs, s=s, mean=mean,
                         rstd=rstd):
                return norm_kernel._backward(s, dy, ds, mean, rstd, w, False, rows,
                                             programs, warps)

            d = backward()[0]
            f_s = median_seconds(forward, args.repeat, calls=args.calls)
            b_s = median_seconds(backward, args.repeat, calls=args.calls)
        except Exception as e:  # a setting Triton cannot compile: say so, go on
            runs.append(failed_setting(name, setting, e))
            continue
        diff = max(float(np.max(np.abs(np.float32(a) - c)))
                   for a, c in ((s, s_want), (y, y_want), (d, d_want)))
        # forward reads x, h and writes s, y; backward reads s, dy, ds and writes d
        runs.append({**setting, "forward_ms": f_s * 1e3, "backward_ms": b_s * 1e3,
                     "forward_tb_per_s": 4 * stream / f_s / 1e3,
                     "backward_tb_per_s": 4 * stream / b_s / 1e3, "max_abs_diff": diff})
        print(f"{name}: forward {f_s * 1e3:.3f} ms ({4 * stream / f_s / 1e3:.2f} TB/s), "
              f"backward {b_s * 1e3:.3f} ms ({4 * stream / b_s / 1e3:.2f} TB/s), largest "
              f"difference from XLA's {diff:.2e}", flush=True)
    result["kernel"] = runs
    bad = best_setting(result, runs, result["xla"]["forward_and_backward_ms"],
                       lambda r: r["forward_ms"] + r["backward_ms"], "max_abs_diff", 0.1)
    report(result, args.json)
    return 1 if bad else 0


if __name__ == "__main__":
    run_script(main)
