"""Whether the compiled step fits the devices' memory, said before the first step.

`tasks.check_memory` refuses, before anything is built, a model whose parameters and
optimizer state alone cannot fit; activations are not known until the step is compiled.
XLA's buffer assignment then gives the step's whole footprint per device (its
arguments, outputs and temporaries, less the donated outputs that reuse their inputs'
buffers), which this compares with the device's memory. Without it a step too big for
the device failed only when it ran: after the first batch was made (a quickstart with
train.global_batch = 4194304 spent 3 minutes making it on this CPU) with XLA's
"RESOURCE_EXHAUSTED: Out of memory allocating 951603954664 bytes" and no advice.
"""

from __future__ import annotations

from plait.analysis import memory_of
from plait.errors import UserError
from plait.hardware import mesh_device_memory

GIB = 2**30


def step_bytes(compiled) -> dict[str, int] | None:
    """The compiled step's memory per device (analysis.memory_of): `state` (its
    arguments: the state and the batch), `work` (outputs and temporaries, less what
    reuses the donated state), `total`; None where the backend does not say."""
    memory = memory_of(compiled)
    if not memory:
        return None
    state = memory["argument_bytes"]
    return {"state": state, "work": memory["total_bytes"] - state,
            "total": memory["total_bytes"]}


def state_bytes(task) -> int:
    """The train state's bytes on one device as the task lays it out (each leaf's shard:
    a data axis keeps a whole copy, fsdp a slice): the most of any device."""
    import math

    import jax

    per: dict = {}
    for leaf in jax.tree.leaves(task.layout.abstract()):
        shard = leaf.sharding.shard_shape(leaf.shape)
        for device in leaf.sharding.device_set:
            per[device] = per.get(device, 0) + math.prod(shard) * leaf.dtype.itemsize
    return max(per.values(), default=0)


def check_state_fits(task) -> None:
    """Refuse, before the state is made, a state whose shards do not fit each device.
    tasks.check_memory asks only that the whole state fit all devices together; a mesh
    that replicates it did not fit: gpt2-1.3b on data=2 of this 24 GiB host (2 x 14.8 GiB)
    was made asynchronously while its step compiled, and the process was killed for
    memory after printing the step's refusal."""
    need, have = state_bytes(task), mesh_device_memory(task.mesh)
    if need <= have:
        return
    from plait.hosts import mesh_text

    raise UserError(
        f"the train state (parameters and {task.exp.optimizer.name} state) takes "
        f"{need / GIB:,.1f} GiB per device as mesh {mesh_text(task.mesh)} lays it out, more "
        f"than the {have / GIB:,.1f} GiB {_where(task.mesh)}; shard it with fsdp (data "
        "keeps a whole copy on each device), use more devices, or shrink the model")


def _where(mesh) -> str:
    """Whose memory a device's limit is, as the refusals say it. An accelerator's limit
    is the share JAX's allocator may take (75% unless XLA_PYTHON_CLIENT_MEM_FRACTION
    says otherwise), which nothing can exceed."""
    platform = mesh.devices.flat[0].platform
    if platform == "cpu":
        return f"of the host's memory per device of the mesh ({mesh.devices.size} simulated)"
    return (f"JAX may allocate on each {platform} device (its share is "
            "XLA_PYTHON_CLIENT_MEM_FRACTION, 0.75 unless set)")


def check_step_fits(task, compiled) -> None:
    """Refuse, in one line naming what to change, a compiled step that needs more memory
    per device than its devices have. Only a certain failure is refused: XLA allocates
    the whole footprint, so a step above the device's limit cannot run."""
    need = step_bytes(compiled)
    if need is None:
        return
    have = mesh_device_memory(task.mesh)
    if need["total"] <= have:
        return
    raise UserError(
        f"the compiled train step needs {need['total'] / GIB:,.1f} GiB per device "
        f"({need['state'] / GIB:,.1f} GiB of state and batch, {need['work'] / GIB:,.1f} GiB "
        f"of activations and temporaries), more than the {have / GIB:,.1f} GiB "
        f"{_where(task.mesh)}; {task.memory_fixes()}")


def out_of_memory(err: BaseException) -> bool:
    """Whether an XLA runtime error is the device running out of memory."""
    text = str(err)
    return "RESOURCE_EXHAUSTED" in text and "memory" in text.lower()
