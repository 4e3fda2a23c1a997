"""FP8's quantising pass in a Pallas (Triton) kernel on NVIDIA GPUs (model.fp8_kernel):
an operand read once and written in FP8 as it is and transposed, with the amax of each
block (Transformer Engine's cast-transpose), for parallel.fp8_kernel's products.

v / scale (the scale rounded to the compute dtype, as flax's quantize does) is clipped
to the format's largest and rounded to nearest even once, from float32 -- where XLA,
given models.fp8's quantize-dequantize pattern, may round to bfloat16 first, an FP8
value one step away at a tie (tests/test_fp8_kernel.py sets both beside a NumPy
emulation). v is the operand itself; or GPT-2's GELU of it plus a bias (the MLP's
activation, from its first product's output); or the GELU's gradient (with the bias's
gradient, the column sums, in the same pass); or a fused projection's parts' gradients
side by side (with their bias's gradient).

Inside plait's step the pass runs in a shard_map over the mesh, each device on its own
tokens (a weight whole on each). Off a GPU it runs in Pallas's interpreter (tests;
`plait train` refuses "pallas" there).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from plait.parallel.kernel_place import Placement

__all__ = ["cast_transpose", "cast_transpose_parts"]

ROWS = 128
COLS = 64
NUM_WARPS = 4
NUM_STAGES = 1
# (ROWS, COLS, NUM_WARPS) where a mode ran faster in other blocks than the default's:
# the GELU's gradient (two bf16 arrays read, a tanh and its derivative an element) at
# gpt2-1.3b's [16384, 5120] took 0.230 ms in 64 x 64 blocks against 0.280 in 128 x 64
# (an H200, 2026-11-27, benchmarks/fp8_kernel.py; the plain pass within 3% in every
# setting tried, best in the default's). "parts" needs its blocks' columns to divide
# each part's width (checked in _launch).
BLOCKS = {"dgelu": (64, COLS, 4)}


_C = math.sqrt(2 / math.pi)


def _gelu(z: jax.Array, tanh=jnp.tanh) -> jax.Array:
    """GPT-2's GELU, the tanh approximation (jax.nn.gelu(approximate=True))."""
    return 0.5 * z * (1 + tanh(_C * (z + 0.044715 * z * z * z)))


def _gelu_grad(z: jax.Array, tanh=jnp.tanh) -> jax.Array:
    """d gelu(z) / dz."""
    t = tanh(_C * (z + 0.044715 * z * z * z))
    return 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * _C * (1 + 3 * 0.044715 * z * z)


def _tanh(approx: bool):
    """jnp.tanh (Triton: libdevice's tanhf, to a rounding); with `approx` the GPU's one
    instruction (tanh.approx.f32, relative error ~2^-11), benchmarks/fp8_kernel.py's
    question whether the GELU passes, twice the plain pass's time on an H200, are its
    cost. Pallas's interpreter has no inline PTX: jnp.tanh there either way."""
    if not approx:
        return jnp.tanh
    from jax.experimental.pallas import triton as plt

    return plt.approx_tanh


def _kernel(rows: int, cols: int, n_rows: int, n_cols: int, col_blocks: int, top: float,
            mode: str, part_cols: int, tanh, *refs):
    """One block of the operand v: v / scale clipped to +-top and rounded to FP8, stored
    as it is and transposed; the block's largest |v| (before scaling) stored at the
    program's index. v is x ("plain"); gelu(x + bias) ("gelu": the MLP's activation, x
    its first product's output); x * gelu'(pre + bias) ("dgelu": its gradient, x the
    activation's); or the parts side by side ("parts": a fused projection's q / k / v
    gradients, each `part_cols` wide). "dgelu" and "parts" also store v's column sums,
    row block by row block (a bias's gradient)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    sums_ref = pre_ref = b_ref = None
    if mode == "plain":
        scale_ref, x_ref, q_ref, qt_ref, amax_ref = refs
    elif mode == "gelu":
        scale_ref, x_ref, b_ref, q_ref, qt_ref, amax_ref = refs
    elif mode == "dgelu":
        scale_ref, x_ref, pre_ref, b_ref, q_ref, qt_ref, amax_ref, sums_ref = refs
    else:
        scale_ref, *part_refs, q_ref, qt_ref, amax_ref, sums_ref = refs
    p = pl.program_id(0)
    rb = p // col_blocks
    r0, c0 = rb * rows, (p % col_blocks) * cols
    r = r0 + jnp.arange(rows)
    c = c0 + jnp.arange(cols)
    live = c < n_cols
    mask = (r < n_rows)[:, None] & live[None, :]
    block = (pl.ds(r0, rows), pl.ds(c0, cols))
    if mode == "parts":
        # a block lies in one part (part_cols a multiple of cols): the other parts'
        # loads are masked off entirely
        part = c0 // part_cols
        at = (pl.ds(r0, rows), pl.ds(c0 - part * part_cols, cols))
        v = sum(plt.load(ref.at[at], mask=mask & (part == i), other=0).astype(jnp.float32)
                for i, ref in enumerate(part_refs))
    else:
        v = plt.load(x_ref.at[block], mask=mask, other=0).astype(jnp.float32)
    if b_ref is not None:
        b = plt.load(b_ref.at[pl.ds(c0, cols)], mask=live, other=0).astype(jnp.float32)
        if mode == "gelu":
            v = _gelu(v + b[None, :], tanh)
        else:
            pre = plt.load(pre_ref.at[block], mask=mask, other=0).astype(jnp.float32)
            v = v * _gelu_grad(pre + b[None, :], tanh)
        v = jnp.where(mask, v, 0.0)
    scale = plt.load(scale_ref.at[pl.ds(0, 1)])  # float32, already the compute dtype's
    q = jnp.clip(v / scale, -top, top).astype(q_ref.dtype)
    plt.store(q_ref.at[block], q, mask=mask)
    plt.store(qt_ref.at[pl.ds(c0, cols), pl.ds(r0, rows)], q.T, mask=mask.T)
    plt.store(amax_ref.at[pl.ds(p, 1)], jnp.max(jnp.abs(v), keepdims=True).reshape(1))
    if sums_ref is not None:
        plt.store(sums_ref.at[rb, pl.ds(c0, cols)], jnp.sum(v, axis=0), mask=live)


def _launch(mode: str, args: tuple, n_rows: int, n_cols: int, q_dtype, interpret: bool,
            part_cols: int = 0, rows: int | None = None, cols: int | None = None,
            num_warps: int | None = None, approx_tanh: bool = False) -> tuple:
    """The kernel over an operand [n_rows, n_cols] (args: the scale [1] float32, then
    the mode's inputs) -> (q, q^T, each block's amax[, each row block's column sums]);
    in the mode's blocks (BLOCKS, else ROWS x COLS with NUM_WARPS) unless given;
    `approx_tanh`: see _tanh (the step's passes take the exact one)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    shipped = BLOCKS.get(mode, (ROWS, COLS, NUM_WARPS))
    rows, cols, num_warps = (given or default for given, default
                             in zip((rows, cols, num_warps), shipped, strict=True))
    if mode == "parts" and part_cols % cols:  # a block must lie in one part
        raise ValueError(f"parts {part_cols} wide: not a multiple of a block's {cols}")

    col_blocks = -(-n_cols // cols)
    row_blocks = -(-n_rows // rows)
    blocks = row_blocks * col_blocks
    top = float(jnp.finfo(q_dtype).max)
    kernel = functools.partial(_kernel, rows, cols, n_rows, n_cols, col_blocks, top, mode,
                               part_cols, _tanh(approx_tanh and not interpret))
    anywhere = pl.BlockSpec(memory_space=pl.ANY)
    out_shape = (jax.ShapeDtypeStruct((n_rows, n_cols), q_dtype),
                 jax.ShapeDtypeStruct((n_cols, n_rows), q_dtype),
                 jax.ShapeDtypeStruct((blocks,), jnp.float32))
    if mode in ("dgelu", "parts"):
        out_shape += (jax.ShapeDtypeStruct((row_blocks, n_cols), jnp.float32),)
    return pl.pallas_call(
        kernel, out_shape=out_shape, grid=(blocks,), in_specs=[anywhere] * len(args),
        out_specs=(anywhere,) * len(out_shape),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=NUM_STAGES),
        interpret=interpret)(*args)


@functools.partial(jax.jit, static_argnames=("q_dtype", "interpret"))
def _cast_transpose_2d(x: jax.Array, scale: jax.Array, q_dtype, interpret: bool,
                       pre: jax.Array | None = None, bias: jax.Array | None = None):
    """x [R, C] -> (q [R, C], q^T [C, R] in q_dtype, each block's amax [blocks], and with
    `pre` the column sums of each row block [row blocks, C]) of v = x, gelu(x + bias)
    (`bias` alone) or x * gelu'(pre + bias); `scale` [1] float32."""
    mode = "plain" if bias is None else ("gelu" if pre is None else "dgelu")
    args = (scale, x) + tuple(a for a in (pre, bias) if a is not None)
    return _launch(mode, args, *x.shape, q_dtype, interpret)


@functools.partial(jax.jit, static_argnames=("q_dtype", "interpret"))
def _cast_transpose_parts_2d(parts: tuple, scale: jax.Array, q_dtype, interpret: bool):
    """parts [R, Cp] each, side by side as [R, n Cp] -> (q, q^T, each block's amax, each
    row block's column sums [row blocks, n Cp])."""
    n_rows, part_cols = parts[0].shape
    return _launch("parts", (scale, *parts), n_rows, part_cols * len(parts), q_dtype,
                   interpret, part_cols)


def _rounded_scale(scale: jax.Array, dtype) -> jax.Array:
    """The scale as flax's quantize divides by it: in the compute dtype; float32 [1]."""
    return scale.reshape(-1)[:1].astype(dtype).astype(jnp.float32)


def _local(lead: int, q_dtype, interpret: bool):
    """The kernel on one device's operand a [*outer (lead dims), *inner] (and `pre` like
    it, `bias` [*inner]): (q like a, q^T [*inner, *outer], the blocks' amaxes[, the row
    blocks' column sums [row blocks, *inner]])."""
    def f(a, scale, pre=None, bias=None):
        outer, inner = a.shape[:lead], a.shape[lead:]
        two_d = (math.prod(outer), math.prod(inner))
        out = _cast_transpose_2d(
            a.reshape(two_d), _rounded_scale(scale, a.dtype), q_dtype, interpret,
            None if pre is None else pre.reshape(two_d),
            None if bias is None else bias.reshape(-1))
        q, qt, amax = out[:3]
        shaped = (q.reshape(a.shape), qt.reshape(*inner, *outer), amax)
        return shaped + tuple(s.reshape(-1, *inner) for s in out[3:])
    return f


def cast_transpose(a: jax.Array, scale: jax.Array, q_dtype, lead: int, at: Placement,
                   pre: jax.Array | None = None, bias: jax.Array | None = None) -> tuple:
    """v quantised by `scale` to q_dtype: (q like a, its transpose [*inner, *outer], v's
    amax float32 []) for a [*outer (`lead` dims), *inner] and v = a; v = gelu(a + bias)
    with `bias` [*inner]; v = a * gelu'(pre + bias) with `pre` like a too, and then also
    v's sums over its outer dimensions [*inner] float32 (the bias's gradient). With a
    placement on a mesh, a is an activation [batch, seq, ...] laid out by its tokens
    (lead = 2) or, lead != 2, a weight whole on every device."""
    local = _local(lead, q_dtype, at.interpret)
    extra = tuple(v for v in (pre, bias) if v is not None)
    if at.mesh is None:
        out = local(a, scale, pre, bias)
    else:
        inner = (None,) * (a.ndim - lead)
        if lead == 2:
            tokens = tuple(at.tokens) + (None,) * (2 - len(at.tokens))
            axes = at.token_axes()
            act = P(*tokens, *inner)
            specs = (act, P(*inner, *tokens), P(axes or None))
            if pre is not None:
                specs += (P(axes or None, *inner),)
        else:
            act, specs = P(), (P(), P(), P())
        in_specs = (act, P()) + ((act,) if pre is not None else ()) + (
            (P(),) if bias is not None else ())

        def call(a, scale, *rest):
            return local(a, scale, *((None, *rest) if pre is None else rest))

        # check_vma off: Pallas's interpreter's types inside a checked shard_map are not
        # JAX's (as in parallel.norm_kernel)
        out = jax.shard_map(call, mesh=at.mesh, in_specs=in_specs, out_specs=specs,
                            check_vma=False)(a, scale, *extra)
    q, qt, amax = out[:3]
    return (q, qt, jnp.max(amax)) + tuple(s.sum(0) for s in out[3:])


def cast_transpose_parts(parts: tuple[jax.Array, ...], scale: jax.Array, q_dtype,
                         at: Placement) -> tuple:
    """parts [batch, seq, *inner] each, quantised by `scale` side by side as one operand
    [batch, seq, n, *inner] (a fused projection's output gradient): (q, its transpose
    [n, *inner, batch, seq], the amax over all, the column sums [n, *inner] float32)."""
    n, inner = len(parts), parts[0].shape[2:]

    def local(scale, *parts):
        outer = parts[0].shape[:2]
        two_d = (math.prod(outer), math.prod(inner))
        q, qt, amax, sums = _cast_transpose_parts_2d(
            tuple(p.reshape(two_d) for p in parts), _rounded_scale(scale, parts[0].dtype),
            q_dtype, at.interpret)
        return (q.reshape(*outer, n, *inner), qt.reshape(n, *inner, *outer), amax,
                sums.reshape(-1, n, *inner))

    if at.mesh is None:
        q, qt, amax, sums = local(scale, *parts)
    else:
        none = (None,) * len(inner)
        tokens = tuple(at.tokens) + (None,) * (2 - len(at.tokens))
        axes = at.token_axes()
        specs = (P(*tokens, None, *none), P(None, *none, *tokens), P(axes or None),
                 P(axes or None, None, *none))
        q, qt, amax, sums = jax.shard_map(
            local, mesh=at.mesh, in_specs=(P(),) + (P(*tokens, *none),) * n,
            out_specs=specs, check_vma=False)(scale, *parts)
    return q, qt, jnp.max(amax), sums.sum(0)
