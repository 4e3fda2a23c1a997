"""Model kinds: `model.kind` -> the schema of its `[model]` table and its Task.

A model kind is a `plait.tasks.base.Task` subclass (state layout, init, step,
batches, evaluation, checkpoint conversion, description, FLOPs, sweep space)
plus a `plait.config.ModelSection` subclass for its keys. The training loop,
`plait inspect`, `plait sweep` and checkpoints know only the Task interface.

Adding a kind is its own module and one `register` line, here for the built-in
kinds or in the user's code before the experiment is loaded:

    register("linear", LinearConfig, LinearTask)

The task may be given as "module:Class" so that reading a config does not import
JAX (the built-in kinds are registered that way).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from plait.config import DLRMConfig, GPTConfig, ModelSection
from plait.errors import UserError

if TYPE_CHECKING:  # pragma: no cover
    from jax.sharding import Mesh

    from plait.config import Experiment
    from plait.tasks.base import Task


@dataclass
class Kind:
    name: str
    config: type[ModelSection]
    task: type | str  # a Task subclass, or "module:Class" imported on first use


_KINDS: dict[str, Kind] = {}


def register(name: str, config: type[ModelSection], task: type | str) -> None:
    """Make `model.kind = name` select `config` for the `[model]` table and `task` to run."""
    _KINDS[name] = Kind(name, config, task)


def kinds() -> list[str]:
    return list(_KINDS)


def _kind(name: str) -> Kind:
    if name not in _KINDS:
        raise UserError(f"unknown model.kind '{name}'; known kinds: {', '.join(_KINDS)}")
    return _KINDS[name]


def config_class(name: str) -> type[ModelSection]:
    return _kind(name).config


def task_class(name: str) -> type[Task]:
    kind = _kind(name)
    if isinstance(kind.task, str):
        module, attr = kind.task.split(":")
        kind.task = getattr(importlib.import_module(module), attr)
    return kind.task


def make_task(exp: Experiment, mesh: Mesh) -> Task:
    """The Task of the experiment's model kind on `mesh` (checks that they fit first)."""
    return task_class(exp.model.kind)(exp, mesh)


# Optimizer slots per parameter (a lower bound: SGD may keep momentum, DLRM tables may
# keep row-wise Adagrad instead).
_SLOTS = {"adamw": 2, "adagrad": 1, "sgd": 0}


def check_memory(exp: Experiment, mesh: Mesh) -> None:
    """Refuse, before anything is built, a model whose parameters and optimizer state
    alone (float32, no activations) exceed the memory of the mesh's devices (training
    allocates for real; the sweep prices other hardware and does not ask): a typo
    like model.layers = 1000000000 would otherwise build for minutes and swap."""
    from plait.hardware import device_memory_bytes

    params = task_class(exp.model.kind).param_count(exp.model)
    need = params * 4 * (1 + _SLOTS.get(exp.optimizer.name, 0))
    have = sum(device_memory_bytes(d) for d in mesh.devices.flat)
    if need > have:
        raise UserError(
            f"the model has {params:,} parameters: with its {exp.optimizer.name} state that "
            f"is {need / 2**30:,.1f} GiB, more than the {have / 2**30:,.1f} GiB of the mesh's "
            f"{mesh.devices.size} {mesh.devices.flat[0].platform} devices; shrink the model "
            "(model.layers, model.d_model, table rows) or use more devices")


register("gpt", GPTConfig, "plait.tasks.gpt:GPTTask")
register("dlrm", DLRMConfig, "plait.tasks.dlrm:DLRMTask")
