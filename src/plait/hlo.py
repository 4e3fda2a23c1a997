"""Reading XLA's optimized HLO text: computations and their instructions, array
shapes and bytes, how often each computation runs per step, and the device
groups of a collective (replica groups, a permute's source-target pairs).

What plait.analysis counts (FLOPs, collective bytes, kernels) it reads through
this module, so the text format's quirks live in one place.
"""

from __future__ import annotations

import functools
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s4": 0.5, "u4": 0.5, "f8e4m3fn": 1, "f8e5m2": 1,
    "f8e4m3": 1, "f8e5m2fnuz": 1, "f8e4m3fnuz": 1, "f8e4m3b11fnuz": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}
# A jax.named_scope for a lax.switch whose branch the data chooses among sizes of one
# computation, smallest first (parallel.grouped's spill): its FLOPs count the first,
# what a balanced routing takes, as a loop of unknown trip count counts one iteration.
SIZED_BY_DATA = "plait_sized_by_data"
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
    # XLA marks every fifth operand of a long list with a comment (/*index=5*/%x): not
    # part of the name (with it, a tuple all-reduce's every fifth operand went uncounted)
    inner = re.sub(r"/\*.*?\*/", "", rest[open_at + 1 : close])
    # operands printed without shapes (XLA's optimized text) need no bracket counting
    parts = _split_top(inner) if any(c in inner for c in "([{") else inner.split(",")
    operands = [p.split()[-1].lstrip("%") for p in parts if p.strip()]
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


def multiplicities(mod: Module, branch_weights: dict[int, list[float]] | None = None,
                   sized_branch: int = 0) -> dict[str, float]:
    """How many times each computation runs per step (loops weighted by trip count).

    A conditional's branches count once each per execution unless `branch_weights`
    gives, for conditionals with that many branches, how often each one runs per
    execution (a pipeline's per-tick switch: from its schedule table); one made under
    the SIZED_BY_DATA scope counts one branch only: its first (a balanced routing's),
    or the `sized_branch`-th (the last if there are fewer) to price a larger size.
    """
    weights = branch_weights or {}
    callees: dict[str, list[tuple[str, float]]] = defaultdict(list)
    for comp, instrs in mod.computations.items():
        for ins in instrs:
            trip = 1.0
            if ins.opcode == "while":
                t = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.attrs)
                trip = float(t.group(1)) if t else 1.0
            loop, called, indexed = _callees(ins.attrs)
            callees[comp] += [(c, trip) for c in loop] + [(c, 1.0) for c in called]
            w = weights.get(len(indexed), [1.0] * len(indexed))
            if indexed and SIZED_BY_DATA in ins.attrs:
                w = [0.0] * len(indexed)
                w[min(sized_branch, len(indexed) - 1)] = 1.0
            callees[comp] += list(zip(indexed, w, strict=True))
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


def group_ids(attrs: str, n_devices: int) -> list[list[int]] | None:
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


def _named(attrs: str, *keys: str) -> list[str]:
    return [c for key in keys for c in re.findall(rf"\b{key}=%?([\w.\-]+)", attrs)]


_CALLEE = re.compile(r"\b(body|condition|calls|true_computation|false_computation)"
                     r"=%?([\w.\-]+)")
_BRANCH_LIST = re.compile(r"branch_computations=\{([^}]*)\}")
_LOOP_KEYS, _ONCE_KEYS = ("body", "condition"), ("calls", "true_computation",
                                                  "false_computation")


@functools.lru_cache(maxsize=1 << 16)
def _callees(attrs: str) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """The computations an instruction runs: (a loop's body and condition, those it
    calls once -- fusions, calls, a conditional's true/false --, a conditional's indexed
    branches). Cached: the checks of one program ask it of every instruction several
    times (a pipelined step's checks before its first step took a second on a CPU)."""
    found: dict[str, list[str]] = defaultdict(list)
    for key, name in _CALLEE.findall(attrs):
        found[key].append(name)
    indexed = tuple(c.strip().lstrip("%") for group in _BRANCH_LIST.findall(attrs)
                    for c in group.split(","))
    return (tuple(c for k in _LOOP_KEYS for c in found[k]),
            tuple(c for k in _ONCE_KEYS for c in found[k]), indexed)


def branches(attrs: str) -> list[str]:
    """The computations a conditional chooses between (true/false, or indexed)."""
    _, _, indexed = _callees(attrs)
    return list(indexed) or _named(attrs, "true_computation", "false_computation")


def permute_pairs(attrs: str) -> list[list[int]]:
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
    if not m:
        return []
    return [[int(x) for x in g.split(",")] for g in re.findall(r"\{(\d+,\d+)", m.group(0))]


def ops_in_branches(mod: Module, opcode: str) -> list[Instr]:
    """Every instruction of `opcode` (or its -start form) that runs inside a conditional's
    branch, however deeply nested. A pipelined step's ranks take different branches of
    the per-tick switch at once, so a collective there must be one that only the ranks
    taking that branch join; XLA:CPU's collective-permute waits for every device of the
    program, and deadlocks there."""
    found: list[Instr] = []
    seen: set[str] = set()
    todo = [b for instrs in mod.computations.values() for ins in instrs
             if ins.opcode == "conditional" for b in branches(ins.attrs)]
    while todo:
        comp = todo.pop()
        if comp in seen or comp not in mod.computations:
            continue
        seen.add(comp)
        for ins in mod.computations[comp]:
            if ins.opcode in (opcode, f"{opcode}-start"):
                found.append(ins)
            todo += [c for part in _callees(ins.attrs) for c in part]
    return found


_COLLECTIVE = re.compile(r"^(all-reduce|all-gather|reduce-scatter|all-to-all|"
                         r"collective-permute|collective-broadcast|ragged-all-to-all)"
                         r"(-start)?$")


def _runs_collective(mod: Module, ins: Instr, memo: dict[str, bool]) -> bool:
    """Whether running `ins` runs a collective: it is one, or a computation it calls
    (a loop's, a call's, a conditional's branches) holds one, however deep."""
    return bool(_COLLECTIVE.match(ins.opcode)) or any(
        _holds_collective(mod, c, memo) for part in _callees(ins.attrs) for c in part)


def _holds_collective(mod: Module, comp: str, memo: dict[str, bool]) -> bool:
    """Whether running `comp` runs a collective, in it or in anything it calls."""
    if comp not in memo:
        memo[comp] = False  # a cycle (none in HLO) would read as "no"
        memo[comp] = any(_runs_collective(mod, ins, memo)
                         for ins in mod.computations.get(comp, []))
    return memo[comp]


def _upstream(by_name: dict[str, Instr], name: str) -> set[str]:
    """Every instruction of the computation whose result `name` reads, however
    indirectly."""
    seen: set[str] = set()
    todo = [o for o in by_name[name].operands if o in by_name]
    while todo:
        o = todo.pop()
        if o not in seen:
            seen.add(o)
            todo += [p for p in by_name[o].operands if p in by_name]
    return seen


def unordered_beside_conditionals(mod: Module) -> list[tuple[Instr, Instr]]:
    """(conditional, instruction) pairs of one computation where the conditional holds a
    collective, the instruction runs one (a collective, or a loop, call or conditional
    holding one), and neither reads the other's result, however indirectly. XLA:CPU does
    not order such a pair: one device can enter the conditional's collective while its
    partner waits in the other one, and the step hangs until XLA aborts the process
    (docs/architecture.md, "Data replicas that meet a sharded center")."""
    memo: dict[str, bool] = {}
    found: list[tuple[Instr, Instr]] = []
    for instrs in mod.computations.values():
        runs = [ins for ins in instrs if _runs_collective(mod, ins, memo)]
        conds = [ins for ins in runs if ins.opcode == "conditional"]
        if not conds or len(runs) < 2:
            continue
        by_name = {ins.name: ins for ins in instrs}
        upstream = {ins.name: _upstream(by_name, ins.name) for ins in runs}
        found += [(cond, other) for cond in conds for other in runs
                  if other is not cond and other.name not in upstream[cond.name]
                  and cond.name not in upstream[other.name]]
    return found
