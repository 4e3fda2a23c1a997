"""FP8's quantisation pass on a GPU: `model.fp8_kernel = "pallas"`'s Triton kernel
(parallel.fp8_cast: an operand read once, written in FP8 as it is and transposed, with
its amax) in a few launch settings against XLA's fusion of the same computation, at
gpt2-1.3b's shapes, each mode the step runs: the MLP's hidden activation [16 x 1024,
5120] ("plain"; "gelu": the GELU of the first product's output plus its bias;
"dgelu": its gradient from the GELU's input and the bias's column sums as well, two
bf16 arrays read), the q/k/v projection's gradient in its three parts [16 x 1024, 3 x
1280] ("parts", with their column sums) and the residual stream's width [16 x 1024,
1280]. The median over `--repeat` samples of `--calls` calls each, the bytes moved per
second, and whether each setting's FP8 values equal XLA's; the best setting is printed
as the one to use (ROWS, COLS, NUM_WARPS; the step's per mode: parallel.fp8_cast.BLOCKS).
The GELU's passes are also timed with the GPU's approximate tanh ("approx_tanh" in the
JSON; not what the step runs).
Times the pass alone: the step's own figure is `throughput.py --set precision.matmul='fp8'
[--set model.fp8_kernel='xla']` (gpu_figures.sh's fp8kernel).

    python benchmarks/fp8_kernel.py [--calls 10] [--json F]
"""

from __future__ import annotations

import argparse
import time

# benchmarks/ is the script's directory
from report import best_setting, failed_setting, median_seconds, nvidia_gpu, report, run_script

# (ROWS, COLS, NUM_WARPS)
SETTINGS = [(128, 64, 4), (64, 64, 4), (128, 128, 8), (64, 128, 4), (256, 64, 8),
            (32, 128, 4)]
SHAPES = [("plain", 16384, 5120), ("gelu", 16384, 5120), ("dgelu", 16384, 5120),
          ("parts", 16384, 3 * 1280), ("plain", 16384, 1280)]
PART_COLS = 1280
SUMS = ("dgelu", "parts")  # the modes that also give column sums
# the GELU's passes also with the GPU's one-instruction tanh (fp8_cast._tanh), in these
# blocks: timed and their values counted, not held to XLA's (an approximation of ~2^-11)
APPROX = [(128, 64, 4), (64, 64, 4)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--calls", type=int, default=10, help="calls a timed sample")
    ap.add_argument("--json", help="write the result here too")
    args = ap.parse_args()

    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from plait.models.fp8 import E4M3, E5M2
    from plait.parallel import fp8_cast

    device = nvidia_gpu("the kernel runs")
    result = {"date": time.strftime("%Y-%m-%d"), "device": device.device_kind,
              "repeat": args.repeat, "calls": args.calls, "shapes": []}
    bad = False
    for mode, rows_n, cols_n in SHAPES:
        k = jax.random.split(jax.random.key(0), 3)
        x = jax.random.normal(k[0], (rows_n, cols_n)).astype(jnp.bfloat16)
        pre = jax.random.normal(k[1], (rows_n, cols_n)).astype(jnp.bfloat16)
        b = 0.1 * jax.random.normal(k[2], (cols_n,))
        q_dtype = E5M2 if mode in SUMS else E4M3  # gradients in e5m2
        scale = jnp.asarray([0.01], jnp.float32)
        top = float(jnp.finfo(q_dtype).max)

        @jax.jit
        def xla(x, pre, b, scale, q_dtype=q_dtype, top=top, mode=mode):
            v = x.astype(jnp.float32)
            if mode == "gelu":
                v = fp8_cast._gelu(v + b)
            if mode == "dgelu":
                v = v * fp8_cast._gelu_grad(pre.astype(jnp.float32) + b)
            q = jnp.clip(v / scale[0], -top, top).astype(q_dtype)
            out = (q, q.T, jnp.max(jnp.abs(v)))
            return out + ((v.sum(0),) if mode in SUMS else ())

        inputs = {"plain": (x,), "gelu": (x, b), "dgelu": (x, pre, b),
                  "parts": tuple(x[:, i:i + PART_COLS]
                                 for i in range(0, cols_n, PART_COLS))}[mode]
        # reads x (and pre), writes q and its transpose
        gb = rows_n * cols_n * (2 * (2 if mode == "dgelu" else 1) + 2) / 1e9
        want = xla(x, pre, b, scale)
        args_xla = (x, pre, b, scale)
        xla_s = median_seconds(lambda a=args_xla: xla(*a), args.repeat, calls=args.calls)
        shape = {"mode": mode, "rows": rows_n, "cols": cols_n, "gb": gb,
                 "xla_ms": xla_s * 1e3, "xla_tb_per_s": gb / xla_s / 1e3}
        print(f"{mode} [{rows_n}, {cols_n}]: xla {xla_s * 1e3:.3f} ms "
              f"({gb / xla_s / 1e3:.2f} TB/s)", flush=True)
        runs, approx = [], []
        tried = [(s, False) for s in SETTINGS]
        tried += [(s, True) for s in APPROX] if mode in ("gelu", "dgelu") else []
        for (rows, cols, warps), approx_tanh in tried:
            name = (f"{mode}: {rows} x {cols} blocks, {warps} warps"
                    + (", approximate tanh" if approx_tanh else ""))
            setting = {"rows": rows, "cols": cols, "num_warps": warps}
            into = approx if approx_tanh else runs
            try:
                kernel = jax.jit(functools.partial(
                    fp8_cast._launch, mode, n_rows=rows_n, n_cols=cols_n, q_dtype=q_dtype,
                    interpret=False, part_cols=PART_COLS if mode == "parts" else 0,
                    rows=rows, cols=cols, num_warps=warps, approx_tanh=approx_tanh))

                def call(kernel=kernel, operands=(scale, *inputs)):
                    return kernel(operands)

                got = call()
                seconds = median_seconds(call, args.repeat, calls=args.calls)
            except Exception as e:  # a setting Triton cannot compile: say so, go on
                into.append(failed_setting(name, setting, e))
                continue
            # FP8 values one step apart where float32 rounding orders differ: counted
            steps = int(np.sum(np.asarray(got[0]).view(np.uint8)
                               != np.asarray(want[0]).view(np.uint8)))
            same_t = bool(np.array_equal(np.asarray(got[1]).view(np.uint8),
                                         np.asarray(got[0]).view(np.uint8).T))
            amax_diff = abs(float(jnp.max(got[2])) - float(want[2]))
            sums_diff = (float(jnp.max(jnp.abs(got[3].sum(0) - want[3])))
                         if mode in SUMS else 0.0)
            into.append({**setting, "ms": seconds * 1e3, "tb_per_s": gb / seconds / 1e3,
                         "fp8_values_off": steps, "transpose_equal": same_t,
                         "amax_diff": amax_diff, "sums_max_abs_diff": sums_diff,
                         "max_abs_diff": amax_diff + (0 if same_t else 1e9) + steps / x.size})
            print(f"{name}: {seconds * 1e3:.3f} ms ({gb / seconds / 1e3:.2f} TB/s), FP8 "
                  f"values unlike XLA's {steps} of {x.size}, transpose "
                  f"{'equal' if same_t else 'WRONG'}, amax off by {amax_diff:.2e}"
                  + (f", column sums off by {sums_diff:.2e}" if mode in SUMS else ""),
                  flush=True)
        shape["kernel"] = runs
        if approx:
            shape["approx_tanh"] = approx
        # a setting is wrong past a few in 10^4 values one FP8 step off
        bad |= bool(best_setting(shape, runs, shape["xla_ms"], lambda r: r["ms"],
                                 "max_abs_diff", 1e-3))
        result["shapes"].append(shape)
    report(result, args.json)
    return 1 if bad else 0


if __name__ == "__main__":
    run_script(main)
