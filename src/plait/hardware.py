"""What plait knows of hardware: peak FLOP/s of devices, memory, and target descriptions.

`peak_flops` is the MFU denominator, matched against `jax.Device.device_kind`;
an unknown device (a CPU, a new GPU) has no entry and MFU is reported as null
rather than guessed. float32 on NVIDIA is the TF32 tensor-core rate, which XLA
uses for float32 matmuls at default precision.

`load_hardware` reads a target description (the `[hardware]` table of a mesh
file) for `plait sweep`: a path, or a name looked up in the directories of
`$PLAIT_HARDWARE_PATH`, then in the descriptions shipped with plait
(`meshes/`, installed as package data).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Annotated

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError

from plait.errors import UserError

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


def _memory_stats(device) -> dict | None:
    """The device allocator's figures, or None where the backend keeps none (CPU)."""
    try:
        return device.memory_stats()
    except Exception:  # noqa: BLE001 - not every backend implements it
        return None


def device_memory_bytes(device, sharing: int | None = None) -> float:
    """Memory one device may use: an accelerator's limit, or on CPU the host's physical
    memory shared by `sharing` simulated devices (default: all of this process's)."""
    import jax

    stats = _memory_stats(device)
    if stats and stats.get("bytes_limit"):
        return float(stats["bytes_limit"])
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host / max(1, sharing or jax.local_device_count())


def peak_memory_bytes(mesh) -> float | None:
    """The most memory any of this process's devices of `mesh` has held since the process
    started (the allocator's high-water mark), or None where the backend keeps no such
    figure (CPU). One run per process: a second run's peak includes the first's."""
    import jax

    peaks = []
    for d in mesh.devices.flat:
        if d.process_index != jax.process_index():
            continue
        stats = _memory_stats(d)
        if not stats or "peak_bytes_in_use" not in stats:
            return None
        peaks.append(float(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None


def mesh_device_memory(mesh) -> float:
    """Memory one device of `mesh` may use: on CPU the host's memory shared by the
    mesh's devices in this process only (a data=1 run of a process simulating 8 devices
    has the whole host, not an eighth)."""
    import jax

    local = sum(1 for d in mesh.devices.flat if d.process_index == jax.process_index())
    return device_memory_bytes(mesh.devices.flat[0], local)


# Strict per field (a whole strict dataclass takes only an instance of itself).
_Positive = Annotated[float, Field(gt=0, strict=True)]
_AtLeast0 = Annotated[float, Field(ge=0, strict=True)]


@dataclass
class Hardware:
    """A target machine for the sweep's cost model (see plait.sweep.cost). A [hardware]
    table is validated against these fields' types and bounds (load_hardware): a memory
    or a bandwidth of 0 failed as ZeroDivisionError deep in the sweep's pricing, a
    string as a TypeError, and a negative peak ranked shapes on nonsense."""

    __pydantic_config__ = ConfigDict(allow_inf_nan=False)

    name: Annotated[str, Field(strict=True)]
    peak_bf16_flops: _Positive
    peak_fp32_flops: _Positive
    memory_bytes: _Positive
    devices_per_node: Annotated[int, Field(gt=0, strict=True)]
    intra_node_bandwidth: _Positive
    intra_node_latency: _AtLeast0
    inter_node_bandwidth: _Positive
    inter_node_latency: _AtLeast0
    efficiency: Annotated[float, Field(gt=0, le=1, strict=True)] = 0.5
    # Bytes/s of device memory: prices a DLRM's row gathers and sparse updates (0: not).
    memory_bandwidth: _AtLeast0 = 0.0
    shared_compute: Annotated[bool, Field(strict=True)] = False
    extra: dict = field(default_factory=dict)

    def peak(self, dtype: str, n: int) -> float:
        p = self.peak_bf16_flops if dtype == "bfloat16" else self.peak_fp32_flops
        return p / n if self.shared_compute else p

    def bandwidth(self, n: int) -> float:
        """Memory bandwidth per device (inf where the description has none)."""
        b = self.memory_bandwidth or float("inf")
        return b / n if self.shared_compute else b

    def memory(self, n: int) -> float:
        return self.memory_bytes / n if self.shared_compute else self.memory_bytes


_OPTIONAL = ("efficiency", "shared_compute", "memory_bandwidth")


def search_path() -> list[Path]:
    """Where hardware names are looked up, in order."""
    dirs = [Path(p) for p in os.environ.get("PLAIT_HARDWARE_PATH", "").split(os.pathsep) if p]
    return [*dirs, Path(str(resources.files("plait") / "meshes"))]


def known_hardware() -> list[str]:
    from plait.toml_files import read_toml

    names = {p.stem for d in search_path() if d.is_dir() for p in d.glob("*.toml")
             if "hardware" in read_toml(p, "mesh file")}
    return sorted(names)


def load_hardware(name: str) -> Hardware:
    """A hardware description: a path to a TOML file with a [hardware] table, a name, or
    "auto": the shipped one closest to this machine's first device (`for_device`; call it
    after the devices are set up: it starts JAX's backend)."""
    from plait.toml_files import read_toml

    if name == "auto":
        import jax

        name = for_device(jax.devices()[0].device_kind)

    path = Path(name)
    if not path.is_file():
        path = next((d / f"{name}.toml" for d in search_path() if (d / f"{name}.toml").is_file()),
                    None)
    if path is None:
        raise UserError(f"unknown hardware '{name}'; known: {', '.join(known_hardware())} "
                        "(or a path to a TOML file with a [hardware] table; more names "
                        "from $PLAIT_HARDWARE_PATH)")
    raw = read_toml(path, "hardware file").get("hardware")
    if not isinstance(raw, dict):
        raise UserError(f"'{path}' has no [hardware] table")
    fields = set(Hardware.__dataclass_fields__) - {"extra"}
    missing = sorted(f for f in fields - set(raw) if f not in _OPTIONAL)
    if missing:
        raise UserError(f"hardware '{path}' lacks {', '.join(missing)}")
    known = {k: v for k, v in raw.items() if k in fields}
    try:
        return TypeAdapter(Hardware).validate_python(
            {**known, "extra": {k: v for k, v in raw.items() if k not in fields}})
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(str(x) for x in err["loc"])
        raise UserError(f"hardware '{path}': {key} = {err.get('input')!r}: "
                        f"{err['msg'][:1].lower() + err['msg'][1:]}") from None


def for_device(device_kind: str) -> str:
    """The shipped description closest to a device (for `--mesh auto`, `--hardware auto`)."""
    kind = device_kind.lower()
    return next((name for key, name in (("h100", "h100-node"), ("h200", "h200-node"),
                                        ("a100", "a100-node"), ("tpu v5p", "tpu-v5p-16"))
                 if key in kind), "cpu-2core")
