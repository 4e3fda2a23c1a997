"""The language-model task (`model.kind = "gpt"`): a GPT over every parallel mode.

Data, fsdp and 1-D tensor parallelism come from the rule set's annotations,
2-D / 2.5-D / 3-D tensor parallelism from `parallel.tensor` (through the
model's `dense` / `lookup`), the pipeline from `train.pipelined`. With
`model.scan_layers` the blocks live stacked [layers, ...] in the state, the
optimizer and the step. Checkpoints hold one entry per layer whatever the
layout, so a run resumes scanned or not, pipelined or not.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import replace
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from plait import data, loss_mask, models, sharding
from plait import mesh as mesh_lib
from plait.config import Experiment
from plait.data.tokens import loss_mask_path
from plait.errors import UserError
from plait.models import gpt, gpt_counts
from plait.models.gpt import abstract_model
from plait.parallel import context, hierarchical, local_sgd, router_grad
from plait.tasks import gpt_data, gpt_report, gpt_sweep
from plait.tasks.base import Evaluator, Source, Task
from plait.tasks.gpt_checkpoint import DecoderCheckpoints
from plait.tasks.gpt_checks import check_fits, context_attention, decoder_rules, memory_fixes
from plait.tasks.gpt_runtime import (
    attention_for,
    grouped_for,
    kernels_for,
    scan_for,
    start_up_lines,
)
from plait.train.pipelined import Pipelined
from plait.train.state import StateLayout, init_state, layout, optimizer
from plait.train.step import (
    accumulated,
    compute_dtype,
    dense_update,
    global_norm,
    jit_step,
    make_train_step,
)

# The router figures a mixture of experts reports each logged step (models.moe.summarize).
MOE_METRICS = ("moe_aux_loss", "moe_z_loss", "moe_tokens_max", "moe_tokens_mean",
               "moe_dropped_fraction")


class GPTTask(DecoderCheckpoints, Task):
    unit = "tokens"
    sweep_axes = mesh_lib.AXES

    def __init__(self, exp: Experiment, mesh: Mesh):
        super().__init__(exp, mesh)
        self.context_attention, self.context_why = context_attention(
            dict(mesh.shape), exp.context.attention)
        self.rules = decoder_rules(dict(mesh.shape), exp.model, self.context_attention)
        device = mesh.devices.flat[0]
        self.attention, self.attention_why = attention_for(
            exp.model, exp.precision.compute, device.platform, device.device_kind,
            exp.data.document_mask)
        scan, self.scan_why = scan_for(exp.model, device.platform)
        grouped, self.grouped_why = grouped_for(exp.model, exp.precision.compute, device,
                                                dict(mesh.shape))
        kernels, self.kernels_why = kernels_for(exp.model, device)
        resolved = {"attention": self.attention, "scan_layers": scan, "moe": grouped.moe,
                    **kernels}
        if any(getattr(exp.model, k) != v for k, v in resolved.items()):
            # The model runs the resolved kernel and layout.
            exp = exp.model_copy(update={"model": exp.model.model_copy(update=resolved)})
            self.exp = exp
        self.model = abstract_model(exp.model)
        check_fits(exp, dict(mesh.shape), self.rules, self.model)
        self.pipeline: Pipelined | None = None
        if mesh.shape.get("pipeline", 1) > 1:
            self.pipeline = Pipelined(exp, mesh, self.model, self.rules, "blocks", gpt.Block,
                                      stacked=exp.model.scan_layers)
        self.stacked = exp.model.scan_layers is True and exp.model.layers > 0
        self.local = local_sgd.for_run(exp, mesh, pipelined=self.pipeline is not None)
        self.data_split = hierarchical.for_run(exp, mesh, pipelined=self.pipeline is not None)
        if self.local and exp.model.moe is not None:
            raise UserError("a mixture of experts trains with sync.method = \"allreduce\" "
                            "and one flat gradient all-reduce (it is not traced per data "
                            "replica); set sync.method = \"allreduce\" and sync.reduce = "
                            "\"flat\"")
        if exp.model.fp8_history and (self.local or self.pipeline):
            what, fix = ((f"sync.method = \"{exp.sync.method}\" (its replicas would sum the "
                          "scaling state, which combines by maximum)",
                          "use sync.method = \"allreduce\"") if self.local else
                         ("a pipeline axis (its stages would sum the scaling state over "
                          "microbatches, which combines by maximum)", "drop the pipeline axis"))
            raise UserError(f"precision.matmul = \"fp8\" does not train with {what}; {fix}, "
                            "or set precision.matmul = \"default\"")
        # data.document_mask: each token attends within its own document.
        self.documents = exp.data.document_mask and exp.data.source == "tokens"
        if (self.local or self.data_split) and self.context_attention == "ring":
            # The model is traced per data replica (vmap over `data`), and a shard_map
            # manual over `context` alone cannot be batched over an axis it leaves to GSPMD.
            self.context_attention = "allgather"
            self.context_why = ("the model runs per data replica (sync.method or a data "
                                "axis across hosts), where a ring cannot")
            self.rules = replace(self.rules, context_attention="allgather")
        mask = (self.pipeline.decay_mask if self.pipeline
                else models.decay_mask(self.model.variables()))
        self.tx, self.lr_schedule = optimizer(exp, mask)
        if self.pipeline:
            params = (self.pipeline.param_shapes, self.pipeline.param_shardings)
        else:
            params = (self.model.shapes(),
                      sharding.param_shardings(self.model.variables(), mesh, self.rules))
        self._params = params
        self._layout = (self.local.state_layout(*params, self.tx) if self.local
                        else layout(*params, self.tx, mesh))
        # A loss mask beside the token file: the step's loss counts the targets it keeps.
        self.kept_only = (exp.data.source == "tokens" and bool(exp.data.path)
                          and loss_mask_path(exp.data.path).is_file())
        t, n = exp.train, (self.pipeline.microbatches if self.pipeline else exp.train.microbatches)
        # [microbatch, row, token]: rows split over the batch axes.
        self.batch_shape = (n, t.global_batch // n, exp.model.seq_len + 1)
        self.batch_sharding: NamedSharding = sharding.batch_sharding(mesh, self.rules, 3,
                                                                     batch_dim=1)

    # ------------------------------------------------------------------ state
    @property
    def layout(self) -> StateLayout:
        return self._layout

    def init_state(self, params: dict | None = None) -> dict:
        """A fresh state: new parameters, or `params` (canonical, one entry per layer:
        imported weights) with a fresh optimizer state."""
        if self.local:
            return jax.jit(lambda g: self.local.init(self._laid_out(g), self.tx),
                           out_shardings=self.layout.shardings)(params)
        return init_state(self._laid_out, self.tx, self.layout, params)

    # ------------------------------------------------------------------ step
    def loss(self, params: dict, tokens: jax.Array, rules: sharding.Rules | None = None
             ) -> jax.Array:
        """Mean next-token loss of tokens [rows, seq + 1] (under the task's rules, or
        `rules`). A mixture of experts' router losses are not in it: their gradients join
        inside the layers (models.moe), their values are metrics (loss_and_metrics)."""
        return self.loss_and_metrics(params, tokens, rules)[0]

    def loss_and_metrics(self, params: dict, tokens: jax.Array,
                         rules: sharding.Rules | None = None) -> tuple[jax.Array, dict]:
        """(the loss, the model's figures of the step: its router metrics, if any)."""
        with sharding.use(self.mesh, rules or self.rules):
            inputs, targets = context.inputs_targets(tokens)
            module = self.model.module(params, compute_dtype(self.exp))
            with (loss_mask.documents(context.document_segments(tokens),
                                      context.document_positions(tokens))
                  if self.documents else contextlib.nullcontext()):
                x, metrics = module.hidden(inputs)
            return module.loss(x, targets), metrics

    @property
    def model_metrics(self) -> tuple[str, ...]:
        """The metrics the step reports beside the loss: a mixture of experts' router
        figures (a pipeline computes them inside its stages and reports none)."""
        if self.exp.model.moe is None or self.pipeline is not None:
            return ()
        return MOE_METRICS

    def _pipeline_loss_and_grads(self, params: dict, batch: jax.Array):
        # Each microbatch's gradient reaches a stage divided by the microbatches: so does
        # the router losses' (parallel.router_grad.aux_scale).
        with sharding.use(self.mesh, self.rules), \
                router_grad.aux_scale(1.0 / self.pipeline.microbatches):
            return self.pipeline.loss_and_grads(params, batch, compute_dtype(self.exp),
                                                self.documents)

    def _replica_grads(self):
        """(params, batch) -> (loss, grads) of one data replica's rows, for a model
        traced per replica (vmap with spmd_axis_name="data")."""
        shardings = self._params[1]
        rules = sharding.without_axis(self.rules, "data")  # the replica's own axis
        return accumulated(functools.partial(self.loss, rules=rules),
                           lambda g: jax.lax.with_sharding_constraint(g, shardings))

    def _hierarchical_loss_and_grads(self, params: dict, batch: jax.Array):
        """Loss and gradients averaged over data replicas within each host first
        (parallel.hierarchical)."""
        R = self.mesh.shape["data"]
        per_replica = jnp.moveaxis(batch.reshape(batch.shape[0], R, batch.shape[1] // R,
                                                 *batch.shape[2:]), 1, 0)
        loss, grads = jax.vmap(self._replica_grads(), in_axes=(None, 0),
                               spmd_axis_name="data")(params, per_replica)
        specs = jax.tree.map(lambda sh: sh.spec, self._params[1])
        return jnp.mean(loss), hierarchical.mean_over_data(grads, specs, self.mesh,
                                                            self.data_split)

    def _batch_context(self, batch, kept: bool | None = None) -> contextlib.ExitStack:
        """What the batch carries besides ids, for the step being traced: a loss mask (the
        loss over the kept targets of the whole batch: loss_mask.kept_targets) and
        document starts (data.document_mask)."""
        stack = contextlib.ExitStack()
        if self.kept_only if kept is None else kept:
            stack.enter_context(loss_mask.kept_targets(batch))
        if self.documents:
            stack.enter_context(loss_mask.flagged())
        return stack

    def _in_batch_context(self, loss_and_grads):
        """loss_and_grads within the batch's context (_batch_context), where it has one."""
        if not (self.kept_only or self.documents):
            return loss_and_grads

        def in_context(params, batch):
            with self._batch_context(batch):
                return loss_and_grads(params, batch)
        return in_context

    def _local_step(self):
        """The step of replicas that sync every sync.period steps (parallel.local_sgd)."""
        shapes, shardings = self._params
        grads_of = self._in_batch_context(self._replica_grads())  # each replica's own mean

        def replica_step(params, opt_state, batch):
            value, grads = grads_of(params, batch)
            norm = global_norm(grads)
            params, opt_state = dense_update(self.tx, params, opt_state, grads, norm,
                                             self.exp.optimizer.grad_clip)
            return params, opt_state, value, norm

        step = self.local.make_step(replica_step, self.local.leaves(shapes, shardings),
                                    self.lr_schedule)
        return jit_step(step, self.mesh, self.layout, self.batch_sharding,
                        self.exp.train.on_nonfinite == "skip", per_replica="data")

    @functools.cached_property
    def step_fn(self):
        if self.local:
            return self._local_step()
        pipe = self.pipeline
        loss_and_grads = (self._pipeline_loss_and_grads if pipe else
                          self._hierarchical_loss_and_grads if self.data_split else None)
        extra = self.model_metrics
        loss_fn = self.loss_and_metrics if extra else self.loss
        if self.kept_only or self.documents:
            loss_and_grads = self._in_batch_context(loss_and_grads or accumulated(
                loss_fn, lambda g: jax.lax.with_sharding_constraint(g, self.layout.params),
                has_aux=bool(extra)))
        return make_train_step(
            self.mesh, self.layout, self.batch_sharding, self.tx, self.lr_schedule,
            self.exp.optimizer.grad_clip, loss_fn=loss_fn,
            loss_and_grads=loss_and_grads, skip_nonfinite=self.exp.train.on_nonfinite == "skip",
            extra_metrics=extra, **({"grad_norm": pipe.grad_norm} if pipe else {}))

    def abstract_batch(self) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(self.batch_shape, np.int32, sharding=self.batch_sharding)

    def cache_unsafe(self) -> bool:
        return (self.pipeline is not None and self.mesh.devices.flat[0].platform == "cpu"
                and mesh_lib.tensor_mode(dict(self.mesh.shape)) not in (None, "1d"))

    def branches_diverge(self) -> bool:
        return self.pipeline is not None

    def memory_fixes(self) -> str:
        return memory_fixes(self.exp, self.pipeline is not None)

    def branch_weights(self):
        if self.local:
            return local_sgd.phases(self.exp.sync.period)["mean_step"]
        if self.pipeline:
            return self.pipeline.ticks.branch_weights()
        if self.mesh.shape.get("context", 1) > 1 and self.context_attention == "ring":
            # Each ring step runs one of its two equal halves (parallel.context).
            return {2: [0.5, 0.5]}
        return None

    def phases(self) -> dict[str, dict[int, list[float]]]:
        return local_sgd.phases(self.exp.sync.period) if self.local else {}

    # ------------------------------------------------------------------ data
    def source(self) -> Source:
        return gpt_data.source(self.exp, self.documents)

    def batch(self, source: Source, step: int) -> jax.Array:
        return data.global_batch(source, step, self.batch_shape, self.batch_sharding,
                                 self.local.replicas if self.local else 1)

    def run_files(self, source: Source, run_dir: Path) -> dict[str, Path]:
        return gpt_data.run_files(source, run_dir)

    def evaluator(self, source: Source) -> Evaluator | None:
        return gpt_data.evaluator(self)

    @functools.cached_property
    def eval_loss_fn(self):
        """jit(params, batch) -> (mean loss over the batch's kept targets, how many it
        keeps), replicated; on the training mesh and layout (no gather of the
        parameters), in train.microbatches pieces like the step."""
        pipe = self.pipeline

        def mean(params, batch):
            if pipe is not None:  # the pipeline's forward comes with its backward
                return self._pipeline_loss_and_grads(params, batch)[0]
            if batch.ndim == 3:  # [microbatches, rows, seq + 1], as the step takes it
                return jnp.mean(jax.lax.map(lambda b: self.loss(params, b), batch))
            return self.loss(params, batch)

        def loss(params, batch):
            with self._batch_context(batch, kept=True):
                return mean(params, batch), loss_mask.kept_count(batch)
        return jax.jit(loss, out_shardings=sharding.replicated(self.mesh))

    # ------------------------------------------------------------------ figures
    @property
    def units_per_step(self) -> int:
        return self.exp.train.global_batch * self.exp.model.seq_len

    def num_params(self) -> int:
        return self.model.num_params()

    @classmethod
    def param_count(cls, cfg) -> int:
        return gpt_counts.param_count(cfg)

    @classmethod
    def batch_memory(cls, exp: Experiment) -> tuple[int, str, str]:
        """One residual stream of a microbatch (every layer reads and writes one)."""
        m, t = exp.model, exp.train
        width = 2 if exp.precision.compute == "bfloat16" else 4
        return (t.global_batch // t.microbatches * m.seq_len * m.d_model * width,
                f"train.global_batch = {t.global_batch:,} in train.microbatches = "
                f"{t.microbatches}: one microbatch's residual stream",
                "lower train.global_batch or raise train.microbatches")

    def flops_per_unit(self) -> float:
        return gpt_counts.flops_per_token(self.exp.model)

    def describe(self, state: dict) -> list[str]:
        return start_up_lines(self)

    def report(self, analysis: dict) -> dict:
        return gpt_report.figures(self, analysis)

    # ------------------------------------------------------------------ sweep
    @classmethod
    def sweep_axes_for(cls, exp: Experiment) -> tuple[str, ...]:
        return gpt_sweep.axes_for(exp, cls.sweep_axes)

    @classmethod
    def sweep_variants(cls, exp: Experiment, sizes: dict[str, int]) -> list[dict[str, Any]]:
        return gpt_sweep.variants(exp, sizes)

    @classmethod
    def sweep_programs(cls, exp: Experiment, sizes: dict[str, int]):
        return gpt_sweep.programs(exp, sizes)

    def sweep_extras(self) -> dict:
        return {"figures": self.pipeline.figures} if self.pipeline else {}
