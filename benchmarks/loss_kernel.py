"""The loss's reductions over the vocabulary on a GPU: `model.loss_kernel = "pallas"`'s
Triton kernel (parallel.loss_kernel) in a few launch settings against XLA's reduction
(models.loss's "xla" path), each token's log-sum-exp and its label's logit, at
gpt2-124m's logits ([32 x 1024, 50304] bf16, 50257 ids). The median of `--repeat` calls
of each, the bytes read per second, and each setting's largest difference from XLA's
values; the best setting is printed as the one to use (CHUNK, NUM_WARPS, NUM_STAGES).
Times the reductions alone: the step's own figure is `throughput.py --set
model.loss_kernel=...` (gpu_figures.sh's losskernel stage runs both).

    python benchmarks/loss_kernel.py [--rows 32768 --vocab 50257 --padded 50304] [--json F]
"""

from __future__ import annotations

import argparse
import time

# benchmarks/ is the script's directory
from report import failed_setting, median_seconds, nvidia_gpu, report, run_script

# (CHUNK, NUM_WARPS, NUM_STAGES)
SETTINGS = [(2048, 4, 2), (2048, 8, 2), (4096, 8, 2), (1024, 4, 2), (2048, 4, 3),
            (4096, 4, 1), (8192, 8, 1)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32768)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--padded", type=int, default=50304)
    ap.add_argument("--repeat", type=int, default=20)
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
              "rows": args.rows, "vocab": args.vocab, "padded": args.padded, "gb": gb}
    s = median_seconds(lambda: xla(x, t), args.repeat)
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
            s = median_seconds(call, args.repeat)
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
    ok = [r for r in runs if "ms" in r]
    if ok:
        best = min(ok, key=lambda r: r["ms"])
        result["best"] = best
        result["speedup_over_xla"] = result["xla"]["ms"] / best["ms"]
        if max(r["max_abs_loss_diff"] for r in ok) > 1e-3:
            print("the kernel's values differ from XLA's by more than 1e-3", flush=True)
            report(result, args.json)
            return 1
    report(result, args.json)
    return 0


if __name__ == "__main__":
    run_script(main)
