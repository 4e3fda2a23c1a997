"""Logical axis names -> mesh axes.

Models name the dimensions of their parameters and activations logically
(`embed`, `heads`, `act_batch`, ...). A rule set maps each logical name to
zero, one or several mesh axes; this module is the only place that knows the
mesh. A new parallel mode is a new rule set, never an edit to a model.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MeshAxes = str | tuple[str, ...] | None
Rules = Mapping[str, MeshAxes]

# Data parallel over `data`, ZeRO-3 over `fsdp` (parameters and optimizer state
# sharded along d_model, batch split over data x fsdp), Megatron 1-D over
# `tensor` (column-split QKV and first MLP matrix, row-split output
# projections, heads / MLP hidden / vocabulary sharded).
RULES_1D: Rules = {
    # parameters
    "vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",
    "head_dim": None,
    "qkv": None,
    "mlp": "tensor",
    "seq": None,
    "norm": None,
    # activations
    "act_batch": ("data", "fsdp"),
    "act_seq": None,
    "act_embed": None,
    "act_heads": "tensor",
    "act_head_dim": None,
    "act_mlp": "tensor",
    "act_vocab": "tensor",
}


def rules_for(mesh: Mesh) -> Rules:
    """The rule set for a mesh (one today; 2-D/3-D tensor modes add theirs)."""
    return RULES_1D


def spec(logical: Sequence[str | None], rules: Rules, mesh: Mesh) -> P:
    """PartitionSpec for logical names; size-1 mesh axes and repeats are dropped."""
    used: set[str] = set()
    out = []
    for name in logical:
        axes = rules.get(name) if name is not None else None
        if axes is None:
            out.append(None)
            continue
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        keep = tuple(a for a in axes if a in mesh.shape and mesh.shape[a] > 1 and a not in used)
        used.update(keep)
        out.append(None if not keep else keep[0] if len(keep) == 1 else keep)
    return P(*out)


def batch_sharding(mesh: Mesh, rules: Rules, ndim: int, batch_dim: int = 0) -> NamedSharding:
    names = [None] * ndim
    names[batch_dim] = "act_batch"
    return NamedSharding(mesh, spec(names, rules, mesh))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def param_shardings(variables: dict, mesh: Mesh, rules: Rules) -> dict:
    """NamedSharding per parameter, from a pure dict of abstract nnx Variables."""
    return jax.tree.map(
        lambda v: NamedSharding(mesh, spec(v.get_metadata()["logical_axes"], rules, mesh)),
        variables,
        is_leaf=_is_var,
    )


# The mesh and rules that `constrain` uses while a step is being traced.
_ACTIVE: contextvars.ContextVar[tuple[Mesh, Rules] | None] = contextvars.ContextVar(
    "plait_sharding", default=None
)


@contextlib.contextmanager
def use(mesh: Mesh, rules: Rules) -> Iterator[None]:
    token = _ACTIVE.set((mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def constrain(x: jax.Array, logical: Sequence[str | None]) -> jax.Array:
    """Pin an activation's layout by logical names; a no-op outside `use`."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec(logical, rules, mesh)))
