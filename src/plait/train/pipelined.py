"""The train state and step of a pipelined run (mesh axis `pipeline` > 1).

In memory, each rank holds only its stages: the layers' parameters (and their
optimizer moments) are stacked as [rank, chunk, layer of the stage, ...] and
split over `pipeline`; the rest of the model (embedding, final norm, head) is
replicated over it. On disk the state is canonical (one entry per layer,
`params["blocks"]["7"]`), exactly what a run without pipeline saves, so a run
resumes with another number of stages, another schedule, or none.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from plait import loss_mask, sharding
from plait.config import Experiment
from plait.errors import UserError
from plait.models import ModelDef, build, flat_to_pure, layer_stack
from plait.parallel import context, pipeline, schedules
from plait.parallel.tick_table import tick_table
from plait.train.state import map_params


def _is_var(x) -> bool:
    return hasattr(x, "get_metadata")


class Pipelined:
    """A model cut into embed -> repeated layers -> head, laid over the pipeline ranks.

    The model's module must have `embed(tokens)` and `logits(x)`, and keep its
    repeated layers, each a `layer_cls(cfg, keys)`, under `params[layer_key]`:
    one entry per layer, or stacked [layers, ...] (`stacked`), which the stages
    take by one gather, so the program does not grow with depth.
    """

    def __init__(self, exp: Experiment, mesh: Mesh, model: ModelDef, rules: sharding.Rules,
                 layer_key: str, layer_cls: type, stacked: bool = False):
        self.exp, self.mesh, self.model = exp, mesh, model
        cfg, pc = exp.model, exp.pipeline
        D = mesh.shape["pipeline"]
        if exp.train.microbatches != 1:
            raise UserError(
                f"with a pipeline, split the batch with pipeline.microbatches, not "
                f"train.microbatches = {exp.train.microbatches}; set train.microbatches = 1")
        N = pc.microbatches or D
        self.schedule = schedules.build(pc.schedule, D, N, pc.virtual_stages)
        v = self.schedule.virtual
        stages = D * v
        if cfg.layers % stages:
            raise UserError(
                f"model.layers = {cfg.layers} does not split evenly over {stages} pipeline stages"
                + (f" (pipeline {D} x pipeline.virtual_stages {v})" if v > 1 else "")
                + f"; use a layer count that is a multiple of {stages}")
        for split, replicas in sharding.batch_splits(rules, dict(mesh.shape)):
            if exp.train.global_batch % (N * replicas):
                raise UserError(
                    f"train.global_batch = {exp.train.global_batch} does not split into "
                    f"pipeline.microbatches = {N} of rows over "
                    f"{' x '.join(split) or 'data x fsdp'} = {replicas}; make it a multiple "
                    f"of {N * replicas}")
        self.ticks = tick_table(self.schedule, cfg.layers, pc.recompute)
        self.key = layer_key
        # The model without its repeated layers: what every rank keeps whole.
        self.shared_model = build(model.cls, cfg.model_copy(update={"layers": 0}))
        self.layers = layer_stack(layer_cls, cfg)
        self.recompute = pc.recompute
        self.microbatches = N
        C, Lps = self.ticks.chunks, self.ticks.layers_per_stage
        lead = (D, C, Lps)

        self.stacked = stacked
        layer_vars = flat_to_pure(nnx.to_flat_state(self.layers.abstract))
        stage_shapes = jax.tree.map(
            lambda v: jax.ShapeDtypeStruct(lead + v.get_value().shape, v.get_value().dtype),
            layer_vars, is_leaf=_is_var)
        stage_sh = jax.tree.map(
            lambda v: NamedSharding(mesh, P("pipeline", None, None,
                                            *sharding.param_spec(*sharding.param_meta(v),
                                                                 rules, mesh))),
            layer_vars, is_leaf=_is_var)
        self.param_shapes = {"stages": stage_shapes, "shared": self.shared_model.shapes()}
        self.param_shardings = {
            "stages": stage_sh,
            "shared": sharding.param_shardings(self.shared_model.variables(), mesh, rules)}
        # [rank, chunk, i] -> canonical layer, and each canonical layer's first holder.
        self.holder = {}
        for r in range(D):
            for c in range(C):
                for i in range(Lps):
                    self.holder.setdefault(self.ticks.layer_of(r, c, i), (r, c, i))

    def decay_mask(self, params: dict) -> dict:
        """AdamW decays matrices, not vectors: judged on each layer's own shape."""
        return {"stages": jax.tree.map(lambda p: p.ndim - 3 >= 2, params["stages"]),
                "shared": jax.tree.map(lambda p: p.ndim >= 2, params["shared"])}

    # --- canonical <-> stacked -------------------------------------------------
    def from_canonical(self, params: dict) -> dict:
        """The model's parameters -> {"stages": [rank, chunk, layer, ...], "shared"}."""
        D, C, Lps = self.ticks.ranks, self.ticks.chunks, self.ticks.layers_per_stage
        layers = params[self.key]
        order = [self.ticks.layer_of(r, c, i)
                 for r in range(D) for c in range(C) for i in range(Lps)]
        if self.stacked:
            index = np.asarray(order)
            stages = jax.tree.map(
                lambda a: jnp.take(a, index, axis=0).reshape((D, C, Lps) + a.shape[1:]), layers)
        else:
            def stack(*leaves):
                return jnp.stack(leaves).reshape((D, C, Lps) + leaves[0].shape)

            stages = jax.tree.map(stack, *(layers[str(k)] for k in order))
        shared = {k: v for k, v in params.items() if k != self.key}
        return {"stages": stages, "shared": shared}

    def to_canonical(self, params: dict) -> dict:
        """The inverse of from_canonical (a layer held twice, as Chimera does, read once)."""
        if self.stacked:
            _, C, Lps = self.ticks.ranks, self.ticks.chunks, self.ticks.layers_per_stage
            index = np.asarray([r * C * Lps + c * Lps + i
                                for _, (r, c, i) in sorted(self.holder.items())])
            layers = jax.tree.map(lambda a: jnp.take(a.reshape((-1,) + a.shape[3:]), index,
                                                     axis=0), params["stages"])
        else:
            layers = {str(layer): jax.tree.map(lambda a, idx=idx: a[idx], params["stages"])
                      for layer, idx in sorted(self.holder.items())}
        return {**params["shared"], self.key: layers}

    def is_params(self, tree) -> bool:
        return isinstance(tree, dict) and set(tree) == {"stages", "shared"}

    def map_state(self, state: dict, fn) -> dict:
        """Apply a params -> params conversion to the parameters and every moment like them."""
        return map_params(state, lambda n: self.is_params(n) or (
            isinstance(n, dict) and self.key in n), fn)

    # --- the step ----------------------------------------------------------------
    def loss_and_grads(self, params: dict, batch: jax.Array, dtype, documents: bool = False):
        """batch [N, b, seq + 1] -> (mean loss, grads shaped like params). `documents`:
        packed documents do not attend to each other (data.document_mask): every layer
        is given its microbatch's segments, learned positions restart per document."""
        shared_model, layer = self.shared_model, self.layers.layer_fn(dtype)

        def embed(shared, toks):
            within = context.document_positions(toks) if documents else None
            with loss_mask.documents(None, within):
                return shared_model.module(shared, dtype).embed(context.inputs_targets(toks)[0])

        def head_loss(shared, x, toks):
            return shared_model.module(shared, dtype).loss(x, context.inputs_targets(toks)[1])

        b, seq = batch.shape[1], batch.shape[2] - 1
        act_dtype = dtype or jnp.float32
        fns = pipeline.StageFns(embed, layer, head_loss,
                                context.document_segments if documents else None)
        loss, g_stages, g_shared = pipeline.run(
            self.ticks, fns, params["stages"],
            params["shared"], batch, self.mesh, (b, seq, self.exp.model.d_model), act_dtype,
            self.recompute)
        if self.schedule.pipes > 1:
            g_stages = pipeline.sum_pipe_copies(g_stages, self.schedule.virtual)
        return loss, {"stages": g_stages, "shared": g_shared}

    def grad_norm(self, grads: dict) -> jax.Array:
        """Global norm as the canonical model sees it (a second pipe's copies counted once)."""
        stages = grads["stages"]
        if self.schedule.pipes > 1:
            stages = jax.tree.map(lambda g: g[:, :self.schedule.virtual], stages)
        leaves = jax.tree.leaves(stages) + jax.tree.leaves(grads["shared"])
        return jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in leaves))

    @property
    def figures(self) -> dict:
        """The schedule's figures and the slots the executor holds per rank."""
        held = self.ticks.held
        return {**self.schedule.figures, "stash_slots_per_rank": held["stash"],
                "keep_slots_per_rank": held["keep"], "inbox_slots_per_rank": held["inbox"]}
