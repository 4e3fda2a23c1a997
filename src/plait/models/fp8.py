"""FP8 matrix multiplies with delayed scaling (precision.matmul = "fp8").

Each dense matmul of the decoder quantises its input and its weight to float8
e4m3 and the gradient of its output to e5m2 (flax.linen.fp8_ops' quantize-
dequantize ops, the pattern XLA rewrites into FP8 GEMMs on GPUs of compute
capability 8.9+). Each of the three is divided by a scale, amax / the format's
largest value, where amax is the largest magnitude seen over the last
`fp8_history` steps: the scale of a step comes from earlier steps (delayed
scaling), so quantising needs no reduction before the matmul.

The state lives with the parameters (one `Scaling` per weight, under a key
"fp8", so it is checkpointed and resharded like them) but is not trained: the
quantize ops return its next value as its "gradient" (flax's overwrite-with-
gradient convention), the train step takes it out of the gradients before the
optimizer and writes it into the parameters after (`take`, `put`), and
microbatches combine it by maximum, not by mean (`accumulate`, `mean`).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import fp8_ops

from plait.errors import UserError
from plait.models import path_key

KEY = "fp8"  # the attribute (and parameter key) of a module's scaling state
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
# Tests run the FP8 path on CPUs, where XLA computes the same quantised values in
# higher precision (an emulation: same numbers, no speed).
EMULATE_ENV = "PLAIT_FP8_EMULATE"


def apart(h: jax.Array, scaling: Scaling | None) -> jax.Array:
    """h, the output of an FP8 matmul (`scaling` not None), kept from fusing into the
    matmul's epilogue with what follows. XLA:GPU folds a tanh GELU that follows a matmul
    into cuBLAS's epilogue, with the pre-activation as an auxiliary output for the
    backward; for an FP8 matmul its compiler then fails (`RET_CHECK ... !has_aux_output`,
    thunk_emitter.cc: jaxlib 0.10.2's, compiling gpt2-124m for an H100 without one,
    docs/benchmarks.md). The GELU runs as its own fusion instead (one more pass over h)."""
    return h if scaling is None else jax.lax.optimization_barrier(h)


class Fp8Meta(nnx.Variable):
    """Scaling state of one FP8 matmul: kept in float32 whatever precision.compute."""


class Scaling(nnx.Module):
    """The scales and amax histories of a matmul's input (x), weight (w) and output
    gradient (g)."""

    def __init__(self, history: int):
        for name in ("x", "w", "g"):
            setattr(self, f"{name}_scale", Fp8Meta(jnp.ones((1,), jnp.float32),
                                                   logical_axes=(KEY,)))
            setattr(self, f"{name}_amax", Fp8Meta(jnp.zeros((history,), jnp.float32),
                                                  logical_axes=(KEY,)))


class Scalings(nnx.Module):
    """One `Scaling` per named weight of a module."""

    def __init__(self, names: tuple[str, ...], history: int):
        for name in names:
            setattr(self, name, Scaling(history))


def scalings(names: tuple[str, ...], history: int) -> Scalings | None:
    """The scaling state of a module's matmuls `names`, or None without FP8."""
    return Scalings(names, history) if history else None


def quantized_inputs(x: jax.Array, w: jax.Array, s: Scaling) -> tuple[jax.Array, jax.Array]:
    """x and w quantised to e4m3 (and back, for XLA to fuse into the GEMM) by their
    delayed scales, in w's dtype (the compute dtype)."""
    dtype = w.dtype
    qx = fp8_ops.in_qdq(dtype, E4M3, x.astype(dtype), s.x_scale[...], s.x_amax[...])
    qw = fp8_ops.in_qdq(dtype, E4M3, w, s.w_scale[...], s.w_amax[...])
    return qx, qw


def quantized_gradient(y: jax.Array, s: Scaling) -> jax.Array:
    """y, whose gradient is quantised to e5m2 on the way back."""
    return fp8_ops.out_qdq(y.dtype, E5M2, y, s.g_scale[...], s.g_amax[...])


def _is_state(path) -> bool:
    return any(path_key(k) == KEY for k in path)


def take(grads: dict) -> dict:
    """The gradients with the scaling state's entries zeroed: what the optimizer, the
    norm and the clipping see (a zero gradient moves no moment: no update)."""
    return jax.tree_util.tree_map_with_path(
        lambda p, g: jnp.zeros_like(g) if _is_state(p) else g, grads)


def put(params: dict, grads: dict) -> dict:
    """The parameters with the scaling state replaced by its next value, which the
    quantize ops returned as its gradient."""
    return jax.tree_util.tree_map_with_path(
        lambda p, w, g: g if _is_state(p) else w, params, grads)


def accumulate(total: dict, grads: dict) -> dict:
    """Sum of two microbatches' gradients; the scaling state's next values (scales and
    amax histories, all >= 0) combine by maximum."""
    return jax.tree_util.tree_map_with_path(
        lambda p, a, b: jnp.maximum(a, b) if _is_state(p) else a + b, total, grads)


def mean(total: dict, n: int) -> dict:
    """Accumulated gradients over `n` microbatches -> their mean (the state as it is)."""
    return jax.tree_util.tree_map_with_path(
        lambda p, a: a if _is_state(p) else a / n, total)


def check_devices(devices) -> None:
    """One line when the devices have no FP8 matrix units (unless emulating for tests)."""
    if os.environ.get(EMULATE_ENV) == "1":
        return
    d = devices[0]
    capability = getattr(d, "compute_capability", None)
    if d.platform == "gpu" and capability:
        major, minor = (int(v) for v in str(capability).split(".")[:2])
        if (major, minor) >= (8, 9):
            return
    kind = f"{d.platform} ({d.device_kind})"
    raise UserError(f"precision.matmul = \"fp8\" needs FP8 matrix units (a GPU of compute "
                    f"capability 8.9 or newer: Ada, Hopper, Blackwell); this run's devices "
                    f"are {kind}; use precision.matmul = \"default\"")


def without_state(tree: dict) -> dict:
    """`tree` (parameters, or their shapes) without any FP8 scaling state."""
    return {k: without_state(v) if isinstance(v, dict) else v
            for k, v in tree.items() if k != KEY}


def _fresh(path, shape: jax.ShapeDtypeStruct) -> jax.Array:
    """A new leaf of a state that had none there: a parameter's scales start at 1, its
    amax histories empty; an optimizer's moments at zero."""
    first, last = path_key(path[0]), path_key(path[-1])
    one = first == "params" and _is_state(path) and last.endswith("_scale")
    return (jnp.ones if one else jnp.zeros)(shape.shape, shape.dtype)


def carry_over(old: dict, shapes: dict) -> dict:
    """A state of the structure of `shapes` from `old`, one of another precision.matmul
    or fp8_history: every leaf of the same path and shape carried over, the rest (the
    scaling state and its optimizer moments) fresh."""
    have = {p: v for p, v in jax.tree_util.tree_flatten_with_path(old)[0]}
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    leaves = [have[p] if p in have and have[p].shape == s.shape else _fresh(p, s)
              for p, s in flat]
    return jax.tree_util.tree_unflatten(treedef, leaves)
