"""The XLA flags plait sets by default, in one place.

These are the GPU flags MaxText's H100 recipes use: the latency-hiding
scheduler (overlaps collectives and copies with compute), double-buffered
while loops (the scanned layers prefetch the next layer's weights), cuBLAS
rather than Triton for matmuls, and collectives on the highest-priority
stream. Measured on one H100 (docs/benchmarks.md, "GPU facts") they were worth ~3% on
GPT-2 124M. They only touch the GPU compiler, so a CPU or TPU run ignores
them; they are known to jaxlib 0.10.2 (CPU) and 0.11.2 (CUDA).

A flag the user already sets in `XLA_FLAGS` wins; `PLAIT_XLA_DEFAULTS=0`
sets none. XLA reads the variable when the backend starts, so this runs
before plait touches a device.
"""

from __future__ import annotations

import os
import re
from collections.abc import MutableMapping

from plait.errors import UserError

DEFAULTS: dict[str, str] = {
    "xla_gpu_enable_latency_hiding_scheduler": "true",
    "xla_gpu_enable_while_loop_double_buffering": "true",
    "xla_gpu_enable_triton_gemm": "false",
    "xla_gpu_enable_highest_priority_async_stream": "true",
}


def _named(flags: str) -> set[str]:
    return set(re.findall(r"--(\w+)", flags))


def apply_defaults(environ: MutableMapping[str, str] = os.environ) -> list[str]:
    """Add the default flags the user has not set to `XLA_FLAGS`; returns those added."""
    setting = environ.get("PLAIT_XLA_DEFAULTS", "1").strip().lower()
    if setting in ("0", "false", "no", "off"):
        return []
    if setting not in ("1", "true", "yes", "on", ""):
        raise UserError(f"PLAIT_XLA_DEFAULTS={environ['PLAIT_XLA_DEFAULTS']!r} is neither on "
                        "nor off; set it to 1 (plait's XLA flags, the default) or 0 (none)")
    current = environ.get("XLA_FLAGS", "")
    taken = _named(current)
    added = [f"--{k}={v}" for k, v in DEFAULTS.items() if k not in taken]
    if added:
        environ["XLA_FLAGS"] = " ".join(x for x in [current.strip(), *added] if x)
    return added
