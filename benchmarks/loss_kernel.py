"""The loss's kernels on a GPU (`model.loss_kernel = "pallas"`, parallel.loss_kernel) in
a few launch settings against XLA's form (models.loss's "xla" path), at gpt2-124m's
logits ([32 x 1024, 50304] bf16, 50257 ids): each token's log-sum-exp and its label's
logit (`lse_and_label`, the loss alone), then the loss and its gradient together
(`loss_and_gradient`, a training step's: XLA reads the logits twice from memory, the
kernel reads each row twice, the second time partly from L2, and writes the gradient
over it). The median over `--repeat` samples of each (a sample of the loss alone is
`--calls` calls issued back to back), the logits' bytes read per second, and each
setting's largest difference from XLA's values; the best setting of each is printed as
the one to use (CHUNK, NUM_WARPS, NUM_STAGES; GRAD_CHUNK, GRAD_PROGRAMS, GRAD_NUM_WARPS,
GRAD_NUM_STAGES, GRAD_REVERSE). Each list's first setting is the one plait ships (the
fastest on an H200 on 2026-11-27). Times the kernels alone: the step's own figure is
`throughput.py --set model.loss_kernel=...` (gpu_figures.sh's losskernel stage runs
both).

    python benchmarks/loss_kernel.py [--rows 32768 --vocab 50257 --padded 50304] [--json F]
"""

from __future__ import annotations

import argparse
import functools
import time
from operator import itemgetter

# benchmarks/ is the script's directory
from report import best_setting, failed_setting, median_seconds, nvidia_gpu, report, run_script

# (CHUNK, NUM_WARPS, NUM_STAGES)
SETTINGS = [(2048, 4, 3), (2048, 4, 2), (2048, 8, 3), (4096, 4, 3), (1024, 4, 3),
            (4096, 8, 2), (8192, 8, 1)]
# loss_and_gradient's (GRAD_CHUNK, GRAD_PROGRAMS, GRAD_NUM_WARPS, GRAD_NUM_STAGES,
# GRAD_REVERSE): programs None is one a row (measured fastest on an H200: 3.56 ms against
# 264 programs' 4.84, the setting before); around it, two with each program looping over
# rows, and the second pass from each row's end back (its last blocks still in L2)
GRAD_SETTINGS = [(4096, None, 8, 2, False), (4096, None, 8, 2, True),
                 (2048, None, 4, 2, False), (4096, None, 8, 3, False),
                 (4096, None, 8, 3, True), (8192, None, 8, 2, False),
                 (4096, None, 4, 2, False), (2048, 1056, 4, 2, False),
                 (4096, 264, 8, 2, False), (4096, 264, 8, 2, True)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32768)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--padded", type=int, default=50304)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--calls", type=int, default=4,
                    help="calls a timed sample of the loss alone (the gradient's: one, "
                         "each on a fresh copy of the logits)")
    ap.add_argument("--json", help="write the result here too")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from plait.models.loss import _per_token
    from plait.parallel import loss_kernel

    device = nvidia_gpu("the kernel runs")
    keys = jax.random.split(jax.random.key(0), 2)
    x = (4.0 * jax.random.normal(keys[0], (args.rows, args.padded))).astype(jnp.bfloat16)
    t = jax.random.randint(keys[1], (args.rows,), 0, args.vocab)
    gb = x.size * x.dtype.itemsize / 1e9

    xla = jax.jit(lambda x, t: _per_token(x, t, args.vocab, "xla")[::2])
    want_loss, want_lse = (np.asarray(a) for a in xla(x, t))
    result = {"date": time.strftime("%Y-%m-%d"), "device": device.device_kind,
              "rows": args.rows, "vocab": args.vocab, "padded": args.padded, "gb": gb,
              "repeat": args.repeat, "calls": args.calls}
    s = median_seconds(lambda: xla(x, t), args.repeat, calls=args.calls)
    result["xla"] = {"ms": s * 1e3, "tb_per_s": gb / s / 1e3}
    print(f"xla: {s * 1e3:.3f} ms, {gb / s / 1e3:.2f} TB/s", flush=True)
    runs = []
    for chunk, warps, stages in SETTINGS:
        name = f"chunk {chunk}, {warps} warps, {stages} stages"
        setting = {"chunk": chunk, "num_warps": warps, "num_stages": stages}
        try:
            def call(chunk=chunk, warps=warps, stages=stages):
                return loss_kernel._rows(x, t, args.vocab, chunk, False, warps, stages)
            lse, label = call()
            s = median_seconds(call, args.repeat, calls=args.calls)
        except Exception as e:  # a setting Triton cannot compile: say so, go on
            runs.append(failed_setting(name, setting, e))
            continue
        err = float(np.max(np.abs(np.asarray(lse) - want_lse)))
        loss_err = float(np.max(np.abs(np.asarray(lse - label) - want_loss)))
        runs.append({**setting, "ms": s * 1e3, "tb_per_s": gb / s / 1e3, "max_abs_lse_diff": err,
                     "max_abs_loss_diff": loss_err})
        print(f"{name}: {s * 1e3:.3f} ms, {gb / s / 1e3:.2f} TB/s, largest difference "
              f"from XLA's: log-sum-exp {err:.2e}, loss {loss_err:.2e}", flush=True)
    result["kernel"] = runs
    bad = best_setting(result, runs, result["xla"]["ms"], itemgetter("ms"),
                       "max_abs_loss_diff", 1e-3)

    # the loss and its gradient (weights 1 / tokens, as a step's mean); the kernel writes
    # over its input, so each call gets a fresh copy of the logits, not timed
    from plait.models.loss import _sum_and_gradient

    scale = 1.0 / args.rows
    weights = jnp.full((args.rows,), scale, jnp.float32)
    xla_grad = jax.jit(lambda x, t: _sum_and_gradient(x, t, args.vocab, scale, "xla"))
    want_sum, want_grad = xla_grad(x, t)
    # compared on the device: a host copy of 1.6e9 values a setting took seconds
    largest_diff = jax.jit(lambda a, b: jnp.max(jnp.abs(a.astype(jnp.float32)
                                                       - b.astype(jnp.float32))))
    s = median_seconds(lambda: xla_grad(x, t), args.repeat)
    result["xla_gradient"] = {"ms": s * 1e3, "tb_per_s": gb / s / 1e3}
    print(f"xla, loss and gradient: {s * 1e3:.3f} ms, {gb / s / 1e3:.2f} TB/s", flush=True)
    fresh = jax.jit(lambda x: x.copy())
    grad_runs = []
    for chunk, programs, warps, stages, reverse in GRAD_SETTINGS:
        spread = "one program a row" if programs is None else f"{programs} programs"
        name = (f"chunk {chunk}, {spread}, {warps} warps, {stages} stages"
                + (", second pass reversed" if reverse else ""))
        setting = {"chunk": chunk, "programs": programs, "num_warps": warps,
                   "num_stages": stages, "reverse": reverse}
        try:
            call = jax.jit(functools.partial(
                loss_kernel._rows_with_gradient, vocab=args.vocab, chunk=chunk,
                programs=programs, interpret=False, num_warps=warps, num_stages=stages,
                reverse=reverse),
                donate_argnums=0)
            loss, grad = call(fresh(x), t, weights)
            s = median_seconds(lambda y, call=call: call(y, t, weights), args.repeat,
                               fresh=lambda: fresh(x))
        except Exception as e:  # a setting Triton cannot compile: say so, go on
            grad_runs.append(failed_setting(name, setting, e))
            continue
        loss_err = abs(float(jnp.sum(loss)) - float(want_sum)) / args.rows
        grad_err = float(largest_diff(grad, want_grad))
        del grad
        grad_runs.append({**setting, "ms": s * 1e3, "tb_per_s": gb / s / 1e3,
                          "mean_loss_diff": loss_err, "max_abs_grad_diff": grad_err})
        print(f"{name}: {s * 1e3:.3f} ms, {gb / s / 1e3:.2f} TB/s, largest difference "
              f"from XLA's: mean loss {loss_err:.2e}, gradient {grad_err:.2e}", flush=True)
    result["kernel_gradient"] = grad_runs
    bad |= best_setting(result, grad_runs, result["xla_gradient"]["ms"], itemgetter("ms"),
                        "mean_loss_diff", 1e-3, "_gradient")
    report(result, args.json)
    return 1 if bad else 0


if __name__ == "__main__":
    run_script(main)
