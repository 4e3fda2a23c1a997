"""FP8 matrix multiplies with delayed scaling (precision.matmul = "fp8").

Each dense matmul of the decoder quantises its input and its weight to float8
e4m3 and the gradient of its output to e5m2 (the quantize-dequantize pattern of
flax.linen.fp8_ops, which XLA rewrites into FP8 GEMMs on GPUs of compute
capability 8.9+). Each of the three is divided by a scale, amax / the format's
largest value, where amax is the largest magnitude seen over the last
`fp8_history` steps: the scale of a step comes from earlier steps (delayed
scaling), so quantising needs no reduction before the matmul.

The state lives with the parameters (one `Scaling` per weight, under a key
"fp8", so it is checkpointed and resharded like them) but is not trained. A
matmul only reads its scales and reports the amax of what it quantised, as its
scales' "gradient"; the train step takes the state out of the gradients before
the optimizer (`take`), leaves its optimizer moments as they were
(`kept_moments`), and after the update makes the next state from those amaxes
(`put`: each amax written into its history, a ring of the last `fp8_history`
steps, and the next step's scale from the ring's largest). flax's `fp8_ops.in_qdq`
shifted the history and computed the scale inside every matmul, and the optimizer
updated the state's moments: tiny GPU kernels, about 1,500 more a step on
gpt2-124m, which an H100 ran 11% slower than the census of its kernels estimated
(docs/benchmarks.md). The values are flax's: a step quantises with the scale flax
would have computed at its start (the state holds the scale the next step uses).
Microbatches combine their amaxes by maximum (`accumulate`, `mean`).

With `Scaling.kernel` (model.fp8_kernel = "pallas") parallel.fp8_cast quantises the
operands in one Triton pass each instead of this pattern, with the same scales, values
and amaxes.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import optax
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
    gradient (g); `kernel`: the operands quantised by parallel.fp8_cast's pass
    (model.fp8_kernel = "pallas") where it applies."""

    def __init__(self, history: int, kernel: bool = False):
        self.kernel = kernel
        for name in ("x", "w", "g"):
            setattr(self, f"{name}_scale", Fp8Meta(jnp.ones((1,), jnp.float32),
                                                   logical_axes=(KEY,)))
            setattr(self, f"{name}_amax", Fp8Meta(jnp.zeros((history,), jnp.float32),
                                                  logical_axes=(KEY,)))

    def scales(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The (x, w, g) scales' values, as parallel.fp8_kernel's products take them."""
        return self.x_scale[...], self.w_scale[...], self.g_scale[...]


class Scalings(nnx.Module):
    """One `Scaling` per named weight of a module."""

    def __init__(self, names: tuple[str, ...], history: int, kernel: bool = False):
        for name in names:
            setattr(self, name, Scaling(history, kernel))


def scalings(names: tuple[str, ...], history: int, kernel: bool = False) -> Scalings | None:
    """The scaling state of a module's matmuls `names`, or None without FP8; `kernel`:
    quantised in parallel.fp8_cast's pass."""
    return Scalings(names, history, kernel) if history else None


def quantized_inputs(x: jax.Array, w: jax.Array, s: Scaling) -> tuple[jax.Array, jax.Array]:
    """x and w quantised to e4m3 (and back, for XLA to fuse into the GEMM) by their
    scales, in w's dtype (the compute dtype)."""
    dtype = w.dtype
    qx = _in_qdq(dtype, E4M3, x.astype(dtype), s.x_scale[...], s.x_amax[...])
    qw = _in_qdq(dtype, E4M3, w, s.w_scale[...], s.w_amax[...])
    return qx, qw


def quantized_gradient(y: jax.Array, s: Scaling) -> jax.Array:
    """y, whose gradient is quantised to e5m2 on the way back."""
    return _out_qdq(E5M2, y, s.g_scale[...], s.g_amax[...])


def _amax(x: jax.Array, like: jax.Array) -> jax.Array:
    """The largest magnitude of x, as float32 of the scale's shape (one element)."""
    return jnp.max(jnp.abs(x)).astype(jnp.float32).reshape(like.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _in_qdq(dtype, q_dtype, x, scale, history):
    """x quantised to q_dtype by `scale` and back; the gradient passes through, and
    the scale's is x's amax (the history's: zeros, `put` makes it)."""
    return fp8_ops.qdq(x, q_dtype, scale, dtype)


def _in_qdq_fwd(dtype, q_dtype, x, scale, history):
    return fp8_ops.qdq(x, q_dtype, scale, dtype), (_amax(x, scale), history)


def _in_qdq_bwd(dtype, q_dtype, res, g):
    amax, history = res
    return g, amax, jnp.zeros_like(history)


_in_qdq.defvjp(_in_qdq_fwd, _in_qdq_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _out_qdq(q_dtype, y, scale, history):
    """y as it is; its gradient quantised to q_dtype by `scale` and back, the scale's
    gradient that gradient's amax."""
    return y


def _out_qdq_fwd(q_dtype, y, scale, history):
    return y, (scale, history)


def _out_qdq_bwd(q_dtype, res, g):
    scale, history = res
    return (fp8_ops.qdq(g, q_dtype, scale, g.dtype), _amax(g, scale),
            jnp.zeros_like(history))


_out_qdq.defvjp(_out_qdq_fwd, _out_qdq_bwd)


def _is_state(path) -> bool:
    return any(path_key(k) == KEY for k in path)


def take(grads: dict) -> dict:
    """The gradients with the scaling state's entries zeroed: what the optimizer, the
    norm and the clipping see (a zero gradient moves no moment: no update)."""
    return jax.tree_util.tree_map_with_path(
        lambda p, g: jnp.zeros_like(g) if _is_state(p) else g, grads)


def put(params: dict, grads: dict, before: dict, step: jax.Array) -> dict:
    """`params` (the optimizer's) with each scaling state replaced by the next of its
    state in `before` (the step's parameters, `step` steps done): this step's amax (the
    scale's "gradient") written into the history at step mod its length, a window of
    the last `fp8_history` steps' amaxes as flax's shifted history is, and the scale
    the next step uses from the window's largest, as flax computes it at a step's
    start (its amax / the format's largest value; 1 while the window is empty)."""
    if not isinstance(params, dict):
        return params
    out = {k: v if k == KEY else put(v, grads[k], before[k], step)
           for k, v in params.items()}
    if KEY in params:
        out[KEY] = {name: _next_state(state, grads[KEY][name], step)
                    for name, state in before[KEY].items()}
    return out


_FORMATS = {"x": E4M3, "w": E4M3, "g": E5M2}


def _next_state(state: dict, grads: dict, step: jax.Array) -> dict:
    """One matmul's next scaling state: per quantity the history written in place at
    one position, and its largest value reduced from the history as it was with the new
    amax put in that slot. Read-only, those reductions of every matmul are fused by
    XLA:GPU into a few kernels; reduced from the written history they were one kernel
    per quantity (compiled for an H200, gpt2-1.3b's FP8 step: 7,636 -> 6,965 kernels;
    docs/benchmarks.md, "Without a GPU: the scaling state's update")."""
    out = {}
    for q, fmt in _FORMATS.items():
        history, scale = state[f"{q}_amax"], state[f"{q}_scale"]
        at = (step % history.shape[-1]).astype(jnp.int32)
        amax = grads[f"{q}_scale"][..., :1].astype(history.dtype)
        slot = jax.lax.broadcasted_iota(jnp.int32, history.shape, history.ndim - 1) == at
        top = jnp.max(jnp.where(slot, amax, history), axis=-1, keepdims=True)
        history = jax.lax.dynamic_update_slice_in_dim(history, amax, at, axis=-1)
        fresh = top / fp8_ops.get_fp8_max(fmt, jnp.float32)
        out[f"{q}_amax"] = history
        out[f"{q}_scale"] = jnp.where((top > 0) & jnp.isfinite(top), fresh, scale
                                      ).astype(scale.dtype)
    return out


def kept_moments(tx, new: Any, old: Any, params: dict) -> Any:
    """The optimizer state `new` with the scaling state's entries (moments of a zero
    gradient: zeros) as they were in `old`: no update computed for them, none written
    (each was a few tiny kernels a step per layer's matmul: 3,072 on gpt2-1.3b)."""
    mask = jax.tree_util.tree_map_with_path(lambda p, _: _is_state(p), params)
    if not any(jax.tree.leaves(mask)):
        return new
    marked = optax.tree_map_params(tx, lambda _, m: m, new, mask,
                                   transform_non_params=lambda _: False)
    return jax.tree.map(lambda n, o, m: o if m else n, new, old, marked)


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
