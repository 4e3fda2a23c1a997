"""Mesh specs (files or inline `data=2,fsdp=2,tensor=2`) -> a jax Mesh.

A spec may say which part of an axis crosses hosts (the slow links, DCN in
MaxText's words): `data=4@dcn,data=8` is a data axis of 32 whose outer 4 are
hosts, `[mesh.dcn]` says the same in a mesh file. Devices are laid out so that
part runs across hosts (plait.hosts: processes of a multi-process run; groups
of consecutive devices, simulated hosts, in one process), and
`hosts.host_layout` tells the rest of plait which device sits on which host.

Nothing here touches the JAX backend until `provision_devices`, because on
CPU the number of simulated devices must be fixed before JAX starts.
"""

from __future__ import annotations

import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from plait.errors import UserError

# Every mesh axis, in mesh order (outermost first: the innermost axes talk most
# and should land on the fastest links).
AXES = (
    "data", "pipeline", "fsdp", "expert", "context",
    "tensor_depth", "tensor_row", "tensor_col",
    "tensor_x", "tensor_y", "tensor_z",
    "tensor",
)
# Tensor-parallel modes and the axes that make them (a mesh uses at most one).
TENSOR_MODES = {
    "1d": ("tensor",),
    "2d": ("tensor_row", "tensor_col"),
    "2.5d": ("tensor_depth", "tensor_row", "tensor_col"),
    "3d": ("tensor_x", "tensor_y", "tensor_z"),
}
# How reports and messages name each mode (None: no tensor parallelism).
MODE_NAMES = {None: "none", "1d": "1-D", "2d": "2-D", "2.5d": "2.5-D", "3d": "3-D"}


@dataclass
class MeshSpec:
    """Axis sizes as the user wrote them (one may be -1), plus where they came from.
    `axes` are the parts within a host, `dcn` the parts across hosts (an axis's size
    is the product). Checked when made: known axes, sizes >= 1 or -1 (within a host
    only), at most one -1."""

    axes: dict[str, int]
    source: str
    # An experiment's own mesh may run on simulated CPU devices when the machine has
    # fewer accelerators than it needs (the quickstart on a one-GPU machine).
    cpu_fallback: bool = False
    dcn: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_axes(self)

    def inline(self) -> str:
        return ",".join([f"{k}={v}@dcn" for k, v in self.dcn.items()]
                        + [f"{k}={v}" for k, v in self.axes.items()])

    @property
    def hosts(self) -> int:
        """How many hosts the spec spans (1: it says nothing about hosts)."""
        return math.prod(self.dcn.values())


def parse_inline(text: str) -> tuple[dict[str, int], dict[str, int]]:
    """(within-host sizes, across-host sizes) of `data=4@dcn,data=8,tensor=2`."""
    axes: dict[str, int] = {}
    dcn: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"([A-Za-z_]+)\s*=\s*(-?\d+)\s*(@\s*dcn)?", part)
        if not m:
            raise UserError(
                f"cannot read mesh spec '{text}' at '{part}'; write it like data=2,fsdp=2,tensor=2 "
                "(data=2@dcn for a part across hosts)"
            )
        name, size = m.group(1), int(m.group(2))
        into = dcn if m.group(3) else axes
        if name in into:
            where = " across hosts (@dcn)" if m.group(3) else ""
            raise UserError(f"mesh spec '{text}' names axis '{name}'{where} twice")
        into[name] = size
    if not axes and not dcn:
        raise UserError("empty mesh spec; write it like data=2,fsdp=2,tensor=2")
    return axes, dcn


def load_spec(arg: str) -> MeshSpec:
    """`arg` is a mesh file (meshes/x.toml) or an inline spec."""
    path = Path(arg)
    if path.suffix == ".toml" or path.is_file():
        from plait.toml_files import read_toml

        raw = read_toml(path, "mesh file")
        if "mesh" not in raw or not isinstance(raw["mesh"], dict):
            raise UserError(f"mesh file '{path}' has no [mesh] table of axis sizes")
        unknown = set(raw) - {"mesh", "hardware", "description"}
        if unknown:
            raise UserError(
                f"mesh file '{path}' has unknown section '{sorted(unknown)[0]}'; "
                "allowed: [mesh], [mesh.dcn], [hardware], description"
            )
        axes = dict(raw["mesh"])
        dcn = axes.pop("dcn", {})
        if not axes and not dcn:
            raise UserError(f"mesh file '{path}' has an empty [mesh] table; give the axis "
                            "sizes (e.g. data = 8; data = 1 for one device)")
        if not isinstance(dcn, dict):
            raise UserError(f"mesh file '{path}': dcn must be a table, [mesh.dcn], of the "
                            "axis parts across hosts (e.g. data = 2)")
        for table, sizes in (("[mesh]", axes), ("[mesh.dcn]", dcn)):
            for k, v in sizes.items():
                if not isinstance(v, int) or isinstance(v, bool):
                    raise UserError(
                        f"mesh file '{path}': {table} axis '{k}' must be an integer, got "
                        f"{str(v).lower() if isinstance(v, bool) else repr(v)}")
        return MeshSpec(axes, str(path), dcn=dict(dcn))
    if "=" not in arg:
        raise UserError(f"mesh file '{arg}' not found; pass a file or an inline spec like data=8")
    axes, dcn = parse_inline(arg)
    return MeshSpec(axes, "--mesh", dcn=dcn)


def _check_axes(spec: MeshSpec) -> None:
    for name, size in [*spec.axes.items(), *spec.dcn.items()]:
        if name not in AXES:
            import difflib

            close = difflib.get_close_matches(name, AXES, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise UserError(
                f"unknown mesh axis '{name}' in {spec.source}{hint} (axes: {', '.join(AXES)})"
            )
        if size == 0 or size < -1:
            raise UserError(f"mesh axis '{name}' has size {size} in {spec.source}; use >= 1 or -1")
    for name, size in spec.dcn.items():
        if size < 1:
            raise UserError(f"the part of mesh axis '{name}' across hosts has size {size} in "
                            f"{spec.source}; use a size >= 1 (-1 only within a host)")
    if sum(1 for s in spec.axes.values() if s == -1) > 1:
        raise UserError(f"only one mesh axis may be -1 in {spec.source}")


def fixed_product(spec: MeshSpec) -> int:
    return math.prod(s for s in spec.axes.values() if s != -1) * spec.hosts


def resolve(spec: MeshSpec, n_devices: int) -> dict[str, int]:
    """Sizes of every axis, with -1 replaced by the devices left."""
    fixed = fixed_product(spec)
    sizes = {a: 1 for a in AXES}
    for name, size in spec.axes.items():
        if name in sizes:
            sizes[name] = size
    free = [a for a, s in sizes.items() if s == -1]
    if free:
        if n_devices % fixed:
            raise UserError(
                f"mesh {spec.inline()} cannot fill {n_devices} devices: the fixed axes "
                f"multiply to {fixed}, which does not divide {n_devices}"
            )
        sizes[free[0]] = n_devices // fixed
    for name, size in spec.dcn.items():
        sizes[name] *= size
    total = math.prod(sizes.values())
    if total != n_devices:
        raise UserError(
            f"mesh {spec.inline()} from {spec.source} needs {total} devices but {n_devices} "
            f"are in use; make the sizes multiply to {n_devices} or give one axis as -1"
        )
    tensor_mode(sizes)
    return sizes


def tensor_mode(sizes: dict[str, int]) -> str | None:
    """Which tensor-parallel mode the axis sizes select ('1d', '2d', '2.5d', '3d' or None).

    Raises a UserError for shapes no mode can run: a grid that is not square, a
    cube that is not a cube, a depth without a grid, or two modes at once.
    """
    def size(axis: str) -> int:
        return sizes.get(axis, 1)

    used = [m for m in ("1d", "2d", "3d") if any(size(a) > 1 for a in TENSOR_MODES[m])]
    if size("tensor_depth") > 1 and "2d" not in used:
        raise UserError(
            f"tensor_depth={size('tensor_depth')} stacks 2-D grids but the mesh has none; "
            "add tensor_row = tensor_col > 1 (2.5-D), or drop tensor_depth"
        )
    if len(used) > 1:
        names = {"1d": "tensor (1-D)", "2d": "tensor_row/tensor_col (2-D)",
                 "3d": "tensor_x/y/z (3-D)"}
        raise UserError(
            f"the mesh mixes tensor modes {' and '.join(names[m] for m in used)}; "
            "use the axes of one mode only"
        )
    if not used:
        return None
    mode = used[0]
    if mode == "2d":
        r, c = size("tensor_row"), size("tensor_col")
        if r != c:
            raise UserError(
                f"the 2-D tensor grid tensor_row={r} x tensor_col={c} is not square; "
                f"use equal sizes (e.g. tensor_row={max(r, c)},tensor_col={max(r, c)})"
            )
        return "2.5d" if size("tensor_depth") > 1 else "2d"
    if mode == "3d":
        x, y, z = size("tensor_x"), size("tensor_y"), size("tensor_z")
        if not x == y == z:
            q = max(x, y, z)
            raise UserError(
                f"the 3-D tensor mesh tensor_x={x} x tensor_y={y} x tensor_z={z} is not a "
                f"cube; use equal sizes (e.g. tensor_x={q},tensor_y={q},tensor_z={q})"
            )
    return mode


def inline(sizes: dict[str, int]) -> str:
    """The `--mesh` form of resolved sizes, leaving out size-1 axes."""
    parts = [f"{a}={s}" for a, s in sizes.items() if s != 1]
    return ",".join(parts) or "data=1"


def _xla_flag_device_count() -> int | None:
    m = re.search(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    return int(m.group(1)) if m else None


_PENDING_PROCESSES = 1
_ON_CPU = False  # the mesh falls back to simulated CPU devices (provision_devices)


def provision_devices(spec: MeshSpec, requested: int | None = None) -> int:
    """Make sure JAX has the devices the mesh needs; return how many the mesh uses.

    On CPU this asks for simulated devices (only possible before JAX starts).
    A -1 axis takes `requested` devices if given, else every accelerator, else
    one simulated device per CPU core.
    """
    import jax

    has_free = any(s == -1 for s in spec.axes.values())
    if requested is not None:
        want = requested
    elif has_free:  # on CPU, a share of equal size for every process of the run
        want = math.lcm(max(fixed_product(spec), os.cpu_count() or 1), _PENDING_PROCESSES)
    else:
        want = fixed_product(spec)
    flag_count = _xla_flag_device_count()
    if not backend_started() and flag_count is None:
        # Each process of a multi-process run simulates its share of the mesh.
        per_process = max(1, want // _PENDING_PROCESSES)
        current = getattr(jax.config, "jax_num_cpu_devices", -1)
        if per_process > current:
            jax.config.update("jax_num_cpu_devices", per_process)
    devices = jax.devices()
    platform = devices[0].platform
    if has_free and requested is None and platform != "cpu":
        want = len(devices)
    if platform == "cpu" and want % _PENDING_PROCESSES:
        # 3 processes simulated 2 devices each for a mesh of 8 (then "needs 8 devices but
        # this process has 6"); 16 processes one each, and the 8 outside the mesh hung
        fits = ", ".join(str(p) for p in range(2, want + 1) if want % p == 0)
        raise UserError(f"mesh {spec.inline()} needs {want} devices, which "
                        f"{_PENDING_PROCESSES} processes cannot share equally (each simulates "
                        f"its share of CPU devices); use a process count that divides {want}"
                        + (f" ({fits})" if fits else ", or one process"))
    if len(devices) < want:
        if platform == "cpu" and flag_count is not None:
            raise UserError(
                f"mesh {spec.inline()} needs {want} devices but XLA_FLAGS sets "
                f"--xla_force_host_platform_device_count={flag_count}; "
                "raise it or unset XLA_FLAGS and let plait choose"
            )
        if platform == "cpu":
            raise UserError(
                f"mesh {spec.inline()} needs {want} devices but this process has {len(devices)} "
                "CPU devices (fixed when JAX started); run plait in a fresh process"
            )
        if spec.cpu_fallback and len(jax.devices("cpu")) >= want:
            global _ON_CPU
            _ON_CPU = True
            print(f"plait: the {spec.source} needs {want} devices and this machine has "
                  f"{len(devices)} {platform}; running it on {want} simulated CPU devices "
                  f"(--mesh data={len(devices)} trains on the {platform} instead)",
                  file=sys.stderr, flush=True)
            return want
        raise UserError(
            f"mesh {spec.inline()} needs {want} devices but only {len(devices)} "
            f"{platform} devices exist; shrink the mesh or use -1 for one axis"
        )
    return want


def set_pending_process_count(n: int) -> None:
    """Record that jax.distributed will join `n` processes (for per-process CPU devices)."""
    global _PENDING_PROCESSES
    _PENDING_PROCESSES = n


def backend_started() -> bool:
    """Whether JAX has started a backend: device counts and the environment variables
    XLA reads at start (XLA_FLAGS, XLA_PYTHON_CLIENT_*) are fixed from then on."""
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge._backends)
    except Exception:  # pragma: no cover - private API moved
        return False


def build_mesh(sizes: dict[str, int], n_devices: int, dcn: dict[str, int] | None = None):
    """A Mesh over the first `n_devices` devices, with classic (Auto) GSPMD axes; with
    `dcn` (the part of each axis across hosts) laid out over hosts (plait.hosts.place)."""
    import jax
    from jax.sharding import AxisType, Mesh

    from plait import hosts

    names = tuple(sizes)
    shape = tuple(sizes[a] for a in names)
    devices = (jax.devices("cpu") if _ON_CPU else jax.devices())[:n_devices]
    auto = (AxisType.Auto,) * len(names)
    placed = hosts.place(sizes, devices, dcn or {})
    if placed is None:
        return jax.make_mesh(shape, names, axis_types=auto, devices=devices)
    return Mesh(placed, names, axis_types=auto)
