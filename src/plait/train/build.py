"""Assemble everything a run needs from an experiment and a mesh, after checking they fit.

`plait train` and `plait inspect` both go through `Job`, so what inspect
compiles is exactly the step that training runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from plait import data, sharding
from plait.config import Experiment
from plait.errors import UserError
from plait.models import ModelDef, build
from plait.train.pipelined import Pipelined
from plait.train.state import StateLayout, init_state, layout, optimizer
from plait.train.step import make_train_step

# What each logical dimension is in the config, for error messages, checked in
# this order so the most actionable key is named first.
_DIM_KEYS = {
    "heads": ("model.heads", lambda m: m.heads),
    "embed": ("model.d_model", lambda m: m.d_model),
    "mlp": ("model.d_ff", lambda m: m.d_ff),
    "head_dim": ("the head size model.d_model / model.heads", lambda m: m.d_model // m.heads),
    "seq": ("model.seq_len", lambda m: m.seq_len),
    "vocab": ("the padded vocabulary", lambda m: m.padded_vocab),
}


def _axes_text(axes: tuple[str, ...], n: int) -> str:
    return f"the {axes[0]} axis ({n})" if len(axes) == 1 else f"{' x '.join(axes)} = {n}"


def check_fits(exp: Experiment, sizes: dict[str, int], rules: sharding.Rules,
               model: ModelDef) -> None:
    """Divisibility of the model and the batch by the mesh, as one-line errors.

    Every parameter dimension is checked against the mesh axes its rules split
    it over, so a new tensor mode needs no new checks here.
    """
    m, t = exp.model, exp.train
    if m.d_model % m.heads:
        raise UserError(
            f"model.d_model = {m.d_model} is not divisible by model.heads = {m.heads}; "
            "pick sizes with d_model a multiple of heads"
        )
    failures: dict[str, tuple[tuple[str, ...], int]] = {}
    for var in jax.tree.leaves(model.variables(), is_leaf=lambda v: hasattr(v, "get_metadata")):
        logical, fan_in = sharding.param_meta(var)
        for name, dim, axes in zip(logical, var.get_value().shape,
                                   rules.param_axes(logical, fan_in), strict=True):
            split = tuple(a for a in sharding.axes_tuple(axes) if sizes.get(a, 1) > 1)
            n = math.prod(sizes[a] for a in split)
            if dim % n and name not in failures:
                failures[name] = (split, n)
    for name, (key, get) in _DIM_KEYS.items():
        if name in failures:
            value = get(m)
            axes, n = failures[name]
            hint = (f"set model.vocab_multiple to a multiple of {n}" if name == "vocab"
                    else f"use sizes where {n} divides {value}")
            raise UserError(f"{key} = {value} is not divisible by {_axes_text(axes, n)}; {hint}")
    if t.global_batch % t.microbatches:
        raise UserError(
            f"train.global_batch = {t.global_batch} is not divisible by train.microbatches = "
            f"{t.microbatches}"
        )
    per_micro = t.global_batch // t.microbatches
    for feature in ("act_embed", "act_heads"):
        batch_axes = rules.get("act_batch")
        taken = set(sharding.axes_tuple(rules.get(feature)))
        split = tuple(a for a in sharding.axes_tuple(batch_axes)
                      if sizes.get(a, 1) > 1 and a not in taken)
        n = math.prod(sizes[a] for a in split)
        if per_micro % n:
            what = " x ".join(split)
            raise UserError(
                f"train.global_batch = {t.global_batch} does not split over {what} = {n} "
                f"in each of train.microbatches = {t.microbatches}; make global_batch a "
                f"multiple of {n * t.microbatches}"
            )


@dataclass
class Job:
    exp: Experiment
    mesh: Mesh

    def __post_init__(self) -> None:
        self.rules = sharding.rules_for(self.mesh)
        self.model: ModelDef = build(self.exp.model)
        check_fits(self.exp, dict(self.mesh.shape), self.rules, self.model)
        self.pipe: Pipelined | None = None
        if self.mesh.shape.get("pipeline", 1) > 1:
            self.pipe = Pipelined(self.exp, self.mesh, self.model, self.rules)
        mask = self.pipe.decay_mask if self.pipe else None
        self.tx, self.schedule = optimizer(self.exp, mask)
        params = (self.pipe.param_shapes, self.pipe.param_shardings) if self.pipe else None
        self.layout: StateLayout = layout(self.model, self.tx, self.mesh, self.rules, params)
        self.batch_shape = data.batch_shape(self.exp)
        if self.pipe:
            n = self.pipe.microbatches
            self.batch_shape = (n, self.exp.train.global_batch // n, self.batch_shape[2])
        # [microbatch, row, token]: rows split over the batch axes.
        self.batch_sharding: NamedSharding = sharding.batch_sharding(
            self.mesh, self.rules, 3, batch_dim=1)

    @cached_property
    def canonical_layout(self) -> StateLayout:
        """What checkpoints hold: the canonical layout (one entry per layer)."""
        if self.pipe is None:
            return self.layout
        return layout(self.model, optimizer(self.exp)[0], self.mesh, self.rules)

    @cached_property
    def step_fn(self):
        return make_train_step(self.model, self.exp, self.mesh, self.rules, self.tx,
                               self.schedule, self.layout, self.batch_sharding, self.pipe)

    def abstract_batch(self) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(self.batch_shape, np.int32, sharding=self.batch_sharding)

    def compile(self, compiler_options: dict | None = None):
        """Ahead-of-time compile of the step for the state and batch layouts."""
        lowered = self.step_fn.lower(self.layout.abstract(), self.abstract_batch())
        return lowered.compile(compiler_options) if compiler_options else lowered.compile()

    def init_state(self) -> dict:
        convert = self.pipe.from_canonical if self.pipe else None
        return init_state(self.model, self.tx, self.exp.seed, self.layout, convert)

    def to_checkpoint(self, state: dict) -> dict:
        """The state as checkpoints hold it (canonical: one entry per layer)."""
        if self.pipe is None:
            return state
        return jax.jit(lambda s: self.pipe.map_state(s, self.pipe.to_canonical),
                       out_shardings=self.canonical_layout.shardings)(state)

    def from_checkpoint(self, state: dict) -> dict:
        if self.pipe is None:
            return state
        return jax.jit(lambda s: self.pipe.map_state(s, self.pipe.from_canonical),
                       out_shardings=self.layout.shardings)(state)

    def source(self):
        return data.make_source(self.exp)

    def batch(self, source, step: int) -> jax.Array:
        return data.global_batch(source, step, self.batch_shape, self.batch_sharding)

    unit = "tokens"

    def num_params(self) -> int:
        return self.model.num_params()

    @property
    def units_per_step(self) -> int:
        return self.tokens_per_step

    @property
    def tokens_per_step(self) -> int:
        return self.exp.train.global_batch * self.exp.model.seq_len


def make_job(exp: Experiment, mesh: Mesh):
    """The job for the experiment's model kind (a GPT Job or a DLRMJob)."""
    if exp.model.kind == "dlrm":
        from plait.train.dlrm_job import DLRMJob

        return DLRMJob(exp, mesh)
    return Job(exp, mesh)
