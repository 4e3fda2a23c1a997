"""Model kinds: `model.kind` -> the schema of its `[model]` table and its Task.

A model kind is a `plait.tasks.base.Task` subclass (state layout, init, step,
batches, evaluation, checkpoint conversion, description, FLOPs, sweep space)
plus a `plait.model_schema.ModelSection` subclass for its keys. The training
loop, `plait inspect`, `plait sweep` and checkpoints know only the Task
interface.

Adding a kind is its own module and one `register` line, here for the built-in
kinds or in the user's code before the experiment is loaded:

    register("linear", LinearConfig, LinearTask)

The task may be given as "module:Class" so that reading a config does not import
JAX (the built-in kinds are registered that way). This registry sits just above
the model schemas and below everything that reads a config, so nothing here
imports upwards.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from plait.errors import UserError
from plait.model_schema import DLRMConfig, GPTConfig, LlamaConfig, ModelSection


@dataclass
class Kind:
    name: str
    config: type[ModelSection]
    task: type | str  # a Task subclass, or "module:Class" imported on first use


_KINDS: dict[str, Kind] = {}


def register(name: str, config: type[ModelSection], task: type | str) -> None:
    """Make `model.kind = name` select `config` for the `[model]` table and `task` to run."""
    _KINDS[name] = Kind(name, config, task)


def unregister(name: str) -> None:
    _KINDS.pop(name, None)


def kinds() -> list[str]:
    return list(_KINDS)


def _kind(name: str) -> Kind:
    if name not in _KINDS:
        raise UserError(f"unknown model.kind '{name}'; known kinds: {', '.join(_KINDS)}")
    return _KINDS[name]


def config_class(name: str) -> type[ModelSection]:
    return _kind(name).config


def task_class(name: str) -> type:
    """The kind's `plait.tasks.base.Task` subclass (imported on first use)."""
    kind = _kind(name)
    if isinstance(kind.task, str):
        module, attr = kind.task.split(":")
        kind.task = getattr(importlib.import_module(module), attr)
    return kind.task


def is_decoder(model: ModelSection) -> bool:
    """Whether the model is one of the decoder's kinds (GPT-2 or Llama layouts)."""
    return isinstance(model, GPTConfig)


register("gpt", GPTConfig, "plait.tasks.gpt:GPTTask")
register("llama", LlamaConfig, "plait.tasks.gpt:GPTTask")
register("dlrm", DLRMConfig, "plait.tasks.dlrm:DLRMTask")
