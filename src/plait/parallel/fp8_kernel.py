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
The pass is parallel.fp8_cast's; its quantised values are models.fp8's. The residuals
the backward keeps are the FP8 q(x)^T and q(w), not x and w.

`dense` is one product; `gelu_mlp` is GPT-2's MLP, its GELU and GELU's gradient (with
b1's gradient) folded into the passes around its two products; `dense_parts` is a
fused q / k / v projection whose parts' gradients are quantised side by side (with
their bias's gradient).

Inside plait's step the pass runs in a shard_map over the mesh, each device on its
own tokens (the weight whole on each); `applies` says where: no explicit tensor mode,
no tensor split of the weight, the tokens two leading dimensions, not inside a
pipeline's body. Elsewhere parallel.ops keeps the quantize-dequantize pattern. Off a
GPU the kernel runs in Pallas's interpreter (tests; `plait train` refuses "pallas"
there).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from plait.models.fp8 import E4M3, E5M2
from plait.parallel.fp8_cast import cast_transpose, cast_transpose_parts
from plait.parallel.kernel_place import Placement, placement, usable

__all__ = ["applies", "dense", "dense_parts", "gelu_mlp", "usable"]


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
