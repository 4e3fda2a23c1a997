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
worth each way, written here with shard_map); where the data axis has parts
across and within hosts, each runs within the hosts first and sends 1/fast of
it across (parallel.hierarchical; sync.reduce = "flat" turns that off). A
local step exchanges nothing over `data`: its loss and gradient norm stay one
per replica, and the host averages them where it reads them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from plait import hosts
from plait import mesh as mesh_lib
from plait.config import Experiment, SyncConfig
from plait.errors import UserError
from plait.parallel import hierarchical
from plait.train.state import StateLayout

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
    ndim: int
    dim: int | None  # the center's dimension over `data`

    @property
    def replicas_spec(self) -> P:
        """[replica, ...]: the replica dimension over `data`."""
        return P(AXIS, *self.spec)

    @property
    def center_spec(self) -> P:
        return _with(self.spec, self.ndim, self.dim, AXIS)


class LocalSGD:
    """The state layout and the step of replicas that sync every `period` steps."""

    def __init__(self, cfg: SyncConfig, mesh: Mesh, replicas: int | None = None):
        self.cfg, self.mesh = cfg, mesh
        self.replicas = replicas or mesh.shape.get(AXIS, 1)
        # (slow, fast) of the data axis; the exchange is hierarchical where both exceed 1.
        self.split = ((self.replicas, 1) if cfg.reduce == "flat"
                      else hosts.axis_split(mesh, AXIS))

    # --- layout ------------------------------------------------------------
    def leaves(self, param_shapes: dict, param_shardings: dict) -> dict:
        return jax.tree.map(
            lambda s, sh: Leaf(sh.spec, len(s.shape), center_dim(
                s.shape, sh.spec, self.replicas, dict(self.mesh.shape))),
            param_shapes, param_shardings)

    def state_layout(self, param_shapes: dict, param_shardings: dict,
                     tx: optax.GradientTransformation, sharded: bool = True
                     ) -> StateLayout:
        """Shapes and shardings of {"step", "params", "opt_state", "sync"}; with
        `sharded` False (reading a checkpoint of another replica count) nothing is split
        over `data`."""
        R = self.replicas
        rep = NamedSharding(self.mesh, P())
        stacked = jax.tree.map(lambda s: jax.ShapeDtypeStruct((R,) + s.shape, s.dtype),
                               param_shapes)
        leaves = self.leaves(param_shapes, param_shardings)

        def named(spec: P) -> NamedSharding:
            return NamedSharding(self.mesh, spec)

        # A checkpoint of another replica count is read with nothing split over data.
        stacked_sh = jax.tree.map(
            lambda leaf: named(leaf.replicas_spec if sharded else P(None, *leaf.spec)), leaves)
        opt_shapes = jax.eval_shape(jax.vmap(tx.init), stacked)
        lead = NamedSharding(self.mesh, P(AXIS if sharded else None))
        opt_sh = optax.tree_map_params(tx, lambda _, sh: sh, opt_shapes, stacked_sh,
                                       transform_non_params=lambda _: lead)
        center_sh = (jax.tree.map(lambda leaf: named(leaf.center_spec), leaves)
                     if sharded else param_shardings)
        sync_shapes = {"center": param_shapes}
        sync_sh = {"center": center_sh}
        if self.cfg.method == "diloco":
            sync_shapes["momentum"], sync_sh["momentum"] = param_shapes, center_sh
        shapes = {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": stacked,
                  "opt_state": opt_shapes, "sync": sync_shapes}
        shardings = {"step": rep, "params": stacked_sh, "opt_state": opt_sh, "sync": sync_sh}
        return StateLayout(shapes, shardings)

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
    # Manual over every mesh axis: each device holds exactly its shard of a leaf (as
    # fsdp / tensor split it), and the only collectives are these, over `data`. All
    # leaves travel in one flat float32 buffer (a bucket): one reduce-scatter and one
    # all-gather per exchange rather than one per leaf, whose latencies would add up.
    def _sum_to_center(self, xs: dict, leaves: dict) -> dict:
        """Replicas [R, ...] split over data -> their sum, laid out as the center."""
        R = self.replicas
        flat_leaves, tdef = jax.tree.flatten(leaves)

        def body(*xl):
            split, whole = [], []
            for x, leaf in zip(xl, flat_leaves, strict=True):
                x = x[0].astype(jnp.float32)
                if leaf.dim is None:
                    whole.append(x.reshape(-1))
                else:
                    split.append(jnp.moveaxis(x, leaf.dim, 0).reshape(R, -1))
            outs_split = outs_whole = None
            if split:
                sizes = [a.shape[1] for a in split]
                red = hierarchical.reduce_scatter_rows(jnp.concatenate(split, axis=1),
                                                       self.split)
                outs_split = jnp.split(red, np.cumsum(sizes)[:-1])
            if whole:
                sizes = [a.size for a in whole]
                outs_whole = jnp.split(jax.lax.psum(jnp.concatenate(whole), AXIS),
                                       np.cumsum(sizes)[:-1])
            out, i, j = [], 0, 0
            for x, leaf in zip(xl, flat_leaves, strict=True):
                shape = x.shape[1:]
                if leaf.dim is None:
                    out.append(outs_whole[j].reshape(shape))
                    j += 1
                else:
                    moved = (shape[leaf.dim] // R,) + tuple(
                        n for k, n in enumerate(shape) if k != leaf.dim)
                    out.append(jnp.moveaxis(outs_split[i].reshape(moved), 0, leaf.dim))
                    i += 1
            return tuple(out)

        flat_x = jax.tree.leaves(xs)
        in_specs = tuple(leaf.replicas_spec for leaf in flat_leaves)
        out_specs = tuple(leaf.center_spec for leaf in flat_leaves)
        # A bucket mixes leaves split over fsdp / tensor with replicated ones: it varies
        # over those axes, though each replicated leaf's slice of it does not.
        out = jax.shard_map(body, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                            check_vma=False)(*flat_x)
        return jax.tree.unflatten(tdef, list(out))

    def _broadcast(self, center: dict, leaves: dict) -> dict:
        """The center -> [R, ...] (every replica a whole copy), split over data."""
        R = self.replicas
        flat_leaves, tdef = jax.tree.flatten(leaves)
        flat_c = jax.tree.leaves(center)

        def body(*cl):
            parts = [jnp.moveaxis(c.astype(jnp.float32), leaf.dim, 0).reshape(-1)
                     for c, leaf in zip(cl, flat_leaves, strict=True) if leaf.dim is not None]
            full = None
            if parts:
                sizes = [p.size for p in parts]
                gathered = hierarchical.all_gather_rows(jnp.concatenate(parts), self.split)
                full = jnp.split(gathered, np.cumsum(sizes)[:-1], axis=1)  # [R, size] each
            out, i = [], 0
            for c, leaf in zip(cl, flat_leaves, strict=True):
                if leaf.dim is None:
                    out.append(c[None])
                    continue
                moved = jnp.moveaxis(c, leaf.dim, 0).shape
                whole = full[i].reshape((R * moved[0],) + moved[1:])
                out.append(jnp.moveaxis(whole, 0, leaf.dim).astype(c.dtype)[None])
                i += 1
            return tuple(out)

        in_specs = tuple(leaf.center_spec for leaf in flat_leaves)
        out_specs = tuple(leaf.replicas_spec for leaf in flat_leaves)
        out = jax.shard_map(body, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                            check_vma=False)(*flat_c)
        return jax.tree.unflatten(tdef, list(out))

    # --- the exchange --------------------------------------------------------
    def exchange(self, params: dict, sync: dict, leaves: dict) -> tuple[dict, dict]:
        """(replicas, center state) after one meeting."""
        f32 = jnp.float32
        if self.cfg.method == "easgd":
            a = self.cfg.alpha
            d = jax.tree.map(lambda x, cb: x.astype(f32) - cb.astype(f32), params,
                             self._broadcast(sync["center"], leaves))
            total = self._sum_to_center(d, leaves)
            center = jax.tree.map(lambda c, t: (c.astype(f32) + a * t).astype(c.dtype),
                                  sync["center"], total)
            new_x = jax.tree.map(lambda x, di: (x - a * di).astype(x.dtype), params, d)
            return new_x, {"center": center}
        lr, mu, R = self.cfg.outer_lr, self.cfg.outer_momentum, self.replicas
        total = self._sum_to_center(params, leaves)
        g = jax.tree.map(lambda c, t: c.astype(f32) - t / R, sync["center"], total)
        momentum = jax.tree.map(lambda m, gi: mu * m.astype(f32) + gi, sync["momentum"], g)
        center = jax.tree.map(lambda c, gi, m: (c.astype(f32) - lr * (gi + mu * m)
                                                ).astype(c.dtype), sync["center"], g, momentum)
        momentum = jax.tree.map(lambda m, old: m.astype(old.dtype), momentum,
                                sync["momentum"])
        new_x = jax.tree.map(lambda b, x: b.astype(x.dtype), self._broadcast(center, leaves),
                             params)
        return new_x, {"center": center, "momentum": momentum}

    # --- the step ----------------------------------------------------------
    def make_step(self, replica_step: Callable, leaves: dict, lr_schedule: optax.Schedule):
        """step(state, batch) for batch [micro, rows, ...] (rows split over data first):
        `replica_step(params, opt_state, batch) -> (params, opt_state, loss, grad_norm)`
        runs on every replica; every `period`-th step ends with an exchange. The loss and
        norm come back [replicas] (see train.step.jit_step's `per_replica`)."""
        R, period = self.replicas, self.cfg.period
        run_all = jax.vmap(replica_step, spmd_axis_name=AXIS)

        def step(state, batch):
            per_replica = jax.tree.map(
                lambda b: jnp.moveaxis(b.reshape(b.shape[0], R, b.shape[1] // R,
                                                 *b.shape[2:]), 1, 0), batch)

            def local(args):
                state, per_replica = args
                params, opt_state, loss, norm = run_all(state["params"], state["opt_state"],
                                                        per_replica)
                return params, opt_state, state["sync"], loss, norm

            def local_then_meet(args):
                params, opt_state, sync, loss, norm = local(args)
                params, sync = self.exchange(params, sync, leaves)
                return params, opt_state, sync, loss, norm

            s = state["step"]
            # The whole step is inside the conditional, both branches alike, so no
            # collective runs beside it: XLA:CPU does not order a conditional holding
            # collectives against the collectives next to it, and with the replicas'
            # loss and norm reduced beside the meeting a device could enter the
            # meeting's reduce-scatter over `data` while its partner waited in the
            # loss's all-reduce over `tensor`: the step hung until XLA aborted the
            # process 40 s later (found 2026-11-25, in one run of two or three).
            params, opt_state, sync, loss, norm = jax.lax.cond(
                (s + 1) % period == 0, local_then_meet, local, (state, per_replica))
            new = {"step": s + 1, "params": params, "opt_state": opt_state, "sync": sync}
            # One loss and norm per replica: averaged on the host, not over `data`.
            return new, {"loss": loss, "grad_norm": norm, "lr": lr_schedule(s)}

        return step


def for_run(exp: Experiment, mesh: Mesh, pipelined: bool) -> LocalSGD | None:
    """The replicas of a run whose sync.method is "easgd" or "diloco" (None for
    "allreduce"); what they do not run with yet is refused in one line."""
    method = exp.sync.method
    if method == "allreduce":
        return None
    if pipelined:
        raise UserError(
            f"sync.method = \"{method}\" keeps one model per data replica and does not "
            "run with a pipeline yet; use pipeline = 1 or sync.method = \"allreduce\"")
    mode = mesh_lib.tensor_mode(dict(mesh.shape))
    if mode not in (None, "1d"):
        raise UserError(
            f"sync.method = \"{method}\" runs with fsdp and 1-D tensor inside each "
            f"replica, not the {mesh_lib.MODE_NAMES[mode]} tensor mode; use the tensor axis, "
            "or sync.method = \"allreduce\"")
    return LocalSGD(exp.sync, mesh)


def restore_plan(saved_config: dict, cfg: SyncConfig, local: LocalSGD | None,
                 per_layer: tuple[dict, dict], tx: optax.GradientTransformation,
                 shardings: dict):
    """How a run reads a checkpoint written under `saved_config` (see Task.restore_plan),
    or None when nothing about the sync changes it. A checkpoint keeps its sync method
    (another is refused in one line); one of another data replica count is read with
    its replicas whole, and every replica restarts from the center (`per_layer`: the
    canonical parameters' shapes and shardings; `shardings`: the run's canonical state
    shardings)."""
    saved = (saved_config.get("sync") or {}).get("method", "allreduce")
    if saved != cfg.method:
        raise UserError(
            f"the run directory's checkpoints were trained with sync.method = "
            f"\"{saved}\", this run asks for \"{cfg.method}\"; use sync.method = "
            f"\"{saved}\" or a new --run-dir")
    old = int((saved_config.get("mesh") or {}).get("data", 1))
    if local is None or old == local.replicas:
        return None
    abstract = LocalSGD(cfg, local.mesh, old).state_layout(*per_layer, tx,
                                                           sharded=False).abstract()
    adapt = jax.jit(lambda state: local.restart_from_center(state, tx), out_shardings=shardings)
    notice = (f"plait: the checkpoint holds {old} data replicas and this mesh has "
              f"{local.replicas}: every replica restarts from the {cfg.method} center, with a "
              "fresh optimizer state")
    return abstract, adapt, notice


def phases(period: int) -> dict[str, dict[int, list[float]]]:
    """Branch weights that read a local step, a meeting step, and the average step out
    of the compiled program (plait.analysis: the step's one two-way conditional)."""
    return {"local_step": {2: [1.0, 0.0]}, "sync_step": {2: [0.0, 1.0]},
            "mean_step": {2: [1 - 1 / period, 1 / period]}}

