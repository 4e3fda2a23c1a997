"""Logical axis names -> mesh axes.

Models name the dimensions of their parameters and activations logically
(`embed`, `heads`, `act_batch`, ...). A rule set maps each logical name to
zero, one or several mesh axes; this module is the only place that knows the
mesh. A new parallel mode is a new rule set, never an edit to a model. The
compute ops models call (`dense`, `lookup`) are in `plait.parallel.ops`.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from plait import mesh as mesh_lib

MeshAxes = str | tuple[str, ...] | None


@dataclass(frozen=True)
class Rules:
    """How one tensor mode lays logical names onto mesh axes.

    `names` covers activations and parameter dimensions; `inputs` overrides it
    for the dimensions of a weight that a matmul contracts (the parameter's
    `fan_in` metadata), because 2-D and 3-D layouts split a weight's input and
    output features over different axes.
    """

    mode: str | None
    names: Mapping[str, MeshAxes]
    inputs: Mapping[str, MeshAxes] = field(default_factory=dict)
    # How attention spans the `context` axis ([context] attention: ring | allgather).
    context_attention: str = "ring"
    # Logical names whose dimension is not split but whose mesh axes no other dimension
    # of the same value takes either (act_batch's fill): key/value heads replicated over
    # the axis the query heads split, so the keys and values keep the queries' tokens.
    held: Mapping[str, MeshAxes] = field(default_factory=dict)

    def param_axes(self, logical: Sequence[str], fan_in: Sequence[str] = ()) -> list:
        return [self.inputs.get(n, self.names.get(n)) if n in fan_in else self.names.get(n)
                for n in logical]

    def get(self, name: str) -> MeshAxes:
        return self.names.get(name)


_PARAM_NONE = {"head_dim": None, "qkv": None, "gate_up": None, "seq": None, "router": None,
               "experts": None}
_ACT_NONE = {"act_seq": None, "act_head_dim": None}
# Context parallelism: every token-wise activation split along the sequence.
_ACT_SEQ = {"act_seq": "context"}

# Data parallel over `data`, ZeRO-3 over `fsdp` (parameters and optimizer state
# sharded along d_model, batch split over data x fsdp), Megatron 1-D over
# `tensor` (column-split QKV and first MLP matrix, row-split output
# projections, heads / MLP hidden / vocabulary sharded). GSPMD inserts the
# collectives: one all-reduce per block each way, as in Megatron.
RULES_1D = Rules("1d", {
    **_PARAM_NONE, **_ACT_NONE, **_ACT_SEQ,
    "vocab": "tensor", "embed": "fsdp", "heads": "tensor", "kv_heads": "tensor",
    "mlp": "tensor", "norm": None, "experts": "expert",
    # `expert` splits the rows first: each expert rank's rows are one block, the one it
    # exchanges with the others (parallel.experts).
    "act_batch": ("expert", "data", "fsdp"), "act_embed": None,
    "act_heads": "tensor", "act_kv_heads": "tensor", "act_mlp": "tensor",
    "act_vocab": "tensor",
})


def _rules_2d(mode: str) -> Rules:
    """2-D (Optimus/SUMMA) and 2.5-D (Tesseract) on a tensor_row x tensor_col grid.

    Every activation: tokens over (data, fsdp, depth, row), features over col.
    Every weight: input features over row (plus fsdp), output features over col;
    replicated over depth. `parallel.tensor.gathered_matmul` gathers the input
    over col and the weight over row, so each device computes a [T/q, n/q] block.
    """
    c = "tensor_col"
    return Rules(mode, {
        **_PARAM_NONE, **_ACT_NONE,
        "vocab": c, "embed": c, "heads": c, "kv_heads": c, "mlp": c, "norm": c,
        "act_batch": ("data", "fsdp", "tensor_depth", "tensor_row"),
        "act_embed": c, "act_heads": c, "act_kv_heads": c, "act_mlp": c, "act_vocab": c,
    }, inputs={
        "embed": ("tensor_row", "fsdp"), "heads": ("tensor_row", "fsdp"),
        "mlp": ("tensor_row", "fsdp"), "head_dim": None,
    })


# 3-D (Bian et al. 2021) on a tensor_x x tensor_y x tensor_z cube. The residual
# stream has tokens over (x, y) and d_model over z; the hidden side of each
# block (heads, MLP hidden, vocabulary) has tokens over (x, z) and features
# over y. A weight's input features are split over (its side's feature axis,
# x) and its output features over the other side's feature axis, so a linear
# layer gathers the input over one axis, the weight over x, and reduce-scatters
# the product over the third: every collective moves O(1/q^3) of the matrices.
RULES_3D = Rules("3d", {
    **_PARAM_NONE, **_ACT_NONE,
    "vocab": "tensor_y", "heads": "tensor_y", "kv_heads": "tensor_y", "mlp": "tensor_y",
    "embed": "tensor_z", "norm": "tensor_z",
    "act_batch": ("data", "fsdp", "tensor_x", "tensor_y", "tensor_z"),
    "act_embed": "tensor_z", "act_heads": "tensor_y", "act_kv_heads": "tensor_y",
    "act_mlp": "tensor_y",
    "act_vocab": "tensor_y",
}, inputs={
    "embed": ("tensor_z", "tensor_x", "fsdp"), "heads": "tensor_y",
    "head_dim": ("tensor_x", "fsdp"), "mlp": ("tensor_y", "tensor_x", "fsdp"),
})

# act_batch takes the mesh axes the other dimensions leave free: in 3-D the
# residual stream and the hidden side split tokens over different axes.
_FILL_LAST = "act_batch"


def without_axis(rules: Rules, axis: str) -> Rules:
    """The rules with one mesh axis taken out of every mapping: for a model traced per
    data replica (vmap with spmd_axis_name), where that axis is the replica's."""
    def drop(axes: MeshAxes) -> MeshAxes:
        kept = tuple(a for a in axes_tuple(axes) if a != axis)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    return replace(rules, names={k: drop(v) for k, v in rules.names.items()},
                   inputs={k: drop(v) for k, v in rules.inputs.items()})


def with_names(rules: Rules, names: Mapping[str, MeshAxes]) -> Rules:
    """The rules with some logical names mapped anew (for parameters and inputs alike)."""
    return replace(rules, names={**rules.names, **names},
                   inputs={k: names.get(k, v) for k, v in rules.inputs.items()})


def rules_for(mesh: Mesh) -> Rules:
    """The rule set of the tensor mode the mesh selects."""
    return rules_for_sizes(dict(mesh.shape))


def rules_for_sizes(sizes: dict[str, int]) -> Rules:
    mode = mesh_lib.tensor_mode(sizes)
    if mode in ("2d", "2.5d"):
        return _rules_2d(mode)
    if mode == "3d":
        return RULES_3D
    return RULES_1D


def axes_tuple(axes: MeshAxes) -> tuple[str, ...]:
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def axes_spec(per_dim: Sequence[MeshAxes], mesh: Mesh, fill_last: Sequence[bool] = (),
              held: Iterable[str] = ()) -> P:
    """PartitionSpec from mesh axes per dimension; size-1 axes and repeats dropped.

    Dimensions flagged in `fill_last` are resolved after the others, so they
    take only the axes the others (and `held`) left free.
    """
    used: set[str] = set(held)
    out: list = [None] * len(per_dim)
    flags = list(fill_last) + [False] * (len(per_dim) - len(fill_last))
    order = [i for i in range(len(per_dim)) if not flags[i]] + \
            [i for i in range(len(per_dim)) if flags[i]]
    for i in order:
        keep = tuple(a for a in axes_tuple(per_dim[i])
                     if a in mesh.shape and mesh.shape[a] > 1 and a not in used)
        used.update(keep)
        out[i] = None if not keep else keep[0] if len(keep) == 1 else keep
    return P(*out)


def spec(logical: Sequence[str | None], rules: Rules, mesh: Mesh) -> P:
    """PartitionSpec for logical names; size-1 mesh axes and repeats are dropped."""
    held = [a for n in logical if n in rules.held for a in axes_tuple(rules.held[n])]
    return axes_spec([rules.get(n) if n is not None else None for n in logical], mesh,
                     [n == _FILL_LAST for n in logical], held)


def param_spec(logical: Sequence[str], fan_in: Sequence[str], rules: Rules, mesh: Mesh) -> P:
    return axes_spec(rules.param_axes(logical, fan_in), mesh)


def batch_splits(rules: Rules, sizes: Mapping[str, int]) -> list[tuple[tuple[str, ...], int]]:
    """(mesh axes, their product) that split a batch's rows, as the residual stream lays
    them out and as the hidden side does (in 3-D they differ): every row count must
    divide by each product."""
    out = []
    for feature in ("act_embed", "act_heads"):
        taken = set(axes_tuple(rules.get(feature)))
        split = tuple(a for a in axes_tuple(rules.get("act_batch"))
                      if sizes.get(a, 1) > 1 and a not in taken)
        out.append((split, math.prod(sizes[a] for a in split)))
    return out


def batch_sharding(mesh: Mesh, rules: Rules, ndim: int, batch_dim: int = 0) -> NamedSharding:
    """Token batches split like the residual stream (in 3-D: over x and y, not z)."""
    names: list[str | None] = [None] * ndim
    names[batch_dim] = "act_batch"
    full = spec([*names, "act_embed"], rules, mesh)
    return NamedSharding(mesh, P(*tuple(full)[:ndim]))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def param_meta(v: nnx.Variable) -> tuple[tuple[str, ...], tuple[str, ...]]:
    meta = v.get_metadata()
    return tuple(meta["logical_axes"]), tuple(meta.get("fan_in", ()))


def param_shardings(variables: dict, mesh: Mesh, rules: Rules) -> dict:
    """NamedSharding per parameter, from a pure dict of abstract nnx Variables."""
    return jax.tree.map(
        lambda v: NamedSharding(mesh, param_spec(*param_meta(v), rules, mesh)),
        variables,
        is_leaf=_is_var,
    )


# The mesh and rules that `constrain` uses while a step is being traced.
_ACTIVE: contextvars.ContextVar[tuple[Mesh, Rules] | None] = contextvars.ContextVar(
    "plait_sharding", default=None
)


def active() -> tuple[Mesh, Rules] | None:
    """The mesh and rules of the step being traced (None outside `use`)."""
    return _ACTIVE.get()


@contextlib.contextmanager
def use(mesh: Mesh, rules: Rules) -> Iterator[None]:
    token = _ACTIVE.set((mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def splits(logical: str) -> bool:
    """Whether the active rules split the activation dimension `logical` across devices
    (False outside `use`)."""
    active = _ACTIVE.get()
    return active is not None and spec([logical], active[1], active[0])[0] is not None


def constrain(x: jax.Array, logical: Sequence[str | None]) -> jax.Array:
    """Pin an activation's layout by logical names; a no-op outside `use`."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    return pin(x, spec(logical, rules, mesh))


def varying_axes(x) -> frozenset:
    """The mesh axes a value inside shard_map varies over (the attribute moved across JAX)."""
    t = jax.typeof(x)
    vma = getattr(t, "vma", None)
    if vma is None:
        vma = getattr(getattr(t, "manual_axis_type", None), "varying", None)
    return frozenset(vma or ())


def vary_over(x: jax.Array, axes: Iterable[str]) -> jax.Array:
    """x marked varying over the manual mesh axes `axes` (those it does not vary over
    already): inside a shard_map, a value the same on every rank that is then combined
    with per-rank values, or a loop's carry, must say so in its type."""
    missing = frozenset(axes) - varying_axes(x)
    return jax.lax.pcast(x, tuple(sorted(missing)), to="varying") if missing else x


def varying_like(x: jax.Array, *like: jax.Array) -> jax.Array:
    """x marked varying over every manual mesh axis any of `like` varies over: a scan's
    initial carry inside a shard_map must have the type of what the body makes of it."""
    return vary_over(x, frozenset().union(*(varying_axes(a) for a in like)))


def pin(x: jax.Array, target: P) -> jax.Array:
    """Pin a value's layout to a PartitionSpec of the active mesh (inside `use`)."""
    mesh = _ACTIVE.get()[0]
    context = jax.sharding.get_abstract_mesh()
    if not context.empty and context.manual_axes:
        # Inside a shard_map that is manual over some axes (the pipeline): the
        # constraint names the context's mesh, where those axes are Manual.
        return jax.lax.with_sharding_constraint(x, NamedSharding(context, target))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, target))
