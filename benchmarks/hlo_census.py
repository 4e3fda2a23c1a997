"""The kernels of a compiled GPU program, read from its optimized HLO text, with the
time a roofline gives each: what `gpu_census.py` prints for a step compiled for a GPU
that is not there.

Every instruction of an executed computation (the entry, loop bodies, conditional
branches) that launches work -- a fusion, a library call (cuBLAS, cuDNN), a copy -- is
one kernel per execution (`plait.analysis.launched`, what `plait inspect` counts);
loop bodies count their trip count, a conditional's branches as
`plait.hlo.multiplicities` counts them. A kernel's bytes are what it reads and
writes: its operands and its result, except that an operand read only through
(dynamic-)slices counts the slices, and a buffer updated in place
(dynamic-update-slice) counts the update, not the buffer. Its FLOPs: a matrix
product's 2 x output x contracted size; cuDNN's causal attention 2 x batch x heads x
seq^2 x head_dim forward and 2.5 x that backward. Its time: the larger of FLOPs at
`matmul_efficiency` x peak (an FP8 product's peak twice bf16's) and bytes at
`memory_efficiency` x bandwidth (attention's FLOPs at `attention_efficiency`), plus a
fixed cost per launch -- no overlap, one efficiency per kind: rates fitted to kernels
an H100 ran (MATMUL_EFFICIENCY ... below), an estimate to compare programs by, not a
measurement.
"""

from __future__ import annotations

import collections
import math
import re
from dataclasses import dataclass

from kernel_profile import jax_op, kind_of  # benchmarks/ is the script's directory

from plait import hlo
from plait.analysis import launched, one_dot_flops


@dataclass
class Kernel:
    name: str
    kind: str
    launches: float  # per step
    bytes: float  # per launch
    flops: float  # per launch
    seconds: float = 0.0  # per step, once estimated
    shape: str = ""
    fp8: bool = False  # an FP8 product: twice the bf16 peak
    op: str = ""  # the JAX operation that made it (its op_name, less the jit's)


def _called(ins: hlo.Instr) -> str | None:
    m = re.search(r"calls=%?([\w.\-]+)", ins.attrs)
    return m.group(1) if m else None


def _matmul_flops(mod: hlo.Module, ins: hlo.Instr) -> float:
    out = hlo._dims(ins.shape)  # the first array of a (result, workspace) tuple
    lhs = hlo._dims(mod.shapes.get(ins.operands[0], ""))
    m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', ins.attrs)
    k = 1
    for d in (m.group(1).replace('"', "").split(",") if m else []):
        if d.strip():
            k *= lhs[int(d)]
    n = 1
    for d in out:
        n *= d
    return 2.0 * n * k


def _attention_flops(mod: hlo.Module, ins: hlo.Instr, target: str) -> float:
    """Causal flash attention: q [batch, seq, heads, head_dim] in either middle order
    (the longer middle dimension is taken for the sequence)."""
    q = hlo._dims(mod.shapes.get(ins.operands[0], ""))
    if len(q) != 4:
        return 0.0
    b, x, y, d = q
    seq, heads = max(x, y), min(x, y)
    forward = 2.0 * b * heads * seq * seq * d
    return forward * (2.5 if "Backward" in target else 1.0)


def _read_bytes(mod: hlo.Module, ins: hlo.Instr) -> float:
    body = mod.computations.get(_called(ins) or "", []) if ins.opcode == "fusion" else []
    params = {int(j.operands[0]): j.name for j in body
              if j.opcode == "parameter" and j.operands and j.operands[0].isdigit()}
    total = 0.0
    for i, operand in enumerate(ins.operands):
        size = hlo.shape_bytes(mod.shapes.get(operand, ""))
        name = params.get(i)
        users = [j for j in body if name in j.operands] if name else []
        sliced = _sliced_bytes(body, name) if name else None
        if sliced is not None:
            size = min(size, sliced)
        elif users and all(j.opcode == "dynamic-update-slice" and j.operands[0] == name
                           for j in users):
            size = 0.0  # the buffer updated in place is not read
        total += size
    return total


_RELAYOUT = ("bitcast", "convert", "reshape", "copy")


def _sliced_bytes(body: list, name: str, scale: float = 1.0) -> float | None:
    """The bytes of `name` a fusion reads when it reads it only through (dynamic-)
    slices, possibly after bitcasts and converts (a row's first value, cast to float32:
    the slices' elements at the operand's width); None when it reads it otherwise."""
    users = [j for j in body if name in j.operands]
    if not users:
        return None
    total = 0.0
    for j in users:
        if j.opcode in ("dynamic-slice", "slice") and j.operands[0] == name:
            total += hlo.shape_bytes(j.shape) * scale
        elif j.opcode in _RELAYOUT:
            size = hlo.shape_bytes(j.shape)
            source = next((k.shape for k in body if k.name == name), "")
            ratio = hlo.shape_bytes(source) / size if size and source else 1.0
            inner = _sliced_bytes(body, j.name, scale * ratio)
            if inner is None:
                return None
            total += inner
        else:
            return None
    return total


def _written_bytes(mod: hlo.Module, ins: hlo.Instr) -> float:
    body = mod.computations.get(_called(ins) or "", []) if ins.opcode == "fusion" else []
    updates = [j for j in body if j.opcode == "dynamic-update-slice"]
    if updates:
        return sum(hlo.shape_bytes(mod.shapes.get(j.operands[1], "")) for j in updates)
    first = hlo._ARRAY.search(ins.shape)
    if "$matmul" in ins.attrs and first:  # cuBLAS's (result, workspace): the result
        return hlo.shape_bytes(first.group(0))
    return hlo.shape_bytes(ins.shape)


# plait.parallel.grouped_pallas's calls of JAX's grouped GEMM kernels for Hopper (Mosaic
# GPU custom calls, priced as products: a roofline by bytes alone put them at a tenth of
# their FLOPs' time)
_GROUPED_PALLAS = re.compile(r'op_name="[^"]*\((_ragged_call|_transposed_call)\)')


def _grouped_flops(mod: hlo.Module, ins: hlo.Instr) -> float:
    """2 x rows x contracted x output columns of a grouped product: the operands are
    (group sizes, rows [M, K], ...) and the output [M, N] (ragged) or [G, K, N]
    (transposed): 2 x the rows' elements x the output's last dimension either way."""
    rows = hlo._dims(mod.shapes.get(ins.operands[1], "")) if len(ins.operands) > 1 else []
    out = hlo._dims(ins.shape)
    return 2.0 * math.prod(rows) * out[-1] if rows and out else 0.0


def kernels(text: str, sized_branch: int = 0) -> list[Kernel]:
    """Every kernel the optimized HLO `text` launches per step; a switch among sizes the
    data chooses (plait.hlo.SIZED_BY_DATA: dropless experts' spill) at its
    `sized_branch`-th size (0: the first, the smallest)."""
    mod = hlo.parse_hlo(text)
    out = []
    for ins, times in launched(mod, hlo.multiplicities(mod, sized_branch=sized_branch)):
        flops, name = 0.0, ins.name
        if ins.opcode == "dot":
            flops = one_dot_flops(mod, ins)
        elif ins.opcode == "fusion":  # a Triton GEMM, a dot XLA fused
            flops = sum(one_dot_flops(mod, j) for j in
                        mod.computations.get(_called(ins) or "", []) if j.opcode == "dot")
        elif ins.opcode == "custom-call":
            target = re.search(r'custom_call_target="([^"]*)"', ins.attrs)
            name = target.group(1) if target else ins.name
            if "matmul" in name or "gemm" in name:
                flops = _matmul_flops(mod, ins)
            elif "fmha" in name:
                flops = _attention_flops(mod, ins, name)
            elif name.startswith("mosaic_gpu") and _GROUPED_PALLAS.search(ins.attrs):
                flops, name = _grouped_flops(mod, ins), "mosaic_gpu grouped gemm"
        op = re.search(r'op_name="([^"]*)"', ins.attrs)
        out.append(Kernel(name=ins.name, kind=kind_of(name), launches=times,
                          bytes=_read_bytes(mod, ins) + _written_bytes(mod, ins),
                          flops=flops, shape=ins.shape[:90], fp8="$f8" in name,
                          op=jax_op(op.group(1)) if op else ""))
    return out


# Fitted to three steps profiled on an H100 on 2026-11-26 (gpt2-124m, gpt2-1.3b,
# mixtral-mini: benchmarks/results/h100-2026-11-26c, docs/benchmarks.md "A fourth GPU
# session"): cuBLAS's products ran at 0.68-0.71 of the bf16 peak, the memory-bound
# fusions and reductions at 0.53-0.72 of the bandwidth (0.85 had been assumed), cuDNN's
# causal flash attention at head_dim 64 (its helper kernels included) at 0.23 (seq
# 1024) to 0.30 (seq 2048) of the peak, and a kernel took ~2 us more than its roofline
# (launch, ramp, the gap to the next): with these the three estimates come within 1-7%
# of the kernels' measured time, where the old rates were 20-30% under.
MATMUL_EFFICIENCY = 0.70
MEMORY_EFFICIENCY = 0.60
ATTENTION_EFFICIENCY = 0.25
LAUNCH_S = 2e-6


def estimate(found: list[Kernel], peak_flops: float, bandwidth: float,
             matmul_efficiency: float = MATMUL_EFFICIENCY,
             memory_efficiency: float = MEMORY_EFFICIENCY,
             attention_efficiency: float = ATTENTION_EFFICIENCY,
             launch_s: float = LAUNCH_S) -> float:
    """Fill each kernel's seconds per step; returns their sum. `peak_flops` is bf16's
    (FP8 products get twice it)."""
    for k in found:
        peak = peak_flops * (2 if k.fp8 else 1)
        rate = peak * (attention_efficiency if k.kind == "attention" else matmul_efficiency)
        k.seconds = k.launches * (max(k.flops / rate, k.bytes / (bandwidth * memory_efficiency))
                                  + launch_s)
    return sum(k.seconds for k in found)


def by_group(found: list[Kernel], top: int) -> list[dict]:
    """Kernels summed by name with XLA's numbering and clone suffixes taken off (one row
    per kind of fusion, per library call), largest time first."""
    groups: dict[str, list] = collections.defaultdict(lambda: [0.0, 0.0, 0.0, "", ""])
    for k in found:
        base = re.sub(r"\.(remat\d*|double_buffer_clone)", "", k.name)
        key = re.sub(r"(\.\d+)+$", "", base)
        g = groups[key]
        g[0] += k.launches
        g[1] += k.bytes * k.launches
        g[2] += k.seconds
        g[3], g[4] = k.kind, k.shape
    rows = sorted(groups.items(), key=lambda kv: -kv[1][2])[:top]
    return [{"group": key, "kind": g[3], "launches": round(g[0]), "gb": round(g[1] / 1e9, 3),
             "ms": round(g[2] * 1e3, 3), "shape": g[4]} for key, g in rows]


def by_op(found: list[Kernel], top: int) -> list[dict]:
    """Kernels summed by the JAX operation that made them (autodiff's transpose of a
    product, a norm's reduction, the optimizer's update), largest time first: which
    line of the model a group of kernels comes from."""
    groups: dict[tuple, list] = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
    for k in found:
        g = groups[(k.kind, k.op or "(none)")]
        g[0] += k.launches
        g[1] += k.bytes * k.launches
        g[2] += k.seconds
    rows = sorted(groups.items(), key=lambda kv: -kv[1][2])[:top]
    return [{"op": op, "kind": kind, "launches": round(g[0]), "gb": round(g[1] / 1e9, 3),
             "ms": round(g[2] * 1e3, 3)} for (kind, op), g in rows]


TINY_BYTES = 1e6


def _tiny(k: Kernel) -> bool:
    return k.bytes < TINY_BYTES and not k.flops


def tiny_launches(found: list[Kernel]) -> int:
    """Launches a step of kernels that move under a megabyte and multiply nothing: the
    roofline prices them at about nothing, a GPU at a few microseconds each."""
    return round(sum(k.launches for k in found if _tiny(k)))


def tiny_by_op(found: list[Kernel], top: int) -> list[dict]:
    """The tiny kernels (`tiny_launches`) counted by the JAX operation that made them,
    most launches first: which per-parameter work they are (the optimizer's updates, the
    gradient norm's sums, the casts to the compute dtype, the biases' reductions)."""
    counts: collections.Counter = collections.Counter()
    for k in found:
        if _tiny(k):
            counts[(k.kind, k.op or "(none)")] += k.launches
    return [{"op": op, "kind": kind, "launches": round(n)}
            for (kind, op), n in counts.most_common(top)]


def by_kind(found: list[Kernel]) -> dict[str, dict]:
    kinds: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
    for k in found:
        v = kinds[k.kind]
        v[0] += k.launches
        v[1] += k.seconds
        v[2] += k.bytes * k.launches
    return {kind: {"launches": round(v[0]), "ms": round(v[1] * 1e3, 3),
                   "gb": round(v[2] / 1e9, 3)}
            for kind, v in sorted(kinds.items(), key=lambda kv: -kv[1][1])}
