"""A DLRM experiment on a mesh: sharded tables, data-parallel MLPs, one jitted step.

The step looks the bags up (parallel.embedding.pooled), takes the loss and the
gradients of the dense parameters and of the bags, updates the dense part
with optax and the tables sparsely, inside the same program. Checkpoints hold
each table whole ("t0", "t1", ...), so a run resumes under another plan or
mesh.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from plait import sharding
from plait.config import Experiment
from plait.errors import UserError
from plait.hardware import device_memory_bytes
from plait.models import ModelDef, build
from plait.models.dlrm import bce_with_logits
from plait.parallel import embedding as emb
from plait.planner import check_memory, plan_tables
from plait.train.state import StateLayout, layout, optimizer
from plait.train.step import _global_norm, clip_by_norm, compute_dtype

BATCH_AXES = ("data", "fsdp")


def check_dlrm(exp: Experiment, sizes: dict[str, int]) -> None:
    m, t = exp.model, exp.train
    others = sorted(a for a, s in sizes.items() if s > 1 and a not in BATCH_AXES)
    if others:
        raise UserError(f"a DLRM runs on data and fsdp axes only (its tables are sharded over "
                        f"them); drop {', '.join(others)} from the mesh")
    if m.bottom_mlp[-1] != m.embedding_dim:
        raise UserError(f"model.bottom_mlp must end in model.embedding_dim = {m.embedding_dim} "
                        f"(its output meets the embeddings), got {m.bottom_mlp}")
    if m.top_mlp[-1] != 1:
        raise UserError(f"model.top_mlp must end in 1 (the click logit), got {m.top_mlp}")
    if t.microbatches != 1:
        raise UserError("train.microbatches must be 1 for a DLRM (its batches are small and "
                        "its tables are updated once per step)")
    n = 1
    for a in BATCH_AXES:
        n *= sizes.get(a, 1)
    if t.global_batch % n:
        raise UserError(f"train.global_batch = {t.global_batch} does not split over the "
                        f"{n} devices; make it a multiple of {n}")


def _canonical_spec(shape: tuple[int, ...], axes: tuple[str, ...], n: int) -> P:
    """Checkpoint layout of one table: split by rows, else by columns, else whole."""
    ax = axes if len(axes) > 1 else axes[0]
    if n > 1 and shape[0] % n == 0:
        return P(ax, *([None] * (len(shape) - 1)))
    if n > 1 and len(shape) > 1 and shape[1] % n == 0:
        return P(None, ax)
    return P(*([None] * len(shape)))


@dataclass
class DLRMJob:
    exp: Experiment
    mesh: Mesh

    def __post_init__(self) -> None:
        sizes = dict(self.mesh.shape)
        check_dlrm(self.exp, sizes)
        self.rules = sharding.rules_for(self.mesh)
        self.model: ModelDef = build(self.exp.model)
        self.axes = tuple(a for a in BATCH_AXES if a in sizes) or (next(iter(sizes)),)
        self.devices = int(np.prod([sizes[a] for a in self.axes]))
        self.plan = plan_tables(self.exp, self.devices, self.axes)
        self.lay: emb.Layout = self.plan.layout
        self.opt_name = self.exp.embedding.optimizer
        self.tx, self.schedule = optimizer(self.exp)
        self.dense_layout: StateLayout = layout(self.model, self.tx, self.mesh, self.rules)
        gib = self.exp.embedding.memory_gib
        self.memory_budget = (gib * 2**30 if gib else
                              device_memory_bytes(self.mesh.devices.flat[0]))
        # Dense parameters and their optimizer state, replicated on every device.
        self.dense_bytes = sum(x.size * x.dtype.itemsize
                               for x in jax.tree.leaves(self.dense_layout.shapes))
        check_memory(self.plan, self.opt_name, self.memory_budget, self.dense_bytes)
        ax = self.axes if len(self.axes) > 1 else self.axes[0]
        self.batch_sharding = {"dense": NamedSharding(self.mesh, P(ax, None)),
                               "ids": NamedSharding(self.mesh, P(ax, None, None)),
                               "labels": NamedSharding(self.mesh, P(ax))}
        m, d = self.exp.model, self.exp.data
        B = self.exp.train.global_batch
        self.batch_shapes = {"dense": ((B, m.dense_features), np.float32),
                             "ids": ((B, len(m.embedding_rows), d.ids_per_lookup), np.int32),
                             "labels": ((B,), np.float32)}

    # ---------------------------------------------------------- layouts

    @cached_property
    def layout(self) -> StateLayout:
        tables_sh, topt_sh = emb.shardings(self.lay, self.mesh, self.opt_name)
        shapes = dict(self.dense_layout.shapes)
        shapes["tables"] = {k: jax.ShapeDtypeStruct(self.lay.buffer_shape(k), jnp.float32)
                            for k in self.lay.present}
        shapes["table_opt"] = emb.opt_state_shapes(self.lay, self.opt_name)
        shard = dict(self.dense_layout.shardings, tables=tables_sh, table_opt=topt_sh)
        return StateLayout(shapes, shard)

    def _canonical_tables(self) -> tuple[dict, dict, dict, dict]:
        m = self.exp.model
        shapes, shard, oshapes, oshard = {}, {}, {}, {}
        for t, r in enumerate(m.table_rows):
            s = (r, m.embedding_dim)
            shapes[f"t{t}"] = jax.ShapeDtypeStruct(s, jnp.float32)
            shard[f"t{t}"] = NamedSharding(self.mesh, _canonical_spec(s, self.axes, self.devices))
            if self.opt_name == "adagrad":
                oshapes[f"t{t}"] = {"acc": jax.ShapeDtypeStruct((r,), jnp.float32)}
                oshard[f"t{t}"] = {"acc": NamedSharding(
                    self.mesh, _canonical_spec((r,), self.axes, self.devices))}
            elif self.opt_name == "adam":
                oshapes[f"t{t}"] = {"m": shapes[f"t{t}"], "v": shapes[f"t{t}"]}
                oshard[f"t{t}"] = {"m": shard[f"t{t}"], "v": shard[f"t{t}"]}
            else:
                oshapes[f"t{t}"], oshard[f"t{t}"] = {}, {}
        return shapes, shard, oshapes, oshard

    @cached_property
    def canonical_layout(self) -> StateLayout:
        """What checkpoints hold: every table whole under its own name."""
        shapes, shard, oshapes, oshard = self._canonical_tables()
        return StateLayout(dict(self.dense_layout.shapes, tables=shapes, table_opt=oshapes),
                           dict(self.dense_layout.shardings, tables=shard, table_opt=oshard))

    # ---------------------------------------------------------- conversions

    def _to_canonical(self, state: dict) -> dict:
        T = len(self.lay.rows)
        tables = emb.unfuse(self.lay, state["tables"])
        opt = {f"t{t}": {} for t in range(T)}
        for key in {"adagrad": ("acc",), "adam": ("m", "v")}.get(self.opt_name, ()):
            bufs = {k: v[key] for k, v in state["table_opt"].items()}
            if key == "acc":
                bufs = {k: v[:, None] for k, v in bufs.items()}
            for t, a in enumerate(emb.unfuse(self.lay, bufs)):
                opt[f"t{t}"][key] = a[:, 0] if key == "acc" else a
        return dict(state, tables={f"t{t}": a for t, a in enumerate(tables)}, table_opt=opt)

    def _from_canonical(self, state: dict) -> dict:
        T = len(self.lay.rows)
        tables = emb.fuse(self.lay, [state["tables"][f"t{t}"] for t in range(T)])
        opt = {k: {} for k in self.lay.present}
        for key in {"adagrad": ("acc",), "adam": ("m", "v")}.get(self.opt_name, ()):
            per = [state["table_opt"][f"t{t}"][key] for t in range(T)]
            if key == "acc":
                per = [a[:, None] for a in per]
            fused = emb.fuse(self.lay, per)
            for k, a in fused.items():
                opt[k][key] = a[:, 0] if key == "acc" else a
        return dict(state, tables=tables, table_opt=opt)

    def to_checkpoint(self, state: dict) -> dict:
        return jax.jit(self._to_canonical,
                       out_shardings=self.canonical_layout.shardings)(state)

    def from_checkpoint(self, state: dict) -> dict:
        return jax.jit(self._from_canonical, out_shardings=self.layout.shardings)(state)

    def init_state(self) -> dict:
        m, seed = self.exp.model, self.exp.seed

        def init():
            params = self.model.init(seed)
            tables = {f"t{t}": emb.init_table(seed, t, r, m.embedding_dim)
                      for t, r in enumerate(m.table_rows)}
            opt = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype),
                               self.canonical_layout.shapes["table_opt"])
            canonical = {"step": jnp.zeros((), jnp.int32), "params": params,
                         "opt_state": self.tx.init(params), "tables": tables, "table_opt": opt}
            return self._from_canonical(canonical)

        return jax.jit(init, out_shardings=self.layout.shardings)()

    # ---------------------------------------------------------- step

    @property
    def sparse_opt(self) -> emb.SparseOpt:
        e, o = self.exp.embedding, self.exp.optimizer
        return emb.SparseOpt(self.opt_name, e.lr or o.lr, e.eps, o.b1, o.b2)

    def forward_bags(self, state: dict, ids: jax.Array) -> jax.Array:
        mean = self.exp.model.pooling == "mean"
        return emb.pooled(self.lay, self.mesh, state["tables"], jnp.transpose(ids, (1, 0, 2)),
                          mean)

    def logits(self, params: dict, dense: jax.Array, bags: jax.Array) -> jax.Array:
        dtype = compute_dtype(self.exp)
        bags = jnp.transpose(bags, (1, 0, 2))
        if dtype is not None:
            bags = bags.astype(dtype)
        return self.model.module(params, dtype)(dense, bags)

    @cached_property
    def step_fn(self):
        exp, lay, mesh = self.exp, self.lay, self.mesh
        mean = exp.model.pooling == "mean"
        sopt = self.sparse_opt
        lr_ratio = sopt.lr / exp.optimizer.lr
        tx, schedule = self.tx, self.schedule

        def loss_fn(params, bags, batch):
            return bce_with_logits(self.logits(params, batch["dense"], bags), batch["labels"])

        def step(state, batch):
            ids = jnp.transpose(batch["ids"], (1, 0, 2))  # [T, B, bag]
            bags = emb.pooled(lay, mesh, state["tables"], ids, mean)
            loss, (g_params, g_bags) = jax.value_and_grad(loss_fn, argnums=(0, 1))(
                state["params"], bags, batch)
            norm = _global_norm(g_params)
            g_params = clip_by_norm(g_params, norm, exp.optimizer.grad_clip)
            updates, opt_state = tx.update(g_params, state["opt_state"], state["params"])
            lr = schedule(state["step"])
            tables, table_opt = emb.sparse_update(
                lay, mesh, sopt, state["tables"], state["table_opt"], ids, g_bags,
                (lr * lr_ratio).astype(jnp.float32), state["step"], mean)
            new = {"step": state["step"] + 1, "params": optax.apply_updates(state["params"],
                                                                            updates),
                   "opt_state": opt_state, "tables": tables, "table_opt": table_opt}
            return new, {"loss": loss, "grad_norm": norm, "lr": lr}

        rep = sharding.replicated(mesh)
        return jax.jit(step, in_shardings=(self.layout.shardings, self.batch_sharding),
                       out_shardings=(self.layout.shardings,
                                      {"loss": rep, "grad_norm": rep, "lr": rep}),
                       donate_argnums=0)

    def abstract_batch(self) -> dict:
        return {k: jax.ShapeDtypeStruct(s, dt, sharding=self.batch_sharding[k])
                for k, (s, dt) in self.batch_shapes.items()}

    def compile(self, compiler_options: dict | None = None):
        lowered = self.step_fn.lower(self.layout.abstract(), self.abstract_batch())
        return lowered.compile(compiler_options) if compiler_options else lowered.compile()

    @cached_property
    def eval_fn(self):
        rep = sharding.replicated(self.mesh)

        def predict(state, batch):
            bags = self.forward_bags(state, batch["ids"])
            return self.logits(state["params"], batch["dense"], bags)

        return jax.jit(predict, in_shardings=(self.layout.shardings, self.batch_sharding),
                       out_shardings=rep)

    # ---------------------------------------------------------- data

    def source(self):
        from plait.data import make_source

        return make_source(self.exp)

    def batch(self, source, step: int) -> dict:
        from plait.data import global_dict_batch

        return global_dict_batch(source, step, self.batch_shapes, self.batch_sharding)

    @property
    def units_per_step(self) -> int:
        return self.exp.train.global_batch

    unit = "samples"

    def lookup_bytes_per_device(self) -> float:
        """Bytes of table rows the busiest device moves per step: gathers for the bags, and
        the read and write of every updated row (optimizer state alike)."""
        lay, B = self.lay, self.exp.train.global_batch
        L = self.exp.data.ids_per_lookup
        row = lay.dim * 4 * {"sgd": 3, "adagrad": 3, "adam": 7}[self.opt_name]
        load = [0.0] * lay.devices
        for t, kind in enumerate(lay.kinds):
            if kind == "replicated":  # local bags; every replica applies every update
                for p in range(lay.devices):
                    load[p] += B / lay.devices * L * lay.dim * 4 + B * L * (row - lay.dim * 4)
            elif kind == "table":
                load[lay.owners[t]] += B * L * row
            elif kind == "row":  # every id is checked on every device, 1/P of them are here
                for p in range(lay.devices):
                    load[p] += B * L * lay.dim * 4 + B * L / lay.devices * (row - lay.dim * 4)
            else:
                for p in range(lay.devices):
                    load[p] += B * L * row / lay.devices
        return max(load)

    def describe_tables(self, state: dict) -> str:
        """Which kind each table is, and how much of the tables this process holds."""
        kinds = ", ".join(f"{k} x{self.lay.kinds.count(k)}" for k in emb.KINDS
                          if k in self.lay.kinds)
        held = {k: sum(s.data.size for s in v.addressable_shards
                       if s.replica_id == 0) for k, v in state["tables"].items()}
        parts = []
        for k, v in state["tables"].items():
            parts.append(f"{k} {held[k]:,}/{v.size:,}")
        return (f"plait: tables {kinds}; elements held by this process's devices "
                f"(one copy): {'; '.join(parts)}")

    def num_params(self) -> int:
        """Dense parameters plus every table's rows x dimension."""
        m = self.exp.model
        return self.model.num_params() + sum(m.table_rows) * m.embedding_dim
