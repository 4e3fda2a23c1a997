"""Bytes each tensor-parallel mode moves per device per step, from the papers' formulas.

Counted as what one device receives with ring collectives (an all-gather or
reduce-scatter over g devices of an n-element array: (g-1)/g * n; an
all-reduce: 2(g-1)/g * n), the same measure `analysis` reads from compiled HLO.

For a linear layer Y[T, n] = X[T, k] W[k, n] (T tokens of one tensor group):

- 1-D, Megatron (Shoeybi et al. 2019) on p devices: an attention or MLP block
  all-reduces its [T, h] output forward and its [T, h] input gradient backward:
  2 * 2(p-1)/p * T h per block.
- 2-D, Optimus (Xu et al. 2021) on a q x q grid, and 2.5-D, Tesseract (Wang et
  al. 2021) with d such grids: X is gathered over the grid's columns and W over
  its rows, (q-1)/q^2 * (T k / d + k n) forward; the backward reduce-scatters
  the same volumes; 2.5-D also sums W's gradient over the d grids,
  2(d-1)/d * k n / q^2.
- 3-D (Bian et al. 2021) on a q x q x q cube: X and W gathered and Y
  reduce-scattered, (q-1)/q^3 * (T k + k n + T n) forward, the same backward.

Weight-gradient reductions recur once per microbatch. With `model.remat` the
forward of each block is recomputed in the backward, repeating the
collectives whose results the backward needs (all except the reduction of the
block's final output). Weight gathers recur per microbatch and per
recomputation when the layers are scanned (`model.scan_layers`), as in the
papers. With unrolled layers XLA hoists them out of the microbatch loop, and
with one microbatch shares them with the recomputed forward; with several
microbatches and remat the recomputation gathers again per microbatch. That
is modelled as measured (jax 0.10.2, CPU), so compiled and predicted bytes
agree within ~1% in every combination the tests compile.

The embedding lookup is the matmul one_hot(ids) @ table and costs what a
linear with a T x V input would, less the input term; with tied embeddings
the head and the lookup share one forward gather of the table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from plait import mesh as mesh_lib
from plait.config import Experiment


@dataclass(frozen=True)
class Counts:
    """Elements received per device per step, split by where they come from."""

    layers: float
    embedding_head: float

    @property
    def total(self) -> float:
        return self.layers + self.embedding_head


def _gs(g: int) -> float:
    """Fraction of an array a device receives in an all-gather / reduce-scatter over g."""
    return (g - 1) / g


def tensor_elements(exp: Experiment, sizes: dict[str, int]) -> Counts:
    """Elements of tensor-axis traffic per device per step for this experiment and mesh."""
    m = exp.model
    mode = mesh_lib.tensor_mode(sizes)
    h, f, V, L = m.d_model, m.d_ff, m.padded_vocab, m.layers
    M = exp.train.microbatches
    T = exp.train.global_batch * m.seq_len / (sizes.get("data", 1) * sizes.get("fsdp", 1))
    H, KV = m.heads * m.head_size, 2 * m.n_kv_heads * m.head_size
    up = f * (2 if m.mlp == "swiglu" else 1)  # SwiGLU's gate and up: one [h, 2f] matmul
    # (k, n, whether its input's forward gather is another linear's: grouped-query
    # attention's key/value projection reads the gathered input of the query projection)
    qkv = [(h, H + KV, False)] if m.fused_qkv else [(h, H, False), (h, KV, True)]
    linears = [*qkv, (H, h, False), (h, up, False), (f, h, False)]
    remat = m.remat != "none"  # every policy counted as full: an upper bound
    # Sets of weight gathers per step (see the module docstring).
    w_sets = M * (2 if remat else 1) if m.scan_layers is True else 1 + (M if remat and M > 1 else 0)
    tables = 3 if m.tie_embeddings else 4  # forward gathers + gradient reductions of V x h

    if mode is None:
        return Counts(0.0, 0.0)
    if mode == "1d":
        p = sizes["tensor"]
        ar = 2 * _gs(p) * T * h
        return Counts(L * ((4 + (1 if remat else 0)) * ar + _gqa_1d(m, p, T, remat)), 2 * ar)
    if mode in ("2d", "2.5d"):
        q, d = sizes["tensor_row"], sizes.get("tensor_depth", 1)
        g = _gs(q) / q
        depth = 2 * _gs(d) / q**2 if d > 1 else 0.0
        layer = 0.0
        for k, n, shared in linears:
            x_term, w_term = g * T * k / d, g * k * n
            if shared and m.n_kv_heads % q:
                # key/value heads replicated over the columns: the projection reads the
                # queries' gathered input and its input gradient is a slice of a value
                # the columns share, but each column's query heads add to the keys' and
                # values' gradient, summed over the columns; its weight [k/q, n] is q
                # times a split one's
                layer += 2 * g * T * n / d + q * (w_term * (M + w_sets) + M * depth * k * n)
                continue
            # forward gather, input gradient's reduce-scatter, remat's gather again;
            # a projection reading another's gathered input shares both gathers
            layer += x_term * (1 if shared else 3 if remat else 2) + w_term * (M + w_sets)
            layer += M * depth * k * n
        # Lookup scatter + head input gather, forward and backward; table gathers
        # (one shared by lookup and head when tied) and gradient reductions.
        gathers = tables - 2
        emb = 4 * g * T * h / d + g * V * h * (2 * M + gathers) + 2 * M * depth * V * h
        if not m.tie_embeddings:
            emb += M * depth * V * h
        return Counts(L * layer, emb)
    q = sizes["tensor_x"]
    g = _gs(q) / q**2
    layer = 0.0
    for i, (k, n, shared) in enumerate(linears):
        x_term, w_term, y_term = g * T * k, g * k * n, g * T * n
        if shared and m.n_kv_heads % q:
            # key/value heads replicated over tensor_y (measured, as the 2-D case): the
            # input is not gathered; the product, reduce-scattered over z, is moved to
            # the queries' tokens (x, z) by a gather over y and two permutes, and its
            # gradient gathered back over z; the keys' and values' gradient is summed
            # over y (each rank's query heads add to it), and so is the weight's; the
            # weight [k/q^2, n] is q times a split one's. remat: the forward's three again.
            layer += (7 + (3 if remat else 0)) * y_term + 2 * w_term * M \
                + q * w_term * (M + w_sets)
            continue
        layer += (2 - shared) * x_term + 2 * y_term + w_term * (M + w_sets)
        if remat:
            layer += x_term * (not shared) + (y_term if i != len(linears) - 1 else 0.0)
    emb = 4 * g * T * h + 2 * g * T * V + g * V * h * (2 * M + tables - 2)
    return Counts(L * layer, emb)


def _gqa_1d(m, p: int, T: float, remat: bool) -> float:
    """Elements per layer that grouped-query attention adds under 1-D tensor parallelism
    (measured from the compiled step, jax 0.10.2, CPU). Key/value heads split over the
    ranks: the query and the key/value projections' input gradients are all-reduced
    apart, one more [T, h] all-reduce backward. Replicated (fewer key/value heads than
    ranks, each head shared by g = p / kv_heads ranks): the ranks' key/value heads are
    gathered forward, (kv - 1) T hd each for k and v, and each head's gradient summed
    over its g ranks backward, 2(g-1)/g T hd each."""
    if m.fused_qkv:
        return 0.0
    kv, hd = m.n_kv_heads, m.head_size
    if kv % p == 0:
        return 2 * _gs(p) * T * m.d_model
    g = max(p // kv, 1)
    gather = 2 * (kv - 1) * T * hd
    return gather * (2 if remat else 1) + 2 * 2 * _gs(g) * T * hd


def collective_width(exp: Experiment, platform: str = "gpu") -> int:
    """Bytes per element on the wire: the compute dtype, except that XLA's CPU backend
    runs bf16 collectives in fp32 (the compiled program upcasts them)."""
    if exp.precision.compute == "bfloat16" and platform != "cpu":
        return 2
    return 4


def tensor_bytes(exp: Experiment, sizes: dict[str, int], platform: str = "gpu") -> float:
    """Bytes per device per step; activations and gathered weights travel in the compute dtype."""
    return tensor_elements(exp, sizes).total * collective_width(exp, platform)


TENSOR_AXES = frozenset(a for axes in mesh_lib.TENSOR_MODES.values() for a in axes)


def tensor_wire_bytes(analysis: dict) -> float:
    """What the compiled step moves to compare with `tensor_bytes`: ring wire bytes of
    the collectives that run over tensor axes only (plait.analysis)."""
    return sum(b for axes, b in analysis["wire_by_axes"].items()
               if axes != "-" and set(axes.split(",")) <= TENSOR_AXES)


def context_elements(exp: Experiment, sizes: dict[str, int]) -> dict[str, float]:
    """Elements of the context axis's attention traffic per device per step, by the
    collective that carries it (parallel.context; measured equal to the compiled step).

    A block is one rank's keys (or values): B T / C tokens x its key/value heads x head
    size, B the rows of its data replica (a ring with key/value heads too few to split
    over tensor sends one per query head: parallel.context.attend). Ring: the forward
    sends C - 1 key blocks and C - 1 value blocks round; the backward's key/value sends
    are the same values in the same order, which XLA shares with the forward's (sent
    again under remat or stacked layers), and the float32 key/value gradients travel
    C - 1 steps with them and one home: 2(C - 1) [+ 2(C - 1) with remat or stacked
    layers] blocks in the compute dtype, 2C in float32. All-gather: 2(C - 1) blocks
    gathered forward (again under remat; stacked layers keep the gathered blocks for the
    backward); the gradients of the gathered keys and values are all-reduced over the
    axis, 2 x 2(C - 1) blocks, in the step's all-reduces (XLA fuses them with the
    weight-gradient reduction)."""
    m = exp.model
    C = sizes.get("context", 1)
    if C == 1:
        return {}
    p = sizes.get("tensor", 1)
    kv = m.n_kv_heads
    ring = exp.context.attention == "ring" and sizes.get("pipeline", 1) == 1
    # replicated over tensor where they do not split; a ring then sends one per query head
    per_rank = kv / p if kv % p == 0 else m.heads / p if ring else kv
    rows = exp.train.global_batch / (sizes.get("data", 1) * sizes.get("fsdp", 1))
    block = rows * m.seq_len / C * per_rank * m.head_size
    # Sent again in the backward: under remat; a ring's also in a scan over stacked
    # layers (the backward's scan cannot share the forward's sends).
    remat = m.remat != "none"
    L = m.layers
    if ring:
        again = 2 if remat or m.scan_layers is True else 1
        return {"kv": L * block * 2 * (C - 1) * again, "kv_grad_f32": L * block * 2 * C}
    return {"kv": L * block * 2 * (C - 1) * (2 if remat else 1),
            "kv_grad": L * block * 4 * (C - 1)}


def context_bytes(exp: Experiment, sizes: dict[str, int], platform: str = "gpu"
                  ) -> dict[str, float]:
    """Bytes per device per step of the context axis's attention traffic, by the kind of
    collective: {"collective-permute": ...} for the ring, {"all-gather": ..., "all-reduce":
    ...} for gathered keys and values (the all-reduce part rides in the step's gradient
    all-reduces over the axis)."""
    e = context_elements(exp, sizes)
    if not e:
        return {}
    w = collective_width(exp, platform)
    if "kv_grad_f32" in e:
        return {"collective-permute": e["kv"] * w + e["kv_grad_f32"] * 4}
    return {"all-gather": e["kv"] * w, "all-reduce": e["kv_grad"] * w}


def context_wire_bytes(analysis: dict) -> dict[str, float]:
    """The compiled step's wire bytes over the context axis alone, by kind of collective."""
    out: dict[str, float] = {}
    for op in analysis["collective_ops"]:
        if op["axes"] == ["context"]:
            out[op["kind"]] = out.get(op["kind"], 0.0) + op["wire_bytes"]
    return out


def expert_bytes(exp: Experiment, sizes: dict[str, int], platform: str = "gpu") -> float:
    """Bytes each device receives per step over the expert axis X, per sparse layer and
    microbatch:

    - capacity: the dispatch buffer of the device's rows (rows x experts x capacity x
      d_model, capacity = ceil(capacity_factor x seq x top_k / experts): about
      tokens x top_k x capacity_factor rows) crosses it by all-to-all to the experts and
      back, (X - 1) / X of it each time; the backward sends the gradients the same two
      ways, and a rematerialised forward sends it twice more.
    - dropless (all-gather dispatch): the device's N tokens are all-gathered across it
      and the outputs reduce-scattered back, (X - 1) N d_model each; the backward
      reduce-scatters the inputs' gradients and all-gathers the outputs'; a
      rematerialised forward gathers the tokens again (its reduce-scatter is not
      needed again). The routing travels too: the experts' indices and the gates
      (4 bytes each, N x top_k) are all-gathered with the tokens (again under remat)
      and the gates' gradients reduce-scattered back.

    Where `expert` alone splits the rows, GSPMD also all-gathers the router's
    [rows, seq, experts] probabilities over it for the top-k gradient (a few KiB;
    not counted here)."""
    from plait.parallel.experts import capacity

    X, m = sizes.get("expert", 1), exp.model
    if X == 1 or m.moe is None:
        return 0.0
    splits = math.prod(sizes.get(a, 1) for a in ("expert", "data", "fsdp"))
    micro = exp.pipeline.microbatches if sizes.get("pipeline", 1) > 1 else exp.train.microbatches
    rows = exp.train.global_batch // micro // splits
    width = collective_width(exp, platform)
    remat = m.remat != "none"
    if m.moe.capacity_factor == 0:
        tokens = rows * m.seq_len
        moved = (5 if remat else 4) * tokens * m.d_model * width
        routing = (5 if remat else 3) * tokens * m.moe.top_k * 4
        return micro * m.sparse_count * (X - 1) * (moved + routing)
    cap = capacity(m.seq_len, m.moe.top_k, m.moe.experts, m.moe.capacity_factor)
    buffer = rows * m.moe.experts * cap * m.d_model * width
    return micro * m.sparse_count * (6 if remat else 4) * buffer * (X - 1) / X


# The collectives that carry tokens over the expert axis, by dispatch: all-to-all
# (capacity) or all-gather (dropless: tokens gathered, outputs reduce-scattered back;
# in bf16 those sums go by all-to-all, the same bytes, and are added here: experts.
# _sum_scatter). The axis's all-reduces are weight gradients'.
DISPATCH_KINDS = {"all-to-all": ("all-to-all",),
                  "all-gather": ("all-gather", "reduce-scatter", "all-to-all")}


def expert_wire_bytes(analysis: dict, dispatch: str = "all-to-all") -> float:
    """The compiled step's wire bytes of the `dispatch`'s collectives over the expert
    axis alone."""
    return sum(op["wire_bytes"] for op in analysis["collective_ops"]
               if op["axes"] == ["expert"] and op["kind"] in DISPATCH_KINDS[dispatch])
