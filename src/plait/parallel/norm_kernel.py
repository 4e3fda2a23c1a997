"""LayerNorm, and the residual add before it, in one pass of a Pallas (Triton) kernel
each way on NVIDIA GPUs (`model.norm_kernel = "pallas"`).

Compiled for an H100, XLA:GPU makes a LayerNorm of gpt2-124m's [32768, 768] residual
stream three kernels forward (the row statistics, their rsqrt, the normalised output)
and four backward (two row sums, two rescalings, then the input gradient with the
scale's and bias's column sums), reading the stream twice each way; and it folds the
residual add before a norm into the product that precedes it (cuBLASLt's addend), in
place, so it first copies the stream, which the backward still needs (docs/benchmarks.md,
"Without a GPU: the norms in a kernel"). Here a program reads its rows once each way:

- forward, `layer_norm`: y and each row's mean and 1/std (kept for the backward);
  `add_layer_norm(x, h, h_bias, ...)`: s = x + h + h_bias as well, written out, and
  the norm of s -- the product writes h and no copy of x is made;
- backward: from the norm's input, the cotangents of y (and of s) and the statistics,
  the input gradient d = ds + LN'(dy) in one pass, and per program the column sums the
  scale's, the bias's and h_bias's gradients need (XLA adds the programs' sums).

Statistics in float32 from two passes over the rows held in registers (exact, unlike the
shifted one-pass moments of XLA's form). Inside plait's step the kernels run in a
shard_map over the mesh, each device on its own tokens; where the embedding is split
across devices (the statistics would need a sum across them) or inside a pipeline's
body, models.norms keeps XLA's form. Off a GPU the kernels run in Pallas's interpreter
(tests; `plait train` refuses the setting there).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from plait.parallel.kernel_place import Placement, placement, pow2, usable

__all__ = ["add_layer_norm", "layer_norm", "usable"]

# Rows a program normalises at once, programs that share the backward's rows (each
# writes one row of column sums), and the launch settings; not yet tuned on a GPU.
ROWS = 4
PROGRAMS = 528  # 4 x an H100's 132 SMs
NUM_WARPS = 4
NUM_STAGES = 1


def _block(ref, r0, rows: int, n: int, total: int, width: int):
    """The [rows, width] block of ref [total, n] at row r0, float32, zero past its edges."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    r = r0 + jnp.arange(rows)
    c = jnp.arange(width)
    mask = (r < total)[:, None] & (c < n)[None, :]
    return plt.load(ref.at[pl.ds(r0, rows), pl.ds(0, width)], mask=mask,
                    other=0).astype(jnp.float32), mask


def _fwd_kernel(n: int, total: int, rows: int, width: int, eps: float, residual: bool,
                *refs):
    """A block of rows (after the residual add, written out): their mean and 1/std
    (float32, two passes over the rows held in registers) and the scaled, shifted
    output."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    if residual:
        x_ref, h_ref, hb_ref, w_ref, b_ref, s_ref, y_ref, mean_ref, rstd_ref = refs
    else:
        x_ref, w_ref, b_ref, y_ref, mean_ref, rstd_ref = refs
    r0 = pl.program_id(0) * rows
    x, mask = _block(x_ref, r0, rows, n, total, width)
    cols = jnp.arange(width) < n
    if residual:
        h, _ = _block(h_ref, r0, rows, n, total, width)
        hb = plt.load(hb_ref.at[pl.ds(0, width)], mask=cols, other=0).astype(jnp.float32)
        s = (x + h + hb[None, :]).astype(s_ref.dtype)
        plt.store(s_ref.at[pl.ds(r0, rows), pl.ds(0, width)], s, mask=mask)
        x = jnp.where(mask, s.astype(jnp.float32), 0.0)  # normalise what was stored
    mean = jnp.sum(x, axis=1) / n
    d = jnp.where(mask, x - mean[:, None], 0.0)
    rstd = jax.lax.rsqrt(jnp.sum(d * d, axis=1) / n + eps)
    w = plt.load(w_ref.at[pl.ds(0, width)], mask=cols, other=0).astype(jnp.float32)
    b = plt.load(b_ref.at[pl.ds(0, width)], mask=cols, other=0).astype(jnp.float32)
    y = d * rstd[:, None] * w[None, :] + b[None, :]
    plt.store(y_ref.at[pl.ds(r0, rows), pl.ds(0, width)], y.astype(y_ref.dtype), mask=mask)
    live = r0 + jnp.arange(rows) < total
    plt.store(mean_ref.at[pl.ds(r0, rows)], mean, mask=live)
    plt.store(rstd_ref.at[pl.ds(r0, rows)], rstd, mask=live)


def _bwd_kernel(n: int, total: int, rows: int, width: int, programs: int, residual: bool,
                *refs):
    """Program p takes the row blocks p, p + programs, ...: the input gradient of each,
    and its sums over them of dy * xhat, dy and d (the scale's, bias's and h_bias's
    gradients), row p of [k, programs, n]: one array, so that one reduction finishes
    them (one each was two or three tiny kernels a norm: 62 of gpt2-124m's step)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    if residual:
        x_ref, dy_ref, ds_ref, mean_ref, rstd_ref, w_ref, d_ref, sums_ref = refs
    else:
        x_ref, dy_ref, mean_ref, rstd_ref, w_ref, d_ref, sums_ref = refs
    p = pl.program_id(0)
    cols = jnp.arange(width) < n
    w = plt.load(w_ref.at[pl.ds(0, width)], mask=cols, other=0).astype(jnp.float32)
    blocks = pl.cdiv(total, rows)

    def one(i, sums):
        r0 = (p + i * programs) * rows
        x, mask = _block(x_ref, r0, rows, n, total, width)
        dy, _ = _block(dy_ref, r0, rows, n, total, width)
        live = r0 + jnp.arange(rows) < total
        mean = plt.load(mean_ref.at[pl.ds(r0, rows)], mask=live, other=0)
        rstd = plt.load(rstd_ref.at[pl.ds(r0, rows)], mask=live, other=0)
        xhat = jnp.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        wdy = w[None, :] * dy
        c1 = jnp.sum(xhat * wdy, axis=1) / n
        c2 = jnp.sum(wdy, axis=1) / n
        d = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        if residual:
            ds, _ = _block(ds_ref, r0, rows, n, total, width)
            d = d + ds
        d = jnp.where(mask, d, 0.0)
        plt.store(d_ref.at[pl.ds(r0, rows), pl.ds(0, width)], d.astype(d_ref.dtype),
                  mask=mask)
        out = (sums[0] + jnp.sum(dy * xhat, axis=0), sums[1] + jnp.sum(dy, axis=0))
        return out + ((sums[2] + jnp.sum(d, axis=0),) if residual else ())

    zero = jnp.zeros((width,), jnp.float32)
    mine = pl.cdiv(blocks - p, programs)  # blocks p, p + programs, ... below `blocks`
    sums = jax.lax.fori_loop(0, mine, one, (zero,) * (3 if residual else 2))
    for k, value in enumerate(sums):
        plt.store(sums_ref.at[jnp.int32(k), p, pl.ds(0, width)], value, mask=cols)


def _call(kernel, args, out_shape, grid: int, interpret: bool, num_warps: int):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    anywhere = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        kernel, out_shape=out_shape, grid=(grid,), in_specs=[anywhere] * len(args),
        out_specs=tuple(anywhere for _ in out_shape),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=NUM_STAGES),
        interpret=interpret)(*args)


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "rows", "num_warps"))
def _forward(x, h, hb, w, b, eps: float, interpret: bool, rows: int = ROWS,
             num_warps: int = NUM_WARPS):
    """x, h [tokens, n] (h None: no residual add), hb, w, b [n] -> (s = x + h + hb or
    None, y [tokens, n], mean, rstd [tokens])."""
    total, n = x.shape
    stat = jax.ShapeDtypeStruct((total,), jnp.float32)
    act = jax.ShapeDtypeStruct(x.shape, x.dtype)
    residual = h is not None
    kernel = functools.partial(_fwd_kernel, n, total, rows, pow2(n), eps, residual)
    grid = _cdiv(total, rows)
    if residual:
        return _call(kernel, (x, h, hb, w, b), (act, act, stat, stat), grid, interpret,
                     num_warps)
    return (None, *_call(kernel, (x, w, b), (act, stat, stat), grid, interpret, num_warps))


@functools.partial(jax.jit, static_argnames=("interpret", "rows", "programs", "num_warps"))
def _backward(x, dy, ds, mean, rstd, w, interpret: bool, rows: int = ROWS,
              programs: int = PROGRAMS, num_warps: int = NUM_WARPS):
    """-> (d [tokens, n], dw, db, dhb [n] float32; dhb None without ds)."""
    total, n = x.shape
    residual = ds is not None
    programs = max(1, min(programs, _cdiv(total, rows)))
    kernel = functools.partial(_bwd_kernel, n, total, rows, pow2(n), programs, residual)
    parts = jax.ShapeDtypeStruct((3 if residual else 2, programs, n), jnp.float32)
    d_shape = jax.ShapeDtypeStruct(x.shape, dy.dtype)
    args = (x, dy, ds, mean, rstd, w) if residual else (x, dy, mean, rstd, w)
    d, parts = _call(kernel, args, (d_shape, parts), programs, interpret, num_warps)
    sums = parts.sum(1)
    return d, sums[0], sums[1], sums[2] if residual else None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _rows_of(a):
    return a.reshape(-1, a.shape[-1])


def _fwd_local(residual: bool, eps: float, interpret: bool):
    """The forward on one device's arrays: (x, [h, hb,] w, b) -> ([s,] y, mean, rstd)."""
    def f(x, *rest):
        h, hb = (_rows_of(rest[0]), rest[1]) if residual else (None, None)
        s, y, mean, rstd = _forward(_rows_of(x), h, hb, *rest[-2:], eps, interpret)
        lead = x.shape[:-1]
        outs = (y.reshape(x.shape), mean.reshape(lead), rstd.reshape(lead))
        return ((s.reshape(x.shape),) if residual else ()) + outs
    return f


def _bwd_local(residual: bool, interpret: bool):
    """The backward on one device's arrays: (x, dy, [ds,] mean, rstd, w) -> (d, this
    device's column sums [1, n] each; summed across the devices by the caller)."""
    def f(x, dy, *rest):
        ds = _rows_of(rest[0]) if residual else None
        mean, rstd, w = rest[-3:]
        d, *sums = _backward(_rows_of(x), _rows_of(dy), ds, mean.reshape(-1),
                             rstd.reshape(-1), w, interpret)
        return (d.reshape(x.shape), *(c[None] for c in sums if c is not None))
    return f


def _run_forward(at: Placement, residual: bool, eps: float, args):
    local = _fwd_local(residual, eps, at.interpret)
    if at.mesh is None:
        return local(*args)
    act, stat = P(*at.tokens, None), at.tokens
    n_act = 2 if residual else 1
    in_specs = (act,) * n_act + (P(),) * (len(args) - n_act)
    out_specs = (act,) * n_act + (stat, stat)
    # check_vma off: Pallas's interpreter mistypes its loop's carry inside a shard_map
    # that checks it (as in parallel.loss_kernel)
    return jax.shard_map(local, mesh=at.mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)(*args)


def _run_backward(at: Placement, residual: bool, args):
    local = _bwd_local(residual, at.interpret)
    if at.mesh is None:
        outs = local(*args)
        return (outs[0],) + tuple(o[0] for o in outs[1:])
    act, stat = P(*at.tokens, None), at.tokens
    n_act = 3 if residual else 2
    in_specs = (act,) * n_act + (stat, stat, P())
    # each device's column sums, one row each of [the devices along the tokens' axes, n]
    rows = P(at.token_axes() or None, None)
    n_sums = 3 if residual else 2
    outs = jax.shard_map(local, mesh=at.mesh, in_specs=in_specs,
                         out_specs=(act,) + (rows,) * n_sums, check_vma=False)(*args)
    return (outs[0],) + tuple(o.sum(0) for o in outs[1:])


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """LayerNorm of x [..., n] over its last axis (statistics in float32), scaled and
    shifted by scale, bias [n], in x's dtype."""
    return _layer_norm(x, scale, bias, eps, placement(x.ndim))


def add_layer_norm(x: jax.Array, h: jax.Array, h_bias: jax.Array, scale: jax.Array,
                   bias: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
    """(s, LayerNorm(s)) for s = x + h + h_bias: a residual add (h a projection's output,
    h_bias its bias [n]) and the norm after it, in one pass."""
    return _add_layer_norm(x, h, h_bias, scale, bias, eps, placement(x.ndim))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _layer_norm(x, scale, bias, eps: float, at: Placement):
    return _run_forward(at, False, eps, (x, scale, bias))[0]


def _layer_norm_fwd(x, scale, bias, eps, at):
    y, mean, rstd = _run_forward(at, False, eps, (x, scale, bias))
    return y, (x, mean, rstd, scale, bias)


def _layer_norm_bwd(eps, at, res, dy):
    x, mean, rstd, scale, bias = res
    d, dw, db = _run_backward(at, False, (x, dy, mean, rstd, scale))
    return d.astype(x.dtype), dw.astype(scale.dtype), db.astype(bias.dtype)


_layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _add_layer_norm(x, h, h_bias, scale, bias, eps: float, at: Placement):
    s, y, _, _ = _run_forward(at, True, eps, (x, h, h_bias, scale, bias))
    return s, y


def _add_layer_norm_fwd(x, h, h_bias, scale, bias, eps, at):
    s, y, mean, rstd = _run_forward(at, True, eps, (x, h, h_bias, scale, bias))
    return (s, y), (s, mean, rstd, scale, bias, h_bias)


def _add_layer_norm_bwd(eps, at, res, cot):
    s, mean, rstd, scale, bias, h_bias = res
    ds, dy = cot
    d, dw, db, dhb = _run_backward(at, True, (s, dy, ds, mean, rstd, scale))
    d = d.astype(s.dtype)
    return d, d, dhb.astype(h_bias.dtype), dw.astype(scale.dtype), db.astype(bias.dtype)


_add_layer_norm.defvjp(_add_layer_norm_fwd, _add_layer_norm_bwd)
