"""The recommendation task (`model.kind = "dlrm"`): sharded tables, data-parallel MLPs.

The step looks the bags up (`parallel.embedding.pooled`), takes the loss and
the gradients of the dense parameters and of the bags, updates the dense part
with optax and the tables sparsely (only the looked-up rows), in one program.
The planner (`plait.planner`) places each table; `tasks.dlrm_tables` converts
the fused buffers to whole tables for checkpoints.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from plait import data, hugepages, sharding
from plait.config import Experiment
from plait.data.clicks import SyntheticClicks
from plait.errors import UserError
from plait.hardware import device_memory_bytes
from plait.models import ModelDef, build, dlrm
from plait.models.dlrm import bce_with_logits
from plait.parallel import embedding as emb
from plait.parallel.sparse_optim import OPTIMIZERS, SparseOptimizer, by_position
from plait.planner import check_memory, plan_tables, row_traffic_per_device
from plait.tasks.base import Evaluator, Source, Task
from plait.tasks.dlrm_tables import TableState
from plait.train.metrics import auc
from plait.train.state import StateLayout, layout, optimizer
from plait.train.step import compute_dtype, dense_update, global_norm, jit_step

BATCH_AXES = ("data", "fsdp")
HELD_OUT = 1 << 40  # steps at and above this index of a source are held out


def check_mesh(exp: Experiment, sizes: dict[str, int]) -> None:
    """One-line errors for a DLRM that does not fit the mesh or is not well formed."""
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
    if exp.sync.method != "allreduce" or exp.sync.reduce == "hierarchical":
        key, value = (("sync.method", exp.sync.method) if exp.sync.method != "allreduce"
                      else ("sync.reduce", exp.sync.reduce))
        raise UserError(f"{key} = \"{value}\" is for dense models (a GPT); a DLRM's sparse "
                        "tables train synchronously: drop it from the [sync] table")
    if t.microbatches != 1:
        raise UserError("train.microbatches must be 1 for a DLRM (its batches are small and "
                        "its tables are updated once per step)")
    n = int(np.prod([sizes.get(a, 1) for a in BATCH_AXES]))
    if t.global_batch % n:
        raise UserError(f"train.global_batch = {t.global_batch} does not split over the "
                        f"{n} devices; make it a multiple of {n}")


class HeldOutAUC:
    """AUC of the model on a few held-out batches: steps `first`, `first` + 1, ... of the
    source (by default past HELD_OUT of the training source; 0 on a held-out day)."""

    def __init__(self, task: DLRMTask, source: Source, batches: int, first: int = HELD_OUT):
        steps = [first + i for i in range(batches)]
        self.task, self.batches = task, [task.batch(source, k) for k in steps]
        # Every process scores the whole held-out set: its labels, gathered once.
        gather = jax.jit(lambda x: x, out_shardings=sharding.replicated(task.mesh))
        self.labels = np.concatenate([np.asarray(gather(b["labels"]).addressable_shards[0].data)
                                      for b in self.batches])

    def __call__(self, state: dict) -> dict[str, float]:
        scores = [np.asarray(jax.device_get(self.task.predict_fn(state, b)
                                            .addressable_shards[0].data))
                  for b in self.batches]
        return {"auc": auc(self.labels, np.concatenate(scores))}


class DLRMTask(Task):
    unit = "samples"
    sweep_axes = BATCH_AXES
    optimizer_keys = ("optimizer.name", "embedding.optimizer")

    def __init__(self, exp: Experiment, mesh: Mesh):
        super().__init__(exp, mesh)
        sizes = dict(mesh.shape)
        check_mesh(exp, sizes)
        self.rules = sharding.rules_for(mesh)
        self.model: ModelDef = build(dlrm.DLRM, exp.model)
        self.axes = tuple(a for a in BATCH_AXES if a in sizes) or (next(iter(sizes)),)
        self.devices = int(np.prod([sizes[a] for a in self.axes]))
        self.plan = plan_tables(exp, self.devices, self.axes)
        self.tables: emb.TableLayout = self.plan.layout
        self.table_state = TableState(self.tables, exp.embedding.optimizer, mesh)
        self.pages_note: str | None = None  # what _in_huge_pages did, for the header
        self.tx, self.lr_schedule = optimizer(exp)
        self.dense_layout: StateLayout = layout(
            self.model.shapes(), sharding.param_shardings(self.model.variables(), mesh,
                                                          self.rules), self.tx, mesh)
        gib = exp.embedding.memory_gib
        self.memory_budget = gib * 2**30 if gib else device_memory_bytes(mesh.devices.flat[0])
        # Dense parameters and their optimizer state, replicated on every device.
        self.dense_bytes = sum(x.size * x.dtype.itemsize
                               for x in jax.tree.leaves(self.dense_layout.shapes))
        check_memory(self.plan, exp.embedding.optimizer, self.memory_budget, self.dense_bytes)
        ax = self.axes if len(self.axes) > 1 else self.axes[0]
        self.batch_sharding = {"dense": NamedSharding(mesh, P(ax, None)),
                               "ids": NamedSharding(mesh, P(ax, None, None)),
                               "labels": NamedSharding(mesh, P(ax))}
        m, B = exp.model, exp.train.global_batch
        self.batch_shapes = {"dense": ((B, m.dense_features), np.float32),
                             "ids": ((B, len(m.embedding_rows), exp.data.ids_per_lookup),
                                     np.int32),
                             "labels": ((B,), np.float32)}

    # ------------------------------------------------------------------ state
    def _with_tables(self, shapes: dict, shardings: dict) -> StateLayout:
        return StateLayout(dict(self.dense_layout.shapes, **shapes),
                           dict(self.dense_layout.shardings, **shardings))

    @functools.cached_property
    def layout(self) -> StateLayout:
        return self._with_tables(*self.table_state.shapes())

    @functools.cached_property
    def canonical_layout(self) -> StateLayout:
        """Every table whole under its own name."""
        return self._with_tables(*self.table_state.canonical_shapes())

    def to_checkpoint(self, state: dict) -> dict:
        return jax.jit(self.table_state.to_canonical,
                       out_shardings=self.canonical_layout.shardings)(state)

    def from_checkpoint(self, state: dict) -> dict:
        return self._in_huge_pages(jax.jit(self.table_state.from_canonical,
                                           out_shardings=self.layout.shardings)(state))

    def _in_huge_pages(self, state: dict) -> dict:
        """state, its tables (and their optimizer state) asked into 2 MiB pages on CPUs;
        the donated step keeps updating these buffers, so once per made state is enough."""
        if self.exp.embedding.huge_pages:
            marked = hugepages.advise(jax.tree.leaves((state["tables"], state["table_opt"])))
            self.pages_note = hugepages.note(marked, "embedding tables")
        return state

    def init_state(self) -> dict:
        def init():
            params = self.model.init(self.exp.seed)
            canonical = {"step": jnp.zeros((), jnp.int32), "params": params,
                         "opt_state": self.tx.init(params),
                         **self.table_state.init_canonical(self.exp.seed)}
            return self.table_state.from_canonical(canonical)

        return self._in_huge_pages(jax.jit(init, out_shardings=self.layout.shardings)())

    # ------------------------------------------------------------------ step
    @property
    def sparse_optimizer(self) -> SparseOptimizer:
        e, o = self.exp.embedding, self.exp.optimizer
        return OPTIMIZERS[e.optimizer](e.lr or o.lr, e.eps, o.b1, o.b2,
                                       by_position(self.mesh.devices.flat[0].platform))

    def _bags(self, state: dict, ids: jax.Array) -> jax.Array:
        """ids [T, B, bag] -> pooled bags [T, B, d]."""
        return emb.pooled(self.tables, self.mesh, state["tables"], ids,
                          self.exp.model.pooling == "mean")

    def logits(self, params: dict, dense: jax.Array, bags: jax.Array) -> jax.Array:
        dtype = compute_dtype(self.exp)
        bags = jnp.transpose(bags, (1, 0, 2))
        if dtype is not None:
            bags = bags.astype(dtype)
        return self.model.module(params, dtype)(dense, bags)

    def _step(self, state: dict, batch: dict):
        exp, sopt = self.exp, self.sparse_optimizer

        def loss_fn(params, bags):
            return bce_with_logits(self.logits(params, batch["dense"], bags), batch["labels"])

        ids = jnp.transpose(batch["ids"], (1, 0, 2))  # [T, B, bag]
        loss, (g_params, g_bags) = jax.value_and_grad(loss_fn, argnums=(0, 1))(
            state["params"], self._bags(state, ids))
        norm = global_norm(g_params)
        params, opt_state = dense_update(self.tx, state["params"], state["opt_state"], g_params,
                                         norm, exp.optimizer.grad_clip)
        lr = self.lr_schedule(state["step"])
        table_lr = (lr * sopt.lr / exp.optimizer.lr).astype(jnp.float32)
        tables, table_opt = emb.sparse_update(
            self.tables, self.mesh, sopt, state["tables"], state["table_opt"], ids, g_bags,
            table_lr, state["step"], exp.model.pooling == "mean")
        new = {"step": state["step"] + 1,
               "params": params,
               "opt_state": opt_state, "tables": tables, "table_opt": table_opt}
        return new, {"loss": loss, "grad_norm": norm, "lr": lr}

    @functools.cached_property
    def step_fn(self):
        return jit_step(self._step, self.mesh, self.layout, self.batch_sharding,
                        self.exp.train.on_nonfinite == "skip")

    @functools.cached_property
    def predict_fn(self):
        """jit(state, batch) -> click logits [B], replicated."""
        def predict(state, batch):
            bags = self._bags(state, jnp.transpose(batch["ids"], (1, 0, 2)))
            return self.logits(state["params"], batch["dense"], bags)

        return jax.jit(predict, in_shardings=(self.layout.shardings, self.batch_sharding),
                       out_shardings=sharding.replicated(self.mesh))

    def abstract_batch(self) -> dict:
        return {k: jax.ShapeDtypeStruct(s, dt, sharding=self.batch_sharding[k])
                for k, (s, dt) in self.batch_shapes.items()}

    # ------------------------------------------------------------------ data
    def source(self) -> Source:
        m, d = self.exp.model, self.exp.data
        if d.source == "clicks":
            return SyntheticClicks(m.table_rows, m.dense_features, d.ids_per_lookup,
                                   d.ids_fixed, d.popularity, d.powerlaw_alpha, self.exp.seed)
        return self._criteo(d.path, "data.path")

    def _criteo(self, path: str | None, key: str) -> Source:
        d, m, B = self.exp.data, self.exp.model, self.exp.train.global_batch
        if not path:
            raise UserError(f"data.source = \"{d.source}\" needs {key}; set it to "
                            + ("a Criteo TSV file" if d.source == "criteo" else
                               "a directory made by plait data criteo"))
        if d.source == "criteo_bin":
            from plait.data.criteo_bin import CriteoBinary

            source: Source = CriteoBinary(path, m.table_rows, B, key)
        else:
            from plait.data.criteo import CriteoTSV

            source = CriteoTSV(path, m.table_rows, B, d.malformed)
        if m.dense_features != 13:
            raise UserError(f"Criteo has 13 dense features; set model.dense_features = 13 "
                            f"(it is {m.dense_features})")
        if d.ids_per_lookup != 1:
            raise UserError("Criteo has one id per table and sample; set "
                            "data.ids_per_lookup = 1")
        return source

    def batch(self, source: Source, step: int) -> dict:
        if isinstance(source, SyntheticClicks):  # made on the devices, each its rows
            return source.device_batch(step, self.exp.train.global_batch, self.batch_sharding)
        return data.global_dict_batch(source, step, self.batch_shapes, self.batch_sharding)

    def evaluator(self, source: Source) -> Evaluator | None:
        n, held_out = self.exp.data.eval_batches, self.exp.data.eval_path
        if not n:
            return None
        if held_out and self.exp.data.source != "clicks":  # a held-out day, from its start
            return HeldOutAUC(self, self._criteo(held_out, "data.eval_path"), n, first=0)
        return HeldOutAUC(self, source, n)

    # ------------------------------------------------------------------ figures
    @property
    def units_per_step(self) -> int:
        return self.exp.train.global_batch

    @classmethod
    def param_count(cls, cfg) -> int:
        """Tables plus the MLPs (the top MLP's input layer left out: a lower bound)."""
        def mlp(widths):
            return sum(a * b + b for a, b in zip(widths[:-1], widths[1:], strict=False))
        return (sum(cfg.table_rows) * cfg.embedding_dim
                + mlp([cfg.dense_features, *cfg.bottom_mlp]) + mlp(cfg.top_mlp))

    @classmethod
    def batch_memory(cls, exp: Experiment) -> tuple[int, str, str]:
        """A batch's ids, dense features and pooled embeddings (int32, float32)."""
        m, ids, rows = exp.model, exp.data.ids_per_lookup, exp.train.global_batch
        tables = len(m.embedding_rows)
        per_row = 4 * (m.dense_features + tables * (ids + m.embedding_dim))
        return (rows * per_row,
                f"train.global_batch = {rows:,} rows of {tables} bags of data.ids_per_lookup "
                f"= {ids:,} ids: the batch", "lower train.global_batch or data.ids_per_lookup")

    def num_params(self) -> int:
        """Dense parameters plus every table's rows x dimension."""
        m = self.exp.model
        return self.model.num_params() + sum(m.table_rows) * m.embedding_dim

    def memory_fixes(self) -> str:
        return ("lower train.global_batch, or spread the tables over more devices "
                "(embedding.sharding = \"row\", or more devices); plait plan shows where "
                "they live")

    def describe(self, state: dict) -> list[str]:
        return [self.table_state.describe(state)]

    def state_notes(self) -> list[str]:
        return [self.pages_note] if self.pages_note else []

    def report(self, analysis: dict) -> dict:
        lay = self.tables
        return {"tables": [{"table": t, "rows": r, "kind": k} for t, (r, k) in
                           enumerate(zip(lay.rows, lay.kinds, strict=True))],
                "largest_table_bytes": max(lay.rows) * lay.dim * 4,
                "largest_collective_bytes": max((op["bytes"] for op in
                                                 analysis["collective_ops"]), default=0)}

    def placement_report(self) -> dict:
        """Each table's placement, size and why; each device's memory (`plait plan`)."""
        lay, opt, exp = self.tables, self.exp.embedding.optimizer, self.exp
        tables = []
        for t, (rows, kind) in enumerate(zip(lay.rows, lay.kinds, strict=True)):
            where = (f"device {lay.owners[t]}" if kind == "table" else
                     "every device" if kind == "replicated" else f"{lay.devices} devices")
            on = lay.owners[t] if kind == "table" else 0
            tables.append({"table": t, "rows": rows, "dim": lay.dim, "kind": kind,
                           "where": where, "bytes": rows * lay.row_bytes(opt),
                           "bytes_per_device": lay.table_bytes_on(t, on, opt),
                           "why": self.plan.why[t]})
        per_device = [b + self.dense_bytes for b in self.plan.per_device_bytes(opt)]
        return {"experiment": exp.name, "devices": lay.devices, "axes": list(lay.axes),
                "optimizer": opt, "tables": tables, "dense_state_bytes": self.dense_bytes,
                "device_bytes": per_device, "budget_bytes": self.memory_budget}

    def row_traffic_bytes(self) -> float:
        return row_traffic_per_device(self.tables, self.exp.embedding.optimizer,
                                      self.exp.train.global_batch, self.exp.data.ids_per_lookup)

    # ------------------------------------------------------------------ sweep
    @classmethod
    def sweep_variants(cls, exp: Experiment, sizes: dict[str, int]) -> list[dict[str, Any]]:
        """Every embedding placement (auto and each kind) the model allows on these devices."""
        check_mesh(exp, sizes)
        n = int(np.prod([sizes.get(a, 1) for a in BATCH_AXES]))
        out = []
        for kind in ("auto", *emb.PLACEMENTS):
            e = exp.model_copy(update={"embedding": exp.embedding.model_copy(
                update={"sharding": kind})})
            try:
                plan_tables(e, n, BATCH_AXES)
            except UserError:
                continue
            out.append({"embedding.sharding": kind})
        return out

    @classmethod
    def sweep_programs(cls, exp: Experiment, sizes: dict[str, int]):
        """Compiled as is (no layers to extrapolate); the plan's memory is judged by the
        target hardware, not by this machine."""
        e = exp.embedding.model_copy(update={"memory_gib": 1e9})
        return [exp.model_copy(update={"embedding": e})], None

    def sweep_extras(self) -> dict:
        return {"row_traffic_bytes": self.row_traffic_bytes(),
                "embedding_kinds": "/".join(self.tables.kinds)}
