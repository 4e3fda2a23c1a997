"""What a GPT runs on a device when its config says "auto": the attention kernel
(`model.attention`) and scanned or unrolled blocks (`model.scan_layers`), each with
the reason, which the run's start-up line prints."""

from __future__ import annotations

from plait.config import GPTConfig


def attention_for(cfg: GPTConfig, compute: str, platform: str, device_kind: str
                  ) -> tuple[str, str]:
    """(implementation, why) for `model.attention`: "auto" takes the fused cuDNN flash
    kernel of `jax.nn.dot_product_attention` where it applies (an NVIDIA GPU, bf16 compute,
    a head size cuDNN takes), XLA's attention otherwise. (JAX's own default chose XLA's
    unfused attention on an H100, 2.2x slower: docs/benchmarks.md, "GPU facts".)"""
    if cfg.attention != "auto":
        return cfg.attention, "model.attention"
    head = cfg.head_size
    if platform != "gpu" or "nvidia" not in device_kind.lower():
        return "xla", f"auto: no fused kernel on {platform}"
    if compute != "bfloat16":
        return "xla", "auto: cuDNN flash attention needs bf16 compute"
    if head % 8 or head > 128:
        return "xla", f"auto: head size {head} is not one cuDNN takes (a multiple of 8, <= 128)"
    return "cudnn", "auto: fused flash attention on an NVIDIA GPU"


# Up to this depth `scan_layers = "auto"` unrolls the blocks on a GPU.
UNROLL_MAX_LAYERS = 24


def scan_for(cfg: GPTConfig, platform: str) -> tuple[bool, str]:
    """(scan?, why) for `model.scan_layers`. "auto" unrolls on a GPU up to
    UNROLL_MAX_LAYERS blocks: there XLA schedules and fuses across blocks, and the
    unrolled GPT-2 124M ran 20-30% faster than the scanned one on an H100
    (docs/benchmarks.md, "GPU facts"), while the unrolled step's compile time, which grows with
    depth, stays short. Deeper models, CPUs (no speed gap measured, compile several
    times faster) and TPUs (where scanning is the norm, as in MaxText) scan."""
    if cfg.scan_layers != "auto":
        return bool(cfg.scan_layers), "model.scan_layers"
    if cfg.moe is not None and cfg.moe.every > 1:
        return False, "auto: unrolled, dense and expert layers alternate (moe.every > 1)"
    if platform == "gpu" and cfg.layers <= UNROLL_MAX_LAYERS:
        return False, f"auto: unrolled on a GPU up to {UNROLL_MAX_LAYERS} layers"
    if platform == "gpu":
        return True, f"auto: scanned on a GPU beyond {UNROLL_MAX_LAYERS} layers"
    return True, f"auto: scanned on {platform}"
