"""The bridge between NNX modules and plain parameter dicts.

Training, sharding and checkpoints all work on a *pure dict* of arrays (string
keys, e.g. params["blocks"]["0"]["attn"]["wqkv"]): independent of the mesh.
NNX modules are rebuilt from it inside the traced step with `apply`.

A model may keep its repeated layers *stacked* (`stacked_layers`): one array
per parameter with a leading `layers` axis, params["blocks"]["attn"]["wqkv"]
of shape [L, ...], initialised by one layer's program vmapped over the layers
and run by `LayerStack` under lax.scan, so neither program grows with depth.
Checkpoints hold one entry per layer whatever the layout (`unstack` /
`stack` convert), so runs move between the two.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from plait import loss_mask
from plait.config import ModelSection
from plait.models.keys import ParamKeys


def path_key(k: Any) -> str:
    """One entry of a pytree path (DictKey, GetAttrKey, ...) as the dict key it names."""
    return str(getattr(k, "key", k))


def flat_to_pure(flat) -> dict:
    out: dict = {}
    for path, leaf in flat:
        node = out
        for k in path[:-1]:
            node = node.setdefault(path_key(k), {})
        node[path_key(path[-1])] = leaf
    return out


def _lookup(tree: dict, path) -> Any:
    for k in path:
        tree = tree[path_key(k)]
    return tree


def _cast(var: nnx.Variable, value: jax.Array, dtype: jnp.dtype | None) -> jax.Array:
    """A parameter in the compute dtype; FP8 scaling state stays float32 (models.fp8)."""
    from plait.models.fp8 import Fp8Meta

    if dtype is None or isinstance(var, Fp8Meta) or getattr(var, "keep_float32", False):
        return value
    return value.astype(dtype)


@dataclass(frozen=True)
class ModelDef:
    """A model's structure without its values: graph, abstract state, config."""

    cfg: ModelSection
    cls: type  # the NNX module class, constructed as cls(cfg, ParamKeys)
    graphdef: Any
    abstract: nnx.State

    def variables(self) -> dict:
        """Pure dict of the abstract nnx Variables (they carry `logical_axes`)."""
        return flat_to_pure(nnx.to_flat_state(self.abstract))

    def shapes(self) -> dict:
        """Pure dict of ShapeDtypeStruct, one per parameter."""
        return jax.tree.map(
            lambda v: jax.ShapeDtypeStruct(v.get_value().shape, v.get_value().dtype),
            self.variables(), is_leaf=lambda x: isinstance(x, nnx.Variable),
        )

    def init(self, seed: int) -> dict:
        """Fresh parameters; call under jit with out_shardings so they are born sharded."""
        module = self.cls(self.cfg, ParamKeys(seed))
        _, state = nnx.split(module)
        return flat_to_pure((p, v.get_value()) for p, v in nnx.to_flat_state(state))

    def module(self, params: dict, dtype: jnp.dtype | None = None) -> nnx.Module:
        """The NNX module holding `params` (cast to `dtype` for low-precision compute)."""
        flat = []
        for path, var in nnx.to_flat_state(self.abstract):
            value = _lookup(params, path)
            flat.append((path, var.replace(_cast(var, value, dtype))))
        return nnx.merge(self.graphdef, nnx.from_flat_state(flat))

    def apply(self, params: dict, tokens: jax.Array, dtype: jnp.dtype | None = None):
        return self.module(params, dtype)(tokens)

    def num_params(self) -> int:
        """The model's weights (FP8 scaling state is not one)."""
        import math

        from plait.models.fp8 import Fp8Meta

        return sum(math.prod(v.get_value().shape) for v in jax.tree.leaves(
            self.variables(), is_leaf=lambda x: isinstance(x, nnx.Variable))
            if not isinstance(v, Fp8Meta))


LAYERS = "layers"  # the logical name of a stacked layer axis; no rule splits it


def _abstract_layer(make: Callable[[ParamKeys], nnx.Module]) -> tuple[Any, Any, int]:
    """One layer `make(keys)`'s graph, abstract state and how many parameter keys it
    draws, from one abstract build."""
    counter = ParamKeys(0)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: make(counter)))
    return graphdef, abstract, counter.count


def _vmapped_values(make: Callable[[ParamKeys], nnx.Module], key: jax.Array,
                    starts: jax.Array) -> list[jax.Array]:
    """The values of `make(ParamKeys(key, s))` for each s in `starts`, stacked on a
    leading axis, in flat-state order: one layer's init program vmapped over the
    layers, so the init program holds each layer kind's random-number program once
    (compiling one per layer grows with depth)."""
    def one(start):
        _, state = nnx.split(make(ParamKeys(key, start)))
        return [v.get_value() for _, v in nnx.to_flat_state(state)]

    return jax.vmap(one)(starts)


def stacked_layers(layer_cls: type, cfg: ModelSection, keys: ParamKeys, n: int) -> nnx.Module:
    """`n` layers as one `layer_cls` module whose parameters have a leading `layers` axis.

    One layer's init is vmapped over the layer index: the program is the same
    size at any depth. Layer i draws the keys the i-th of `n` layers built one
    after another would, so the values equal the unstacked model's.
    """
    def make(k: ParamKeys) -> nnx.Module:
        return layer_cls(cfg, k)

    graphdef, abstract, per = _abstract_layer(make)
    start = keys.count
    values = _vmapped_values(make, keys.key, start + jnp.arange(n) * per)
    keys.count = start + n * per
    flat = [(path, var.replace(value, logical_axes=(LAYERS, *var.get_metadata()["logical_axes"])))
            for (path, var), value in zip(nnx.to_flat_state(abstract), values, strict=True)]
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def layer_list(make: Callable[[ParamKeys, Any], nnx.Module], keys: ParamKeys,
               kinds: list) -> list[nnx.Module]:
    """Layers `make(keys, kind)` for each kind in `kinds`, with the values of building
    them one after another, each kind's init vmapped over its layers: the per-layer
    layout's init program does not grow with depth either (its random numbers were
    most of the compile time of a fresh run's start: a threefry program per parameter
    per layer)."""
    shapes = {kind: _abstract_layer(lambda k, kind=kind: make(k, kind))
              for kind in dict.fromkeys(kinds)}
    starts, count = [], keys.count
    for kind in kinds:
        starts.append(count)
        count += shapes[kind][2]
    layers: list[nnx.Module | None] = [None] * len(kinds)
    for kind, (graphdef, abstract, _) in shapes.items():
        at = [i for i, k in enumerate(kinds) if k == kind]
        if len(at) == 1:  # nothing to share: built as is
            layers[at[0]] = make(ParamKeys(keys.key, starts[at[0]]), kind)
            continue
        values = _vmapped_values(lambda k, kind=kind: make(k, kind), keys.key,
                                 jnp.asarray([starts[i] for i in at], jnp.int32))
        # Each parameter's stack made before any layer's slice of it: XLA:GPU otherwise
        # fuses the random program into one kernel with every layer's slice (gpt2-1.3b's
        # unrolled init compiled in 4 minutes on an H100; docs/architecture.md).
        values = [jax.lax.optimization_barrier(v) for v in values]
        for j, i in enumerate(at):
            flat = [(path, var.replace(value[j])) for (path, var), value
                    in zip(nnx.to_flat_state(abstract), values, strict=True)]
            layers[i] = nnx.merge(graphdef, nnx.from_flat_state(flat))
    keys.count = count
    return layers


def module_values(module: nnx.Module) -> dict:
    """A module's parameter values as a pure dict."""
    return flat_to_pure((p, v.get_value()) for p, v in nnx.to_flat_state(nnx.state(module)))


def unstack(params: dict, key: str) -> dict:
    """params[key] stacked [L, ...] -> one entry per layer, {"0": ..., "L-1": ...}."""
    n = jax.tree.leaves(params[key])[0].shape[0]
    layers = {str(i): jax.tree.map(lambda a, i=i: a[i], params[key]) for i in range(n)}
    return {**params, key: layers}


def stack(params: dict, key: str) -> dict:
    """params[key] with one entry per layer -> stacked [L, ...] in layer order."""
    layers = params[key]
    ordered = [layers[str(i)] for i in range(len(layers))]
    return {**params, key: jax.tree.map(lambda *xs: jnp.stack(xs), *ordered)}


def decay_mask(variables: dict) -> dict:
    """Weight decay on matrices, not vectors (norms, biases), judged per layer."""
    return jax.tree.map(
        lambda v: sum(a != LAYERS for a in v.get_metadata()["logical_axes"]) >= 2,
        variables, is_leaf=lambda x: isinstance(x, nnx.Variable))


# What each attention block names for the remat policies that keep part of it
# (models/gpt.py): q, k and v as attention reads them (projected, normed, rotated), the
# attention's output, and its output projection.
ATTENTION_NAMES = ("attn_qkv", "attn_out", "attn_proj")


def remat_policy(remat: str):
    """The jax.checkpoint policy of `model.remat`: full saves nothing (None); save_dots
    keeps every matmul output; save_attention keeps the attention block's (ATTENTION_NAMES)
    and recomputes the MLP, whose [tokens, d_ff] activations are the largest (MaxText's
    save_dot_except_mlp); save_qkv keeps q, k and v only."""
    names = {"save_attention": ATTENTION_NAMES, "save_qkv": ATTENTION_NAMES[:1]}
    if remat in names:
        return jax.checkpoint_policies.save_only_these_names(*names[remat])
    return jax.checkpoint_policies.checkpoint_dots if remat == "save_dots" else None


@dataclass(frozen=True)
class LayerStack:
    """One repeated layer of a model, run over a stack of per-layer parameters.

    The pipeline cuts a model into embed -> layers -> head; this runs a stage's
    share of the layers (parameters stacked on a leading axis) with lax.scan.
    """

    graphdef: Any
    abstract: nnx.State
    remat: str  # none | full | save_dots | save_attention | save_qkv (GPTConfig.remat)

    def layer_fn(self, dtype: jnp.dtype | None = None, method: str = "__call__"
                 ) -> Callable[..., Any]:
        """One layer as a function (its parameters, h[, segments]) -> h (or what the
        layer's `method` returns), computing in `dtype`, with the model's
        rematerialisation policy. `segments` [rows, seq]: packed documents' (each token's
        document), an argument rather than read from outside: a checkpointed function's
        trace is cached and would keep the first segments it saw."""
        flat_abstract = list(nnx.to_flat_state(self.abstract))

        def one(layer: dict, h: jax.Array, segments: jax.Array | None = None):
            flat = []
            for path, var in flat_abstract:
                flat.append((path, var.replace(_cast(var, _lookup(layer, path), dtype))))
            module = nnx.merge(self.graphdef, nnx.from_flat_state(flat))
            # None leaves alone the documents set around the call (the unpipelined model)
            with (contextlib.nullcontext() if segments is None
                  else loss_mask.documents(segments)):
                return getattr(module, method)(h)

        if self.remat != "none":
            one = jax.checkpoint(one, policy=remat_policy(self.remat))
        return one

    def apply(self, stacked: dict, x: jax.Array, dtype: jnp.dtype | None = None) -> jax.Array:
        one = self.layer_fn(dtype)
        return jax.lax.scan(lambda h, layer: (one(layer, h), None), x, stacked)[0]

    def apply_with_stats(self, stacked: dict, x: jax.Array, zero: dict,
                         dtype: jnp.dtype | None = None) -> tuple[jax.Array, dict]:
        """`apply` of layers whose `forward` returns (h, figures): the figures summed over
        the layers (starting from `zero`, a dense layer's)."""
        one = self.layer_fn(dtype, "forward")

        def body(carry, layer):
            h, total = carry
            h, stats = one(layer, h)
            stats = zero if stats is None else stats
            return (h, jax.tree.map(jnp.add, total, stats)), None

        return jax.lax.scan(body, (x, zero), stacked)[0]


def layer_stack(layer_cls: type, cfg: ModelSection) -> LayerStack:
    """The stack runner of one repeated layer, `layer_cls(cfg, ParamKeys)`."""
    module = nnx.eval_shape(lambda: layer_cls(cfg, ParamKeys(0)))
    graphdef, abstract = nnx.split(module)
    return LayerStack(graphdef, abstract, getattr(cfg, "remat", "none"))


def build(cls: type, cfg: ModelSection) -> ModelDef:
    """The abstract model `cls(cfg, keys)`: its structure, no values."""
    module = nnx.eval_shape(lambda: cls(cfg, ParamKeys(0)))
    graphdef, abstract = nnx.split(module)
    return ModelDef(cfg, cls, graphdef, abstract)
