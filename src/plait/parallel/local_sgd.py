"""Data replicas that train apart and meet a sharded center: Sync EASGD and DiLoCo.

With `sync.method` = "easgd" or "diloco", each data replica (the fsdp x tensor
devices of one `data` index) keeps its own parameters and optimizer state,
stacked [replica, ...] and split over `data`. A step runs the ordinary
single-model step on every replica at once (`vmap` with `spmd_axis_name="data"`)
with no gradient exchange over `data`. Every `sync.period` steps the replicas
meet the center, a model of the canonical shape whose leaves are split over
`data` (each replica's devices own 1/P of it, the parameter-server shard of
PHub) along a dimension no other axis splits:

- EASGD (Zhang et al. 2015; You et al.'s Sync EASGD): with d_i = x_i - c,
  x_i <- x_i - alpha d_i and c <- c + alpha sum_i d_i (beta = P alpha).
- DiLoCo (Douillard et al. 2023): outer gradient g = c - mean_i x_i, outer
  Nesterov momentum m <- mu m + g, c <- c - lr (g + mu m), then x_i <- c.

An exchange is one reduce-scatter of the replicas' sum onto the center's
shards and one all-gather of the center back to the replicas (one model's
worth each way, written here with shard_map); a local step exchanges nothing
over `data` but the step's two scalar metrics.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from plait.config import SyncConfig

AXIS = "data"
LOCAL_METHODS = ("easgd", "diloco")


def _axes(part) -> tuple[str, ...]:
    return () if part is None else (part,) if isinstance(part, str) else tuple(part)


def center_dim(shape: tuple[int, ...], spec: P, replicas: int,
               mesh_shape: dict[str, int]) -> int | None:
    """The dimension of a leaf the center splits over `data` (inside whatever fsdp or
    tensor split it already has there): the first whose per-device size the replica
    count divides. None: the leaf (a tiny vector) is exchanged with an all-reduce."""
    parts = tuple(spec) + (None,) * (len(shape) - len(spec))
    for i, n in enumerate(shape):
        local = n // math.prod(mesh_shape[a] for a in _axes(parts[i]))
        if local % replicas == 0 and local >= replicas:
            return i
    return None


def _with(spec: P, ndim: int, dim: int | None, axis: str) -> P:
    """`spec` with `axis` added innermost on dimension `dim`."""
    parts = list(tuple(spec) + (None,) * (ndim - len(spec)))
    if dim is not None:
        both = _axes(parts[dim]) + (axis,)
        parts[dim] = both[0] if len(both) == 1 else both
    return P(*parts)


@dataclass(frozen=True)
class Leaf:
    """How one parameter is laid out: per replica, and in the center."""

    spec: P  # the single model's spec (fsdp / tensor axes)
    dim: int | None  # the center's dimension over `data`


class LocalSGD:
    """The state layout and the step of replicas that sync every `period` steps."""

    def __init__(self, cfg: SyncConfig, mesh: Mesh, replicas: int | None = None):
        self.cfg, self.mesh = cfg, mesh
        self.replicas = replicas or mesh.shape.get(AXIS, 1)

    # --- layout ------------------------------------------------------------
    def leaves(self, param_shapes: dict, param_shardings: dict) -> dict:
        return jax.tree.map(
            lambda s, sh: Leaf(sh.spec, center_dim(s.shape, sh.spec, self.replicas,
                                                   dict(self.mesh.shape))),
            param_shapes, param_shardings)

    def replica_sharding(self, sh: NamedSharding, sharded: bool = True) -> NamedSharding:
        """[replica, ...]: the replica dimension over `data` (or, for a checkpoint of
        another replica count, kept whole)."""
        return NamedSharding(self.mesh, P(AXIS if sharded else None, *sh.spec))

    def center_sharding(self, shape, sh: NamedSharding) -> NamedSharding:
        dim = center_dim(shape.shape, sh.spec, self.replicas, dict(self.mesh.shape))
        return NamedSharding(self.mesh, _with(sh.spec, len(shape.shape), dim, AXIS))

    def state_layout(self, param_shapes: dict, param_shardings: dict,
                     tx: optax.GradientTransformation, sharded: bool = True
                     ) -> tuple[dict, dict]:
        """(shapes, shardings) of {"step", "params", "opt_state", "sync"}; with
        `sharded` False (reading a checkpoint of another replica count) nothing is split
        over `data`."""
        R = self.replicas
        rep = NamedSharding(self.mesh, P())
        stacked = jax.tree.map(lambda s: jax.ShapeDtypeStruct((R,) + s.shape, s.dtype),
                               param_shapes)
        stacked_sh = jax.tree.map(lambda sh: self.replica_sharding(sh, sharded), param_shardings)
        opt_shapes = jax.eval_shape(jax.vmap(tx.init), stacked)
        lead = NamedSharding(self.mesh, P(AXIS if sharded else None))
        opt_sh = optax.tree_map_params(tx, lambda _, sh: sh, opt_shapes, stacked_sh,
                                       transform_non_params=lambda _: lead)
        center_sh = (jax.tree.map(self.center_sharding, param_shapes, param_shardings)
                     if sharded else param_shardings)
        sync_shapes = {"center": param_shapes}
        sync_sh = {"center": center_sh}
        if self.cfg.method == "diloco":
            sync_shapes["momentum"], sync_sh["momentum"] = param_shapes, center_sh
        shapes = {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": stacked,
                  "opt_state": opt_shapes, "sync": sync_shapes}
        shardings = {"step": rep, "params": stacked_sh, "opt_state": opt_sh, "sync": sync_sh}
        return shapes, shardings

    def init(self, params: dict, tx: optax.GradientTransformation) -> dict:
        """Every replica starts from the same model, which is also the center."""
        R = self.replicas
        stacked = jax.tree.map(lambda p: jnp.broadcast_to(p, (R,) + p.shape), params)
        sync = {"center": params}
        if self.cfg.method == "diloco":
            sync["momentum"] = jax.tree.map(jnp.zeros_like, params)
        return {"step": jnp.zeros((), jnp.int32), "params": stacked,
                "opt_state": jax.vmap(tx.init)(stacked), "sync": sync}

    def restart_from_center(self, state: dict, tx: optax.GradientTransformation) -> dict:
        """A state whose replicas (any count) restart from the center, with fresh
        optimizer states; the center (and DiLoCo's momentum) and the step are kept."""
        fresh = self.init(state["sync"]["center"], tx)
        return {**fresh, "step": state["step"], "sync": state["sync"]}

    # --- collectives -------------------------------------------------------
    # Manual over every mesh axis: each device holds exactly its shard of the leaf (as
    # fsdp / tensor split it), and the only collectives are these, over `data`.
    def _sum_to_center(self, x: jax.Array, leaf: Leaf) -> jax.Array:
        """[R, ...] split over data -> sum over replicas, laid out as the center."""
        def body(xl):
            xl = xl[0]
            if leaf.dim is None:
                return jax.lax.psum(xl, AXIS)
            return jax.lax.psum_scatter(xl, AXIS, scatter_dimension=leaf.dim, tiled=True)

        ndim = x.ndim - 1
        return jax.shard_map(body, mesh=self.mesh, in_specs=P(AXIS, *leaf.spec),
                             out_specs=_with(leaf.spec, ndim, leaf.dim, AXIS))(x)

    def _broadcast(self, c: jax.Array, leaf: Leaf) -> jax.Array:
        """The center -> [R, ...] (every replica a whole copy), split over data."""
        def body(cl):
            if leaf.dim is not None:
                cl = jax.lax.all_gather(cl, AXIS, axis=leaf.dim, tiled=True)
            return cl[None]

        return jax.shard_map(body, mesh=self.mesh,
                             in_specs=_with(leaf.spec, c.ndim, leaf.dim, AXIS),
                             out_specs=P(AXIS, *leaf.spec))(c)

    # --- the exchange --------------------------------------------------------
    def exchange(self, params: dict, sync: dict, leaves: dict) -> tuple[dict, dict]:
        """(replicas, center state) after one meeting."""
        f32 = jnp.float32
        if self.cfg.method == "easgd":
            a = self.cfg.alpha

            def one(x, c, leaf):
                cb = self._broadcast(c, leaf)
                d = x.astype(f32) - cb.astype(f32)
                c_new = c.astype(f32) + a * self._sum_to_center(d, leaf)
                return (x - a * d).astype(x.dtype), c_new.astype(c.dtype)

            out = jax.tree.map(one, params, sync["center"], leaves)
            new_x = jax.tree.map(lambda o: o[0], out, is_leaf=lambda o: isinstance(o, tuple))
            new_c = jax.tree.map(lambda o: o[1], out, is_leaf=lambda o: isinstance(o, tuple))
            return new_x, {"center": new_c}
        lr, mu, R = self.cfg.outer_lr, self.cfg.outer_momentum, self.replicas

        def outer(x, c, m, leaf):
            mean = self._sum_to_center(x.astype(f32), leaf) / R
            g = c.astype(f32) - mean
            m_new = mu * m.astype(f32) + g
            c_new = c.astype(f32) - lr * (g + mu * m_new)
            return c_new.astype(c.dtype), m_new.astype(m.dtype)

        out = jax.tree.map(outer, params, sync["center"], sync["momentum"], leaves)
        pick = (lambda i: jax.tree.map(lambda o: o[i], out,
                                       is_leaf=lambda o: isinstance(o, tuple)))
        center, momentum = pick(0), pick(1)
        new_x = jax.tree.map(lambda c, x, leaf: self._broadcast(c, leaf).astype(x.dtype),
                             center, params, leaves)
        return new_x, {"center": center, "momentum": momentum}

    # --- the step ----------------------------------------------------------
    def make_step(self, replica_step: Callable, leaves: dict, lr_schedule: optax.Schedule):
        """step(state, batch) for batch [micro, rows, ...] (rows split over data first):
        `replica_step(params, opt_state, batch) -> (params, opt_state, loss, grad_norm)`
        runs on every replica; every `period`-th step ends with an exchange."""
        R, period = self.replicas, self.cfg.period
        run_all = jax.vmap(replica_step, spmd_axis_name=AXIS)

        def step(state, batch):
            per_replica = jax.tree.map(
                lambda b: jnp.moveaxis(b.reshape(b.shape[0], R, b.shape[1] // R,
                                                 *b.shape[2:]), 1, 0), batch)
            params, opt_state, loss, norm = run_all(state["params"], state["opt_state"],
                                                    per_replica)
            s = state["step"]

            def meet(p_and_sync):
                return self.exchange(*p_and_sync, leaves)

            params, sync = jax.lax.cond((s + 1) % period == 0, meet, lambda ps: ps,
                                        (params, state["sync"]))
            new = {"step": s + 1, "params": params, "opt_state": opt_state, "sync": sync}
            return new, {"loss": jnp.mean(loss), "grad_norm": jnp.mean(norm),
                         "lr": lr_schedule(s)}

        return step


def phases(period: int) -> dict[str, dict[int, list[float]]]:
    """Branch weights that read a local step, a meeting step, and the average step out
    of the compiled program (plait.analysis: the step's one two-way conditional)."""
    return {"local_step": {2: [1.0, 0.0]}, "sync_step": {2: [0.0, 1.0]},
            "mean_step": {2: [1 - 1 / period, 1 / period]}}


def model_bytes(param_shapes: dict) -> int:
    return sum(math.prod(s.shape) * jnp.dtype(s.dtype).itemsize
               for s in jax.tree.leaves(param_shapes))
