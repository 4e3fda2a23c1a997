"""Compile-only figures of a step: FLOPs, bytes of each collective, memory per device.

Read (through plait.hlo) from the optimized, SPMD-partitioned HLO that XLA will
run on one device, so they are deterministic and can be asserted in tests. XLA's own
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

Given the host of every mesh position (`hosts`, from plait.hosts.host_layout),
each collective is classed by the links it crosses: within one host, or across
hosts (its group, or one of a permute's pairs, spans several), and reported per
class (`bytes_by_link`, `wire_by_link`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from plait import hlo

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                    "collective-permute")


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


def _crosses(groups: list[list[int]], hosts) -> bool:
    return any(len({hosts[d] for d in g if d < len(hosts)}) > 1 for g in groups)


def collectives(mod: hlo.Module, mesh_shape: dict[str, int],
                mult: dict[str, float] | None = None, hosts=None) -> list[Collective]:
    """Every collective the step runs, with how often; `hosts`: the host of each mesh
    position (flattened), to class each by the links it crosses."""
    n_devices = math.prod(mesh_shape.values()) if mesh_shape else 1
    mult = hlo.multiplicities(mod) if mult is None else mult
    found = []
    for comp, instrs in mod.computations.items():
        times = mult.get(comp, 0.0)
        if not times:
            continue
        for ins in instrs:
            kind = ins.opcode.removesuffix("-start")
            if kind not in COLLECTIVE_KINDS:
                continue
            operand_bytes = sum(hlo.shape_bytes(mod.shapes.get(o, "")) for o in ins.operands)
            groups = hlo.group_ids(ins.attrs, n_devices)
            group = groups[0] if groups else list(range(n_devices))
            size = len(group) if kind != "collective-permute" else 2
            nbytes = operand_bytes * size if kind == "all-gather" else operand_bytes
            pairs = hlo.permute_pairs(ins.attrs) if kind == "collective-permute" else []
            if kind == "collective-permute":  # the axes any sender and receiver differ in
                differ = {a for pair in pairs for a in _axes_of_group(pair, mesh_shape)}
                axes = [a for a in mesh_shape if a in differ]
            else:
                axes = _axes_of_group(group, mesh_shape)
            crosses = False
            if hosts is not None:
                crosses = _crosses(pairs if kind == "collective-permute"
                                   else groups or [group], hosts)
            found.append(Collective(kind, nbytes, size, axes, times, ins.shape, crosses))
    return found


def dot_flops(mod: hlo.Module, mult: dict[str, float] | None = None) -> float:
    """2 x output elements x contracted size, summed over every dot (loops counted)."""
    mult = hlo.multiplicities(mod) if mult is None else mult
    total = 0.0
    for comp, instrs in mod.computations.items():
        times = mult.get(comp, 0.0)
        for ins in instrs:
            if ins.opcode == "dot" and times:
                total += one_dot_flops(mod, ins) * times
    return total


def one_dot_flops(mod: hlo.Module, ins: hlo.Instr) -> float:
    """2 x output elements x contracted size of one dot instruction."""
    out = math.prod(hlo._dims(ins.shape))
    lhs = hlo._dims(mod.shapes.get(ins.operands[0], ""))
    m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
    k = math.prod(lhs[int(i)] for i in m.group(1).split(",") if i) if m else 1
    return 2.0 * out * k


# Instructions that run as work of their own (a kernel, a library call, a collective)
# rather than inside a fusion or as bookkeeping (parameters, tuples, bitcasts).
_BOOKKEEPING = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast",
                "while", "conditional", "call", "after-all", "partition-id", "replica-id",
                "opt-barrier", "add-dependency"}


def launched(mod: hlo.Module, mult: dict[str, float] | None = None
             ) -> list[tuple[hlo.Instr, float]]:
    """Each instruction that runs as work of its own, with how many times a step (loops
    counted): those of every computation that is not a fusion's body or a reducer's,
    bookkeeping left out."""
    mult = hlo.multiplicities(mod) if mult is None else mult
    fused = {c for instrs in mod.computations.values() for ins in instrs
             if ins.opcode == "fusion" for c in re.findall(r"\bcalls=%?([\w.\-]+)", ins.attrs)}
    reducers = {c for instrs in mod.computations.values() for ins in instrs
                for c in re.findall(r"\bto_apply=%?([\w.\-]+)", ins.attrs)}
    return [(ins, mult[comp]) for comp, instrs in mod.computations.items()
            if comp not in fused and comp not in reducers and mult.get(comp)
            for ins in instrs if ins.opcode not in _BOOKKEEPING]


def kernel_count(mod: hlo.Module, mult: dict[str, float] | None = None) -> float:
    """Kernels one step launches (`launched`). Each costs a launch and a synchronisation
    however small it is: what FLOPs and bytes miss on small models."""
    return sum(times for _, times in launched(mod, mult))


def memory_of(compiled) -> dict[str, int]:
    """A compiled program's memory per device by XLA's buffer assignment; `total_bytes`
    is what it holds at once (arguments, outputs and temporaries, less the outputs that
    reuse donated arguments). {} where the backend does not say."""
    try:
        mem = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - not every backend implements it
        mem = None
    if mem is None:
        return {}
    memory = {
        "argument_bytes": int(mem.argument_size_in_bytes),
        "output_bytes": int(mem.output_size_in_bytes),
        "temp_bytes": int(mem.temp_size_in_bytes),
        "alias_bytes": int(mem.alias_size_in_bytes),
        "generated_code_bytes": int(mem.generated_code_size_in_bytes),
    }
    memory["total_bytes"] = (memory["argument_bytes"] + memory["output_bytes"]
                             + memory["temp_bytes"] - memory["alias_bytes"])
    return memory


def analyze(compiled, mesh_shape: dict[str, int],
            branch_weights: dict[int, list[float]] | None = None, hosts=None) -> dict:
    """Per-device figures of a compiled (jax `Compiled`) step; `hosts` as for
    `collectives`."""
    mod = hlo.parse_hlo(compiled.as_text())
    mult = hlo.multiplicities(mod, branch_weights)
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
    memory = memory_of(compiled)
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
