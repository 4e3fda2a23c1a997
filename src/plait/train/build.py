"""Assemble everything a run needs from an experiment and a mesh, after checking they fit.

`plait train` and `plait inspect` both go through `Job`, so what inspect
compiles is exactly the step that training runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from plait import data, sharding
from plait.config import Experiment
from plait.errors import UserError
from plait.models import ModelDef, build
from plait.train.state import StateLayout, init_state, layout, optimizer
from plait.train.step import make_train_step


def check_fits(exp: Experiment, sizes: dict[str, int]) -> None:
    """Divisibility of the model and the batch by the mesh, as one-line errors."""
    m, t = exp.model, exp.train
    if m.d_model % m.heads:
        raise UserError(
            f"model.d_model = {m.d_model} is not divisible by model.heads = {m.heads}; "
            "pick sizes with d_model a multiple of heads"
        )
    tensor = sizes.get("tensor", 1)
    for key, value in (("model.heads", m.heads), ("model.d_model", m.d_model),
                       ("model.d_ff", m.d_ff)):
        if value % tensor:
            raise UserError(
                f"{key} = {value} is not divisible by the tensor axis ({tensor}); "
                f"use a tensor size that divides {value}"
            )
    if m.padded_vocab % tensor:
        raise UserError(
            f"the padded vocabulary ({m.padded_vocab}) is not divisible by the tensor axis "
            f"({tensor}); set model.vocab_multiple to a multiple of {tensor}"
        )
    fsdp = sizes.get("fsdp", 1)
    if m.d_model % fsdp:
        raise UserError(
            f"model.d_model = {m.d_model} is not divisible by the fsdp axis ({fsdp}); "
            f"use an fsdp size that divides {m.d_model}"
        )
    if t.global_batch % t.microbatches:
        raise UserError(
            f"train.global_batch = {t.global_batch} is not divisible by train.microbatches = "
            f"{t.microbatches}"
        )
    replicas = sizes.get("data", 1) * fsdp
    per_micro = t.global_batch // t.microbatches
    if per_micro % replicas:
        raise UserError(
            f"train.global_batch = {t.global_batch} does not split over data x fsdp = {replicas} "
            f"replicas x train.microbatches = {t.microbatches}; make global_batch a multiple of "
            f"{replicas * t.microbatches}"
        )


@dataclass
class Job:
    exp: Experiment
    mesh: Mesh

    def __post_init__(self) -> None:
        check_fits(self.exp, dict(self.mesh.shape))
        self.rules = sharding.rules_for(self.mesh)
        self.model: ModelDef = build(self.exp.model)
        self.tx, self.schedule = optimizer(self.exp)
        self.layout: StateLayout = layout(self.model, self.tx, self.mesh, self.rules)
        self.batch_shape = data.batch_shape(self.exp)
        # [microbatch, row, token]: rows split over the batch axes.
        self.batch_sharding: NamedSharding = sharding.batch_sharding(
            self.mesh, self.rules, 3, batch_dim=1)

    @cached_property
    def step_fn(self):
        return make_train_step(self.model, self.exp, self.mesh, self.rules, self.tx,
                               self.schedule, self.layout, self.batch_sharding)

    def abstract_batch(self) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(self.batch_shape, np.int32, sharding=self.batch_sharding)

    def compile(self):
        """Ahead-of-time compile of the step for the state and batch layouts."""
        return self.step_fn.lower(self.layout.abstract(), self.abstract_batch()).compile()

    def init_state(self) -> dict:
        return init_state(self.model, self.tx, self.exp.seed, self.layout)

    @property
    def tokens_per_step(self) -> int:
        return self.exp.train.global_batch * self.exp.model.seq_len
