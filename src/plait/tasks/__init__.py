"""Running a model kind: the Task of an experiment on a mesh, and the memory check made
before anything is built. The registry of kinds (`register`, `kinds`, `config_class`,
`task_class`) lives in `plait.kinds`, below the config; its names are handed on here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from plait.errors import UserError
from plait.kinds import config_class, kinds, register, task_class, unregister  # noqa: F401

if TYPE_CHECKING:  # pragma: no cover
    from jax.sharding import Mesh

    from plait.config import Experiment
    from plait.tasks.base import Task


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
    like model.layers = 1000000000 would otherwise build for minutes and swap. So is a
    batch whose least part (Task.batch_memory) does not fit beside them: XLA cannot
    compile some (train.global_batch = 10**11: a scatter of more than 2**31 rows)."""
    from plait.hardware import mesh_device_memory

    kind = task_class(exp.model.kind)
    params = kind.param_count(exp.model)
    need = params * 4 * (1 + _SLOTS.get(exp.optimizer.name, 0))
    have = mesh_device_memory(mesh) * mesh.devices.size
    devices = f"{mesh.devices.size} {mesh.devices.flat[0].platform} devices"
    if need > have:
        raise UserError(
            f"the model has {params:,} parameters: with its {exp.optimizer.name} state that "
            f"is {need / 2**30:,.1f} GiB, more than the {have / 2**30:,.1f} GiB of the mesh's "
            f"{devices}; shrink the model (model.layers, model.d_model, table rows) or use "
            "more devices")
    batch, what, fix = kind.batch_memory(exp)
    if need + batch > have:
        raise UserError(
            f"{what} takes at least {batch / 2**30:,.1f} GiB ({(need + batch) / 2**30:,.1f} "
            f"GiB with the parameters and {exp.optimizer.name} state), more than the "
            f"{have / 2**30:,.1f} GiB of the mesh's {devices}; {fix}")

