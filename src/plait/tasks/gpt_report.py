"""What `plait inspect` reports of a decoder beside the compiled step's own figures:
each parallel mode's wire bytes against its formula (parallel/formulas.py), where a
formula models the step, and the parameters' bytes per device."""

from __future__ import annotations

import math

import jax

from plait import mesh as mesh_lib
from plait.parallel import formulas


def param_bytes_per_device(task) -> int:
    """Bytes of this device's shards of the parameters (fp32 master weights)."""
    total = 0
    for shape, sh in zip(jax.tree.leaves(task.layout.shapes["params"]),
                         jax.tree.leaves(task.layout.params), strict=True):
        total += math.prod(sh.shard_shape(shape.shape)) * shape.dtype.itemsize
    return total


def figures(task, analysis: dict) -> dict:
    """The GPTTask's Task.report: tensor, expert and context traffic with formulas."""
    exp, pipeline = task.exp, task.pipeline
    sizes = dict(task.mesh.shape)
    platform = task.mesh.devices.flat[0].platform
    wire = formulas.tensor_wire_bytes(analysis)
    mode = mesh_lib.MODE_NAMES[mesh_lib.tensor_mode(sizes)]
    # The formulas describe the dense decoder's tensor parallelism without a pipeline:
    # a mixture's expert layers move tokens their own way over the tensor axes
    # (capacity slots or routed rows, parallel/experts.py), which they do not count.
    unmodelled = ("a pipeline" if pipeline else
                  "mixture-of-experts layers" if exp.model.moe is not None else None)
    formula = None if unmodelled else formulas.tensor_bytes(exp, sizes, platform)
    out = {"tensor_mode": mode, "tensor_wire_bytes": wire, "tensor_formula_bytes": formula,
           "tensor_formula_unmodelled": unmodelled,
           "param_bytes_per_device": param_bytes_per_device(task),
           "pipeline": pipeline.figures if pipeline else None}
    # No expert or context formula with a pipeline either: a stage holds some of the
    # layers, and its microbatches are the schedule's; neither formula counts them.
    if sizes.get("expert", 1) > 1:
        dispatch = "all-to-all" if exp.model.moe.capacity_factor else "all-gather"
        out["experts"] = {"size": sizes["expert"], "dispatch": dispatch,
                          "wire_bytes": formulas.expert_wire_bytes(analysis, dispatch),
                          "formula_bytes": None if pipeline else
                          formulas.expert_bytes(exp, sizes, platform)}
    if sizes.get("context", 1) > 1:
        ctx = exp.model_copy(update={"context": exp.context.model_copy(
            update={"attention": task.context_attention})})
        out["context"] = {"size": sizes["context"], "attention": task.context_attention,
                          "wire_bytes": formulas.context_wire_bytes(analysis),
                          "formula_bytes": None if pipeline else
                          formulas.context_bytes(ctx, sizes, platform)}
    return out
