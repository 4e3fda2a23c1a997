"""FP8 matmuls whose operands are quantised, transposed and measured in one pass of a
Pallas (Triton) kernel on NVIDIA GPUs (`model.fp8_kernel`).

cuBLASLt's FP8 GEMMs take both operands with the contracted dimension innermost ("TN").
A matmul's backward contracts its input and its output's gradient over the tokens, their
outer dimension, so XLA:GPU, given the quantize-dequantize pattern (models.fp8),
transposes the FP8 copies it made before the weight's gradient can be multiplied, and
takes each operand's amax in a reduction of its own: compiled for an H100, gpt2-1.3b's
FP8 step spent ~51 ms of its ~304 on transposes and ~62 on reductions, against 0.1 and
~27 in bf16, while its products took 100 ms against 190 (docs/benchmarks.md, "Without a
GPU: FP8's operands in one pass"). Here one kernel reads an operand once and writes it
quantised both ways round (q and its transpose, e4m3 or e5m2) with the amax of each
block (Transformer Engine's cast-transpose), and the three products take those arrays
as they are:

    forward   y  = x  . w      from q(x) [tokens, K] and q(w)^T [N, K]
    backward  dx = dy . w^T    from q(dy) [tokens, N] and q(w) [K, N]
              dw = x^T . dy    from q(x)^T [K, tokens] and q(dy)^T [N, tokens]

(each "TN": compiled for an H100, three `__cublas$lt$matmul$f8` calls and no transpose).
The quantised values are models.fp8's: x / scale (the scale rounded to the compute
dtype, as flax's quantize does), clipped to the format's largest, rounded to nearest
even once, from float32 -- where XLA may round to bfloat16 first, an FP8 value one
step away at a tie (tests/test_fp8_kernel.py sets both beside a NumPy emulation).
The residuals the backward keeps are the FP8 q(x)^T and q(w), not x and w.

`dense` is one product; `gelu_mlp` is GPT-2's MLP, its GELU and GELU's gradient (with
b1's gradient) folded into the passes around its two products; `dense_parts` is a
fused q / k / v projection whose parts' gradients are quantised side by side (with
their bias's gradient).

Inside plait's step the kernel runs in a shard_map over the mesh, each device on its
own tokens (the weight whole on each); `applies` says where: no explicit tensor mode,
no tensor split of the weight, the tokens two leading dimensions, not inside a
pipeline's body. Elsewhere parallel.ops keeps the quantize-dequantize pattern. Off a
GPU the kernel runs in Pallas's interpreter (tests; `plait train` refuses "pallas"
there).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from plait.models.fp8 import E4M3, E5M2
from plait.parallel.kernel_place import Placement, placement, usable

__all__ = ["applies", "cast_transpose", "cast_transpose_parts", "dense", "dense_parts",
           "gelu_mlp", "usable"]

# A program's block of the operand [rows, columns] (powers of two: Triton's blocks) and
# the launch settings: chosen, not yet measured on a GPU (128 rows: 128-byte runs of
# the transposed FP8 output).
ROWS = 128
COLS = 64
NUM_WARPS = 4
NUM_STAGES = 1


_C = math.sqrt(2 / math.pi)


def _gelu(z: jax.Array) -> jax.Array:
    """GPT-2's GELU, the tanh approximation (jax.nn.gelu(approximate=True))."""
    return 0.5 * z * (1 + jnp.tanh(_C * (z + 0.044715 * z * z * z)))


def _gelu_grad(z: jax.Array) -> jax.Array:
    """d gelu(z) / dz."""
    t = jnp.tanh(_C * (z + 0.044715 * z * z * z))
    return 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * _C * (1 + 3 * 0.044715 * z * z)


def _kernel(rows: int, cols: int, n_rows: int, n_cols: int, col_blocks: int, top: float,
            mode: str, part_cols: int, *refs):
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
            v = _gelu(v + b[None, :])
        else:
            pre = plt.load(pre_ref.at[block], mask=mask, other=0).astype(jnp.float32)
            v = v * _gelu_grad(pre + b[None, :])
        v = jnp.where(mask, v, 0.0)
    scale = plt.load(scale_ref.at[pl.ds(0, 1)])  # float32, already the compute dtype's
    q = jnp.clip(v / scale, -top, top).astype(q_ref.dtype)
    plt.store(q_ref.at[block], q, mask=mask)
    plt.store(qt_ref.at[pl.ds(c0, cols), pl.ds(r0, rows)], q.T, mask=mask.T)
    plt.store(amax_ref.at[pl.ds(p, 1)], jnp.max(jnp.abs(v), keepdims=True).reshape(1))
    if sums_ref is not None:
        plt.store(sums_ref.at[rb, pl.ds(c0, cols)], jnp.sum(v, axis=0), mask=live)


def _launch(mode: str, args: tuple, n_rows: int, n_cols: int, q_dtype, interpret: bool,
            part_cols: int = 0, rows: int = ROWS, cols: int = COLS,
            num_warps: int = NUM_WARPS) -> tuple:
    """The kernel over an operand [n_rows, n_cols] (args: the scale [1] float32, then
    the mode's inputs) -> (q, q^T, each block's amax[, each row block's column sums])."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    col_blocks = -(-n_cols // cols)
    row_blocks = -(-n_rows // rows)
    blocks = row_blocks * col_blocks
    top = float(jnp.finfo(q_dtype).max)
    kernel = functools.partial(_kernel, rows, cols, n_rows, n_cols, col_blocks, top, mode,
                               part_cols)
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
    if part_cols % COLS:
        raise ValueError(f"parts {part_cols} wide: not a multiple of a block's {COLS}")
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


def _dequantized(q: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """q back in `dtype` times its scale: the pattern XLA:GPU folds into an FP8 GEMM."""
    return q.astype(dtype) * jnp.broadcast_to(scale.reshape(-1)[0].astype(dtype), q.shape)


def _product(a: jax.Array, b: jax.Array, n: int, dtype) -> jax.Array:
    """a [..., *c] . b [..., *c] over their last n dimensions (both contracted innermost:
    cuBLASLt's FP8 layout)."""
    ca = tuple(range(a.ndim - n, a.ndim))
    cb = tuple(range(b.ndim - n, b.ndim))
    return jax.lax.dot_general(a, b, ((ca, cb), ((), ())), preferred_element_type=dtype)


def dense(x: jax.Array, w: jax.Array, scales: tuple[jax.Array, ...],
          fan_in: int) -> jax.Array:
    """x [batch, seq, *K] times w [*K (fan_in dims), *N] -> [batch, seq, *N] with both
    operands quantised to e4m3 and the output's gradient to e5m2 by `scales` (x, w, g:
    models.fp8's delayed scaling); the scales' "gradients" are the amaxes of what was
    quantised (models.fp8.put makes the next state from them)."""
    return _dense(x.astype(w.dtype), w, tuple(scales), fan_in, placement(x.ndim))


def _as_scale_grads(amaxes: tuple[jax.Array, ...], scales: tuple[jax.Array, ...]) -> tuple:
    """Each amax as its scale's "gradient": the scale's shape and dtype."""
    return tuple(a.astype(s.dtype).reshape(s.shape) for a, s in zip(amaxes, scales,
                                                                    strict=True))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _dense(x, w, scales, fan_in: int, at: Placement):
    return _dense_fwd(x, w, scales, fan_in, at)[0]


def _dense_fwd(x, w, scales, fan_in, at):
    x_scale, w_scale, _ = scales
    qx, qxt, x_amax = cast_transpose(x, x_scale, E4M3, 2, at)
    qw, qwt, w_amax = cast_transpose(w, w_scale, E4M3, fan_in, at)
    dtype = w.dtype
    y = _product(_dequantized(qx, x_scale, dtype), _dequantized(qwt, w_scale, dtype),
                 fan_in, dtype)
    return y, (qxt, qw, scales, x_amax, w_amax)


def _dense_bwd(fan_in, at, res, g):
    qxt, qw, scales, x_amax, w_amax = res
    x_scale, w_scale, g_scale = scales
    dtype = g.dtype
    qg, qgt, g_amax = cast_transpose(g, g_scale, E5M2, 2, at)
    dg = _dequantized(qg, g_scale, dtype)
    dx = _product(dg, _dequantized(qw, w_scale, dtype), qw.ndim - fan_in, dtype)
    dw = _product(_dequantized(qxt, x_scale, dtype), _dequantized(qgt, g_scale, dtype),
                  2, dtype)
    return dx, dw, _as_scale_grads((x_amax, w_amax, g_amax), scales)


_dense.defvjp(_dense_fwd, _dense_bwd)


def applies(x: jax.Array, fan_in: int, w_logical: tuple[str, ...],
            fan_in_names: tuple[str, ...], w_split: bool) -> bool:
    """Whether `dense` takes this matmul: x [batch, seq, *K], the weight's contracted
    dimensions its leading ones, the weight whole on each device once its fsdp shards
    are gathered (not `w_split`), and not inside another shard_map."""
    return (x.ndim - fan_in == 2 and tuple(w_logical[:fan_in]) == tuple(fan_in_names)
            and not w_split and usable())


def gelu_mlp(x: jax.Array, w1: jax.Array, b1: jax.Array, w2: jax.Array,
             scales1: tuple[jax.Array, ...], scales2: tuple[jax.Array, ...]) -> jax.Array:
    """gelu(x . w1 + b1) . w2 for x [batch, seq, d], w1 [d, f], b1 [f], w2 [f, d], both
    products FP8 as `dense`'s, with GELU folded into the kernel passes around them: the
    forward quantises gelu(h + b1) straight from the first product's output h (the
    activation is never written in the compute dtype), and the backward quantises
    d = da * gelu'(h + b1) straight from the second product's input gradient da, with
    d's column sums (b1's gradient) in the same pass. `scales1` / `scales2`: each
    product's (x, w, g) scales; their "gradients" are the amaxes, as for `dense` (the
    first product's input gradient amax is d's, its output's)."""
    dtype = w1.dtype
    return _gelu_mlp(x.astype(dtype), w1, b1.astype(dtype), w2, tuple(scales1),
                     tuple(scales2), placement(x.ndim))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _gelu_mlp(x, w1, b1, w2, scales1, scales2, at: Placement):
    return _gelu_mlp_fwd(x, w1, b1, w2, scales1, scales2, at)[0]


def _gelu_mlp_fwd(x, w1, b1, w2, scales1, scales2, at):
    (sx1, sw1, _), (sx2, sw2, _) = scales1, scales2
    dtype = w1.dtype
    qx, qxt, x_amax = cast_transpose(x, sx1, E4M3, 2, at)
    qw1, qw1t, w1_amax = cast_transpose(w1, sw1, E4M3, 1, at)
    h = _product(_dequantized(qx, sx1, dtype), _dequantized(qw1t, sw1, dtype), 1, dtype)
    qa, qat, a_amax = cast_transpose(h, sx2, E4M3, 2, at, bias=b1)
    qw2, qw2t, w2_amax = cast_transpose(w2, sw2, E4M3, 1, at)
    y = _product(_dequantized(qa, sx2, dtype), _dequantized(qw2t, sw2, dtype), 1, dtype)
    return y, (qxt, qw1, h, b1, qat, qw2, scales1, scales2,
               (x_amax, w1_amax), (a_amax, w2_amax))


def _gelu_mlp_bwd(at, res, g):
    qxt, qw1, h, b1, qat, qw2, scales1, scales2, amax1, amax2 = res
    (sx1, sw1, sg1), (sx2, sw2, sg2) = scales1, scales2
    dtype = g.dtype
    qg, qgt, g_amax = cast_transpose(g, sg2, E5M2, 2, at)
    dg = _dequantized(qg, sg2, dtype)
    da = _product(dg, _dequantized(qw2, sw2, dtype), 1, dtype)
    dw2 = _product(_dequantized(qat, sx2, dtype), _dequantized(qgt, sg2, dtype), 2, dtype)
    qd, qdt, d_amax, db1 = cast_transpose(da, sg1, E5M2, 2, at, pre=h, bias=b1)
    dd = _dequantized(qd, sg1, dtype)
    dx = _product(dd, _dequantized(qw1, sw1, dtype), 1, dtype)
    dw1 = _product(_dequantized(qxt, sx1, dtype), _dequantized(qdt, sg1, dtype), 2, dtype)

    return (dx, dw1, db1.astype(b1.dtype), dw2, _as_scale_grads((*amax1, d_amax), scales1),
            _as_scale_grads((*amax2, g_amax), scales2))


_gelu_mlp.defvjp(_gelu_mlp_fwd, _gelu_mlp_bwd)


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


def dense_parts(x: jax.Array, w: jax.Array, bias: jax.Array | None,
                scales: tuple[jax.Array, ...], fan_in: int) -> tuple[jax.Array, ...]:
    """`dense` of x [batch, seq, *K] by a fused projection w [*K, n, *N] (q / k / v: n
    parts) as its n parts [batch, seq, *N], each plus its bias (`bias` [n, *N] or None).
    The backward quantises the parts' gradients side by side in one kernel pass, with
    their column sums (the bias's gradient): the concatenation of the gradients and the
    bias's reduction, passes of their own in the quantize-dequantize pattern, are not
    made. `scales`: (x, w, g); one g scale for all parts, one amax over them."""
    dtype = w.dtype
    b = jnp.zeros(w.shape[fan_in:], dtype) if bias is None else bias.astype(dtype)
    return _dense_parts(x.astype(dtype), w, b, tuple(scales), fan_in, placement(x.ndim))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _dense_parts(x, w, bias, scales, fan_in: int, at: Placement):
    return _dense_parts_fwd(x, w, bias, scales, fan_in, at)[0]


def _dense_parts_fwd(x, w, bias, scales, fan_in, at):
    sx, sw, _ = scales
    dtype = w.dtype
    qx, qxt, x_amax = cast_transpose(x, sx, E4M3, 2, at)
    qw, qwt, w_amax = cast_transpose(w, sw, E4M3, fan_in, at)
    y = _product(_dequantized(qx, sx, dtype), _dequantized(qwt, sw, dtype), fan_in, dtype)
    parts = tuple(y[:, :, i] + bias[i] for i in range(y.shape[2]))
    return parts, (qxt, qw, bias, scales, x_amax, w_amax)


def _dense_parts_bwd(fan_in, at, res, grads):
    qxt, qw, bias, scales, x_amax, w_amax = res
    sx, sw, sg = scales
    dtype = grads[0].dtype
    qg, qgt, g_amax, db = cast_transpose_parts(tuple(grads), sg, E5M2, at)
    dx = _product(_dequantized(qg, sg, dtype), _dequantized(qw, sw, dtype),
                  qw.ndim - fan_in, dtype)
    dw = _product(_dequantized(qxt, sx, dtype), _dequantized(qgt, sg, dtype), 2, dtype)
    return (dx, dw, db.astype(bias.dtype),
            _as_scale_grads((x_amax, w_amax, g_amax), scales))


_dense_parts.defvjp(_dense_parts_fwd, _dense_parts_bwd)
