"""Compile-only figures of a step: FLOPs, bytes of each collective, memory per device.

Read from the optimized, SPMD-partitioned HLO that XLA will run on one device,
so they are deterministic and can be asserted in tests. XLA's own
`cost_analysis` counts a `while` body once; here every computation is weighted
by how often it runs (known trip counts of loops such as gradient
accumulation), so collectives and matmuls inside loops are counted fully.

Collective bytes per device (`collectives`), by kind:
- all-reduce: size of the reduced array;
- all-gather: size of the gathered (output) array;
- reduce-scatter: size of the input array;
- all-to-all, collective-permute: size of the array sent.
`collectives_wire` gives the bytes each device receives with ring algorithms:
all-reduce 2(n-1)/n x size, all-gather and reduce-scatter (n-1)/n x size,
all-to-all (n-1)/n x size, collective-permute 1 x size (n = group size).

Given the host of every mesh position (`hosts`, from plait.mesh.host_layout),
each collective is classed by the links it crosses: within one host, or across
hosts (its group, or one of a permute's pairs, spans several), and reported per
class (`bytes_by_link`, `wire_by_link`).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                    "collective-permute")

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s4": 0.5, "u4": 0.5, "f8e4m3fn": 1, "f8e5m2": 1,
    "f8e4m3": 1, "f8e5m2fnuz": 1, "f8e4m3fnuz": 1, "f8e4m3b11fnuz": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_HEADER = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")


@dataclass
class Instr:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str


@dataclass
class Module:
    computations: dict[str, list[Instr]] = field(default_factory=dict)
    entry: str = ""
    shapes: dict[str, str] = field(default_factory=dict)


def _matching(text: str, start: int) -> int:
    """Index of the bracket closing the one at `start`."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = []
    for i in range(start, len(text)):
        c = text[i]
        if c in pairs:
            stack.append(pairs[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return i
    return len(text) - 1


def _split_top(text: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for c in text:
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    if cur:
        parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _parse_instr(line: str) -> Instr | None:
    m = _INSTR.match(line)
    if not m:
        return None
    name, rest = m.group(1), m.group(2)
    if rest.startswith("("):
        end = _matching(rest, 0)
        shape, rest = rest[: end + 1], rest[end + 1 :].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    op = re.match(r"([\w\-]+)\(", rest)
    if not op:
        return None
    open_at = op.end() - 1
    close = _matching(rest, open_at)
    operands = [p.split()[-1].lstrip("%") for p in _split_top(rest[open_at + 1 : close])]
    return Instr(name, shape, op.group(1), operands, rest[close + 1 :])


def parse_hlo(text: str) -> Module:
    mod = Module()
    current: list[Instr] | None = None
    for line in text.splitlines():
        h = _HEADER.match(line)
        if h and "=" not in line.split("(")[0]:
            current = mod.computations.setdefault(h.group(2), [])
            if h.group(1):
                mod.entry = h.group(2)
            continue
        if line.strip() == "}":
            current = None
            continue
        if current is None:
            continue
        ins = _parse_instr(line)
        if ins:
            current.append(ins)
            mod.shapes[ins.name] = ins.shape
    return mod


def shape_bytes(shape: str) -> float:
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape):
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        total += n * _DTYPE_BYTES.get(dtype, 0)
    return total


def _dims(shape: str) -> list[int]:
    m = _ARRAY.search(shape)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def multiplicities(mod: Module, branch_weights: dict[int, list[float]] | None = None
                   ) -> dict[str, float]:
    """How many times each computation runs per step (loops weighted by trip count).

    A conditional's branches count once each per execution unless `branch_weights`
    gives, for conditionals with that many branches, how often each one runs per
    execution (a pipeline's per-tick switch: from its schedule table).
    """
    weights = branch_weights or {}
    callees: dict[str, list[tuple[str, float]]] = defaultdict(list)
    for comp, instrs in mod.computations.items():
        for ins in instrs:
            trip = 1.0
            if ins.opcode == "while":
                t = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.attrs)
                trip = float(t.group(1)) if t else 1.0
            for key in ("body", "condition"):
                for c in re.findall(rf"\b{key}=%?([\w.\-]+)", ins.attrs):
                    callees[comp].append((c, trip))
            for key in ("calls", "true_computation", "false_computation"):
                for c in re.findall(rf"\b{key}=%?([\w.\-]+)", ins.attrs):
                    callees[comp].append((c, 1.0))
            for group in re.findall(r"branch_computations=\{([^}]*)\}", ins.attrs):
                branches = [c.strip().lstrip("%") for c in group.split(",")]
                w = weights.get(len(branches), [1.0] * len(branches))
                for c, wi in zip(branches, w, strict=True):
                    callees[comp].append((c, wi))
    mult: dict[str, float] = defaultdict(float)

    def visit(comp: str, times: float, depth: int = 0) -> None:
        if depth > 64:
            return
        mult[comp] += times
        for callee, trip in callees.get(comp, []):
            visit(callee, times * trip, depth + 1)

    visit(mod.entry, 1.0)
    return mult


_MESH_GROUPS = re.compile(
    r"replica_groups=mesh\[([^\]]*)\]"
    r"(?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?"
    r"(?: \{([^}]*)\})?")


def _mesh_groups(m: re.Match) -> list[list[int]]:
    """Groups of the `mesh['axis_0'=2,...] {'axis_1'}` form: devices varying over the named axes."""
    sizes = [int(v) for v in re.findall(r"'[^']+'=(\d+)", m.group(1))]
    names = re.findall(r"'([^']+)'=", m.group(1))
    if m.group(2):
        dims = [int(x) for x in m.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        ids = ids.reshape(sizes)
    else:
        ids = np.arange(math.prod(sizes)).reshape(sizes)
    over = re.findall(r"'([^']+)'", m.group(4)) if m.group(4) else names
    varying = [names.index(a) for a in over]
    fixed = [i for i in range(len(names)) if i not in varying]
    size = math.prod(sizes[i] for i in varying)
    return ids.transpose(fixed + varying).reshape(-1, size).tolist()


def _group_ids(attrs: str, n_devices: int) -> list[list[int]] | None:
    m = _MESH_GROUPS.search(attrs)
    if m:
        return _mesh_groups(m)
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if m:
        shape = [int(x) for x in m.group(1).split(",")]
        dims = [int(x) for x in m.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return ids.reshape(shape[0], -1).tolist()
    m = re.search(r"replica_groups=\{(.*?)\}(?:,|$)", attrs)
    if m:
        groups = re.findall(r"\{([\d,\s]*)\}", m.group(0)[len("replica_groups="):])
        parsed = [[int(x) for x in g.split(",") if x.strip()] for g in groups]
        parsed = [g for g in parsed if g]
        return parsed or [list(range(n_devices))]
    return None


def _axes_of_group(group: list[int], mesh_shape: dict[str, int]) -> list[str]:
    names = list(mesh_shape)
    dims = [mesh_shape[a] for a in names]
    if not group or max(group) >= math.prod(dims):
        return []
    coords = np.array(np.unravel_index(group, dims))
    return [names[i] for i in range(len(names)) if len(set(coords[i])) > 1]


@dataclass
class Collective:
    kind: str
    bytes: float
    group_size: int
    axes: list[str]
    count: float
    shape: str
    crosses_hosts: bool = False

    @property
    def wire_bytes(self) -> float:
        n = self.group_size
        if self.kind == "collective-permute":
            return self.bytes
        if n <= 1:
            return 0.0
        factor = 2 * (n - 1) / n if self.kind == "all-reduce" else (n - 1) / n
        return factor * self.bytes


LINKS = ("within_host", "across_hosts")


def _pairs(attrs: str) -> list[list[int]]:
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
    if not m:
        return []
    return [[int(x) for x in g.split(",")] for g in re.findall(r"\{(\d+,\d+)", m.group(0))]


def _crosses(groups: list[list[int]], hosts) -> bool:
    return any(len({hosts[d] for d in g if d < len(hosts)}) > 1 for g in groups)


def collectives(mod: Module, mesh_shape: dict[str, int],
                mult: dict[str, float] | None = None, hosts=None) -> list[Collective]:
    """Every collective the step runs, with how often; `hosts`: the host of each mesh
    position (flattened), to class each by the links it crosses."""
    n_devices = math.prod(mesh_shape.values()) if mesh_shape else 1
    mult = multiplicities(mod) if mult is None else mult
    found = []
    for comp, instrs in mod.computations.items():
        times = mult.get(comp, 0.0)
        if not times:
            continue
        for ins in instrs:
            kind = ins.opcode.removesuffix("-start")
            if kind not in COLLECTIVE_KINDS:
                continue
            operand_bytes = sum(shape_bytes(mod.shapes.get(o, "")) for o in ins.operands)
            groups = _group_ids(ins.attrs, n_devices)
            group = groups[0] if groups else list(range(n_devices))
            size = len(group) if kind != "collective-permute" else 2
            nbytes = operand_bytes * size if kind == "all-gather" else operand_bytes
            axes = _axes_of_group(group, mesh_shape) if kind != "collective-permute" else []
            crosses = False
            if hosts is not None:
                crosses = _crosses(_pairs(ins.attrs) if kind == "collective-permute"
                                   else groups or [group], hosts)
            found.append(Collective(kind, nbytes, size, axes, times, ins.shape, crosses))
    return found


def dot_flops(mod: Module, mult: dict[str, float] | None = None) -> float:
    """2 x output elements x contracted size, summed over every dot (loops counted)."""
    mult = multiplicities(mod) if mult is None else mult
    total = 0.0
    for comp, instrs in mod.computations.items():
        times = mult.get(comp, 0.0)
        for ins in instrs:
            if ins.opcode != "dot" or not times:
                continue
            out = math.prod(_dims(ins.shape))
            lhs = _dims(mod.shapes.get(ins.operands[0], ""))
            m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
            k = math.prod(lhs[int(i)] for i in m.group(1).split(",") if i) if m else 1
            total += 2.0 * out * k * times
    return total


# Instructions that run as work of their own (a kernel, a library call, a collective)
# rather than inside a fusion or as bookkeeping (parameters, tuples, bitcasts).
_BOOKKEEPING = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast",
                "while", "conditional", "call", "after-all", "partition-id", "replica-id",
                "opt-barrier", "add-dependency"}


def kernel_count(mod: Module, mult: dict[str, float] | None = None) -> float:
    """Kernels one step launches (loops counted): the instructions of every computation
    that is not a fusion's body, bookkeeping left out. Each costs a launch and a
    synchronisation however small it is: what FLOPs and bytes miss on small models."""
    mult = multiplicities(mod) if mult is None else mult
    fused = {c for instrs in mod.computations.values() for ins in instrs
             if ins.opcode == "fusion" for c in re.findall(r"\bcalls=%?([\w.\-]+)", ins.attrs)}
    reducers = {c for instrs in mod.computations.values() for ins in instrs
                for c in re.findall(r"\bto_apply=%?([\w.\-]+)", ins.attrs)}
    total = 0.0
    for comp, instrs in mod.computations.items():
        if comp in fused or comp in reducers:
            continue
        n = sum(1 for ins in instrs if ins.opcode not in _BOOKKEEPING)
        total += n * mult.get(comp, 0.0)
    return total


def analyze(compiled, mesh_shape: dict[str, int],
            branch_weights: dict[int, list[float]] | None = None, hosts=None) -> dict:
    """Per-device figures of a compiled (jax `Compiled`) step; `hosts` as for
    `collectives`."""
    mod = parse_hlo(compiled.as_text())
    mult = multiplicities(mod, branch_weights)
    colls = collectives(mod, mesh_shape, mult, None if hosts is None else list(hosts))
    by_kind = {k: 0.0 for k in COLLECTIVE_KINDS}
    wire = {k: 0.0 for k in COLLECTIVE_KINDS}
    for c in colls:
        by_kind[c.kind] += c.bytes * c.count
        wire[c.kind] += c.wire_bytes * c.count
    flops = dot_flops(mod, mult)
    try:
        xla_flops = float(compiled.cost_analysis().get("flops", 0.0))
    except Exception:  # some backends have no cost model
        xla_flops = 0.0
    mem = compiled.memory_analysis()
    memory = {}
    if mem is not None:
        memory = {
            "argument_bytes": int(mem.argument_size_in_bytes),
            "output_bytes": int(mem.output_size_in_bytes),
            "temp_bytes": int(mem.temp_size_in_bytes),
            "alias_bytes": int(mem.alias_size_in_bytes),
            "generated_code_bytes": int(mem.generated_code_size_in_bytes),
        }
        memory["total_bytes"] = (memory["argument_bytes"] + memory["output_bytes"]
                                 + memory["temp_bytes"] - memory["alias_bytes"])
    detail: dict[tuple, dict] = {}
    for c in colls:
        key = (c.kind, c.shape, c.group_size, tuple(c.axes), c.crosses_hosts)
        row = detail.setdefault(key, {"kind": c.kind, "shape": c.shape, "group_size": c.group_size,
                                      "axes": list(c.axes), "crosses_hosts": c.crosses_hosts,
                                      "count": 0.0, "bytes": 0.0, "wire_bytes": 0.0})
        row["count"] += c.count
        row["bytes"] += c.bytes * c.count
        row["wire_bytes"] += c.wire_bytes * c.count
    by_link = dict.fromkeys(LINKS, 0.0)
    wire_link = dict.fromkeys(LINKS, 0.0)
    for c in colls:
        link = LINKS[c.crosses_hosts]
        by_link[link] += c.bytes * c.count
        wire_link[link] += c.wire_bytes * c.count
    by_axes: dict[str, float] = {}
    for c in colls:
        if c.wire_bytes:
            name = ",".join(c.axes) or "-"
            by_axes[name] = by_axes.get(name, 0.0) + c.wire_bytes * c.count
    return {
        # Matmul FLOPs from the HLO; XLA's estimate is the fallback where dots are
        # hidden in library calls (GPU cuBLAS custom calls).
        "flops_per_device": flops if flops > 0 else xla_flops,
        "xla_cost_flops": xla_flops,
        "collectives": by_kind,
        "collectives_wire": wire,
        # Ring wire bytes per group of mesh axes the collectives run over.
        "wire_by_axes": dict(sorted(by_axes.items(), key=lambda kv: -kv[1])),
        # Collective bytes (as `collectives`) and ring wire bytes by the links they
        # cross: within one host, or across hosts.
        "bytes_by_link": by_link,
        "wire_by_link": wire_link,
        "hosts": len(set(hosts)) if hosts is not None else 1,
        "collective_ops": sorted(detail.values(), key=lambda r: -r["bytes"]),
        "memory": memory,
        "kernels": kernel_count(mod, mult),
    }
