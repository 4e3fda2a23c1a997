"""Published peak dense matmul throughput of known devices (FLOP/s per device).

The MFU denominator. Matched against `jax.Device.device_kind`; an unknown
device (a CPU, a new GPU) has no entry and MFU is reported as null rather than
guessed. float32 on NVIDIA is the TF32 tensor-core rate, which XLA uses for
float32 matmuls at default precision.
"""

from __future__ import annotations

# (substring of device_kind, lower case) -> {compute dtype: peak FLOP/s}
PEAK_FLOPS: list[tuple[str, dict[str, float]]] = [
    ("h200", {"bfloat16": 989.4e12, "float32": 494.7e12}),
    ("h100 pcie", {"bfloat16": 756.0e12, "float32": 378.0e12}),
    ("h100", {"bfloat16": 989.4e12, "float32": 494.7e12}),
    ("gh200", {"bfloat16": 989.4e12, "float32": 494.7e12}),
    ("b200", {"bfloat16": 2250e12, "float32": 1100e12}),
    ("a100", {"bfloat16": 312e12, "float32": 156e12}),
    ("l40s", {"bfloat16": 362e12, "float32": 183e12}),
    ("l4", {"bfloat16": 121e12, "float32": 60e12}),
    ("a10g", {"bfloat16": 70e12, "float32": 35e12}),
    ("v100", {"bfloat16": 125e12, "float32": 15.7e12}),
    ("tpu v6", {"bfloat16": 918e12, "float32": 918e12}),
    ("tpu v5p", {"bfloat16": 459e12, "float32": 459e12}),
    ("tpu v5 lite", {"bfloat16": 197e12, "float32": 197e12}),
    ("tpu v5e", {"bfloat16": 197e12, "float32": 197e12}),
    ("tpu v4", {"bfloat16": 275e12, "float32": 275e12}),
]


def peak_flops(device_kind: str, dtype: str) -> float | None:
    kind = device_kind.lower()
    for key, peaks in PEAK_FLOPS:
        if key in kind:
            return peaks.get(dtype)
    return None


def device_memory_bytes(device) -> float:
    """Memory one device may use: an accelerator's limit, or on CPU the host's physical
    memory shared by the process's simulated devices."""
    import os

    import jax

    stats = None
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - not every backend implements it
        stats = None
    if stats and stats.get("bytes_limit"):
        return float(stats["bytes_limit"])
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host / max(1, jax.local_device_count())
