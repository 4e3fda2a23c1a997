"""The compute ops models call: `dense` and `lookup`, by the active tensor mode;
`attend` and `sequence_positions`, by the active context axis (parallel.context).

Under 1-D (or no) tensor parallelism they are an einsum and a take that GSPMD
partitions; under 2-D / 2.5-D / 3-D they are the explicit shard_map layers of
`parallel.tensor`, laid out by the active rule set (`plait.sharding.use`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from plait.models.activations import gelu
from plait.models.fp8 import Scaling, apart, quantized_gradient, quantized_inputs
from plait.parallel import fp8_kernel, tensor
from plait.parallel.context import attend
from plait.parallel.context import positions as sequence_positions
from plait.sharding import (
    MeshAxes,
    Rules,
    active,
    axes_spec,
    axes_tuple,
    constrain,
    param_meta,
    pin,
    spec,
    use,
)

__all__ = ["add_bias", "add_part_biases", "attend", "dense", "dense_parts", "dense_value",
           "expert_weight", "gathered_weight", "gelu_mlp", "lookup", "sequence_positions",
           "small_dense", "weight_grad_by_shard"]


def _letters(n: int, skip: str = "") -> list[str]:
    return [c for c in "abcdefghijklmnopqrstuvwxyz" if c not in skip][:n]


def _own_matmul(ctx: tuple | None) -> bool:
    """Whether the active tensor mode (`ctx`: sharding.active()) runs its own shard_map
    layers (2-D / 2.5-D / 3-D), rather than leave an einsum or take to GSPMD."""
    return ctx is not None and ctx[1].mode not in (None, "1d")


def dense(x: jax.Array, w: nnx.Variable, fp8: Scaling | None = None) -> jax.Array:
    """x [..., *fan_in] times weight `w` (contracting its `fan_in` dimensions).

    The output has x's leading dimensions followed by w's other dimensions, in
    w's order. Under 1-D (or no) tensor parallelism this is an einsum that GSPMD
    partitions; under 2-D / 2.5-D / 3-D it is the explicit gathered matmul of
    `parallel.tensor`, laid out by the active rules. With `fp8` (the matmul's
    scaling state, models.fp8) the operands are quantised around it, in the global
    view, whichever layer runs it: by parallel.fp8_cast's passes where the state asks
    for them (model.fp8_kernel) and they apply, else by the quantize-dequantize pattern.
    """
    if fp8 is None:
        return _dense(x, w, w[...])
    if fp8.kernel and _fp8_kernel_applies(x, w):
        return fp8_kernel.dense(x, w[...], fp8.scales(), len(param_meta(w)[1]))
    x, value = quantized_inputs(x, w[...], fp8)
    return quantized_gradient(_dense(x, w, value), fp8)


def gelu_mlp(x: jax.Array, w1: nnx.Variable, b1: jax.Array | float, w2: nnx.Variable,
             fp8_1: Scaling | None = None, fp8_2: Scaling | None = None) -> jax.Array:
    """GPT-2's MLP before its output bias, gelu(x w1 + b1) w2 (`fp8_1`, `fp8_2`: the two
    products' FP8 scaling states, or None). Where parallel.fp8_kernel's matmul takes both
    products (model.fp8_kernel = "pallas"), one op whose kernel passes fold the GELU,
    its gradient and b1's gradient into the quantisation (fp8_kernel.gelu_mlp); else two
    `dense`s around the GELU, which under FP8 stays out of the first product's epilogue
    (models.fp8.apart)."""
    if (fp8_1 is not None and fp8_2 is not None and fp8_1.kernel
            and _fp8_kernel_applies(x, w1) and _fp8_kernel_applies(x, w2)):
        b = b1 if isinstance(b1, jax.Array) else jnp.zeros(w1.shape[-1:], w1.dtype)
        return fp8_kernel.gelu_mlp(x, w1[...], b, w2[...], fp8_1.scales(), fp8_2.scales())
    h = gelu(apart(dense(x, w1, fp8_1) + b1, fp8_1))
    h = constrain(h, ("act_batch", "act_seq", "act_mlp"))
    return dense(h, w2, fp8_2)


def _fp8_kernel_applies(x: jax.Array, w: nnx.Variable) -> bool:
    """Whether parallel.fp8_kernel's matmul runs this product (model.fp8_kernel =
    "pallas"): GSPMD's einsum in the global view, the weight not split by tensor."""
    logical, fan_in = param_meta(w)
    ctx = active()
    if _own_matmul(ctx):
        return False
    split = ctx is not None and any(
        math.prod(ctx[0].shape.get(a, 1) for a in axes_tuple(axes)) > 1
        for axes in _gathered_axes(w, ctx[1]))
    return fp8_kernel.applies(x, len(fan_in), logical, fan_in, split)


def dense_parts(x: jax.Array, w: nnx.Variable, axis: str, fp8: Scaling | None = None,
                bias: jax.Array | None = None) -> tuple[jax.Array, ...]:
    """dense(x, w) split along w's output dimension named `axis` (a fused projection's
    q / k / v), as one product per part, each its own array, plus its part of `bias`
    (stacked like the parts, or None; add_part_biases).

    The fused product's parts were slices: on a GPU a copy of the whole output in the
    forward, and a zero-filled concatenation of their gradients in the backward (2.4%
    of gpt2-1.3b's step compiled for an H100). One product per part reads x once per
    part instead and sums the parts' input gradients. The parts are slices of the
    fused product, as before, under FP8 (one scaling state for the whole weight), the
    2-D / 2.5-D / 3-D modes (their own gathered matmul), and wherever w's outputs are
    split across devices (1-D tensor's heads): there each part's input gradient is a
    partial sum, and GSPMD all-reduced the three apart (a third more tensor bytes).
    Under FP8 with parallel.fp8_kernel's matmul, one op whose backward quantises the
    parts' gradients side by side, the bias's gradient in the same pass.
    """
    logical, fan_in = param_meta(w)
    at = logical.index(axis)
    if axis in fan_in:
        raise ValueError(f"dense_parts splits an output dimension; {axis!r} is contracted")
    if (fp8 is not None and fp8.kernel and at == len(fan_in)
            and _fp8_kernel_applies(x, w)):
        return fp8_kernel.dense_parts(x, w[...], bias, fp8.scales(), len(fan_in))
    ctx = active()
    w_spec = axes_spec(_gathered_axes(w, ctx[1]), ctx[0]) if ctx is not None else None
    split_outputs = w_spec is not None and any(
        w_spec[i] is not None for i, n in enumerate(logical) if n not in fan_in)
    if fp8 is not None or split_outputs or _own_matmul(ctx):
        out = dense(x, w, fp8)
        where = x.ndim - len(fan_in) + [n for n in logical if n not in fan_in].index(axis)
        parts = tuple(jax.lax.index_in_dim(out, i, where, keepdims=False)
                      for i in range(out.shape[where]))
    else:
        part = tuple(n for n in logical if n != axis)
        eq = _equation(part, fan_in, x.ndim - len(fan_in))
        value = w[...]
        xs = fan_out(x, value.shape[at])
        parts = tuple(jnp.einsum(eq, xi, jax.lax.index_in_dim(value, i, at, keepdims=False))
                      for i, xi in enumerate(xs))
    return parts if bias is None else add_part_biases(parts, bias)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def fan_out(x: jax.Array, n: int) -> tuple[jax.Array, ...]:
    """n uses of x whose gradients are summed newest-first, g[n-1] + (... + (g[1] +
    g[0])): each product's input gradient then takes the sum so far as its GEMM's
    addend (cuBLASLt's beta = 1). Autodiff's own order, (g[0] + g[1]) + g[2], leaves
    the last sum to an add kernel of its own, since XLA:GPU folds an add into the
    product on its left only (dense_parts' q / k / v compiled for an H100: one such
    add per layer, reading two and writing one array of the activations' size)."""
    return (x,) * n


def _fan_out_fwd(x: jax.Array, n: int):
    return (x,) * n, None


def _fan_out_bwd(n: int, _, grads: tuple[jax.Array, ...]):
    total = grads[0]
    for g in grads[1:]:
        total = g + total
    return (total,)


fan_out.defvjp(_fan_out_fwd, _fan_out_bwd)


def add_bias(y: jax.Array, b: jax.Array | float) -> jax.Array:
    """y + b, b over y's last b.ndim dimensions. A bias of several (a projection's
    [heads, head]) is added over them flattened, one vector of their product: XLA:GPU
    then adds it in the product's epilogue (cuBLASLt's BIAS), where the broadcast of a
    [heads, head] bias was written out at the output's size for the product to read
    back (gpt2-124m compiled for an H100: 36 such writes a step, 1.3% of it). Flattened
    only under 1-D (or no) tensor parallelism; the 2-D / 3-D modes lay the two out
    apart."""
    ndim = getattr(b, "ndim", 0)
    ctx = active()
    if ndim < 2 or _own_matmul(ctx):
        return y + b
    lead = y.shape[:y.ndim - ndim]
    return (y.reshape(*lead, -1) + b.reshape(-1)).reshape(y.shape)


@jax.custom_vjp
def add_part_biases(parts: tuple[jax.Array, ...], b: jax.Array) -> tuple[jax.Array, ...]:
    """add_bias(parts[i], b[i]) for each part of a fused projection (q / k / v) and its
    stacked bias b [parts, ...]. The bias's gradient is one reduction over the parts'
    stacked gradients, in float32, where autodiff summed each part's apart in the
    compute dtype (gpt2-124m compiled for an H100: two reduction kernels a layer, were
    six)."""
    return tuple(add_bias(p, b[i]) for i, p in enumerate(parts))


def _add_part_biases_fwd(parts, b):
    return add_part_biases(parts, b), b  # b for its shape and dtype (a few kB, alive anyway)


def _add_part_biases_bwd(b, grads):
    stacked = jnp.stack(grads).astype(jnp.float32)
    lead = tuple(range(1, stacked.ndim - b.ndim + 1))
    return grads, jnp.sum(stacked, axis=lead).astype(b.dtype)


add_part_biases.defvjp(_add_part_biases_fwd, _add_part_biases_bwd)


def _equation(logical: tuple[str, ...], fan_in: tuple[str, ...], lead: int) -> str:
    """The einsum of x [lead..., *fan_in] by a weight named `logical`: x's leading
    dimensions, then the weight's other dimensions in its order."""
    names = dict(zip(logical, _letters(len(logical), skip="bs"), strict=True))
    lead_l = _letters(lead, skip="".join(names.values()))
    x_l = lead_l + [names[n] for n in fan_in]
    out_names = [n for n in logical if n not in fan_in]
    return (f"{''.join(x_l)},{''.join(names[n] for n in logical)}->"
            f"{''.join(lead_l + [names[n] for n in out_names])}")


def gathered_weight(w: nnx.Variable) -> jax.Array:
    """w's value with its fsdp shards gathered, for a loop that multiplies by it many
    times (models.loss's pieces): one all-gather before the loop, and one reduce-scatter
    of its gradient after it, rather than one of each per iteration."""
    value = w[...]
    ctx = active()
    if ctx is None:
        return value
    mesh, rules = ctx
    return pin(value, axes_spec(_gathered_axes(w, rules), mesh))


def expert_weight(w: nnx.Variable) -> jax.Array:
    """An expert weight's value as the experts' einsums (GSPMD's in every tensor mode)
    take it: its fsdp shards gathered (ZeRO-3), and under 2-D / 2.5-D / 3-D split only
    by expert. With one row per device, GSPMD had kept the weights split by d and moved
    the tokens instead, swapping them between fsdp and tensor (1-D) or row and col
    (2-D): collective-permutes, which hang inside a pipeline's per-tick switch."""
    value = w[...]
    ctx = active()
    if ctx is None:
        return value
    mesh, rules = ctx
    axes = _gathered_axes(w, rules)
    if _own_matmul(ctx):
        logical, _ = param_meta(w)
        axes = [a if n == "experts" else None for n, a in zip(logical, axes, strict=True)]
    return pin(value, axes_spec(axes, mesh))


def weight_grad_by_shard(w: nnx.Variable, x_ndim: int, fan_in: tuple[str, ...] | None = None):
    """For a loop that accumulates the gradient of dense(x, w) over pieces of the
    tokens (models.loss): (partial, total, shape). partial(x, g) is the gradient of w from
    each token shard's own tokens (x [batch, seq, *fan_in], g the cotangent of
    dense's output), stacked [batch shards, seq shards, *w.shape] in float32 and
    laid out over the devices holding those tokens, so no device sums anything with
    another; total(partials) sums the shards once, after the loop (the one
    all-reduce or reduce-scatter the whole-batch gradient has); shape is the stacked
    partials' (a loop's accumulator starts as zeros of it). None where the tensor
    mode's own matmul reduces w's gradient (2-D / 3-D), outside a step, or where a
    token axis also splits w. `fan_in`: the dimensions contracted, where not w's own
    (a vector weight contracted whole)."""
    ctx = active()
    if ctx is None or _own_matmul(ctx) or x_ndim != 3:
        return None
    mesh, rules = ctx
    logical, own = param_meta(w)
    fan_in = own if fan_in is None else fan_in
    w_axes = _gathered_axes(w, rules)
    tok_b, tok_s = (axes_tuple(spec([n], rules, mesh)[0]) for n in ("act_batch", "act_seq"))
    if set(tok_b + tok_s) & {a for ax in w_axes for a in axes_tuple(ax)}:
        return None
    pb = int(np.prod([mesh.shape[a] for a in tok_b]))
    ps = int(np.prod([mesh.shape[a] for a in tok_s]))
    names = dict(zip(logical, _letters(len(logical), skip="pbqs"), strict=True))
    x_l = "pbqs" + "".join(names[n] for n in fan_in)
    g_l = "pbqs" + "".join(names[n] for n in logical if n not in fan_in)
    eq = f"{x_l},{g_l}->pq{''.join(names[n] for n in logical)}"
    target = axes_spec([tok_b or None, tok_s or None, *w_axes], mesh)
    w_target = axes_spec(w_axes, mesh)

    def split(a: jax.Array) -> jax.Array:  # [B, S, ...] -> [pb, B / pb, ps, S / ps, ...]
        b, s = a.shape[:2]
        return a.reshape(pb, b // pb, ps, s // ps, *a.shape[2:])

    def partial(x: jax.Array, g: jax.Array) -> jax.Array:
        return pin(jnp.einsum(eq, split(x), split(g), preferred_element_type=jnp.float32),
                   target)

    def total(partials: jax.Array) -> jax.Array:
        return pin(jnp.sum(partials, axis=(0, 1)), w_target)

    return partial, total, (pb, ps, *w.shape)


def small_dense(x: jax.Array, w: nnx.Variable, value: jax.Array,
                fan_in: tuple[str, ...] | None = None) -> jax.Array:
    """x [batch, seq, *fan_in] times a small weight that no tensor axis splits (a MoE
    router, a gate), its value given; `fan_in` as weight_grad_by_shard's. The weight's
    gradient is summed by each token shard on its own devices and across the shards once
    (weight_grad_by_shard): left to itself, GSPMD moved the tokens from the fsdp axis
    onto tensor to split that gradient by fsdp (collective-permutes, which inside a
    pipeline's per-tick switch hang: the other stage never joins them). Elsewhere (2-D /
    3-D modes, outside a step) the einsum, partitioned by GSPMD."""
    logical, own = param_meta(w)
    fan_in = own if fan_in is None else fan_in
    names = dict(zip(logical, _letters(len(logical), skip="bs"), strict=True))
    eq = (f"bs{''.join(names[n] for n in fan_in)},{''.join(names[n] for n in logical)}->bs"
          f"{''.join(names[n] for n in logical if n not in fan_in)}")
    grad = weight_grad_by_shard(w, x.ndim, fan_in)
    if grad is None:
        return jnp.einsum(eq, x, value)
    partial, total, _ = grad
    ctx = active()  # the backward is traced after the step's `use` has ended

    @jax.custom_vjp
    def product(x, value):
        return jnp.einsum(eq, x, value)

    def forward(x, value):
        return product(x, value), (x, value)

    def backward(res, g):
        x, value = res
        _, pull = jax.vjp(lambda x: jnp.einsum(eq, x, value), x)
        with use(*ctx):
            return pull(g)[0], total(partial(x, g)).astype(value.dtype)

    product.defvjp(forward, backward)
    return product(x, value)


def dense_value(x: jax.Array, w: nnx.Variable, value: jax.Array) -> jax.Array:
    """dense(x, w) with w's value given (gathered_weight's), laid out by w's names."""
    return _dense(x, w, value)


def _dense(x: jax.Array, w: nnx.Variable, value: jax.Array) -> jax.Array:
    logical, fan_in = param_meta(w)
    lead = x.ndim - len(fan_in)
    out_names = [n for n in logical if n not in fan_in]
    eq = _equation(logical, fan_in, lead)
    ctx = active()
    if not _own_matmul(ctx):
        return jnp.einsum(eq, x, value)
    mesh, rules = ctx
    x_spec = spec(["act_batch"] + [None] * (lead - 1) + [f"act_{n}" for n in fan_in], rules, mesh)
    # The product's own layout; a held name's value is laid out as held by the model's
    # constraint after it (3-D: key/value heads replicated over tensor_y, a gather of the
    # small product rather than of what attention makes of it).
    out_spec = spec(["act_batch"] + [None] * (lead - 1) + [f"act_{n}" for n in out_names],
                    replace(rules, held={}), mesh)
    w_spec = axes_spec(_gathered_axes(w, rules), mesh)
    contracted = [logical.index(n) for n in fan_in]
    return tensor.gathered_matmul(eq, x, value, mesh=mesh, x_spec=x_spec, w_spec=w_spec,
                                  out_spec=out_spec, x_contracted=list(range(lead, x.ndim)),
                                  w_contracted=contracted)


def lookup(table: nnx.Variable, ids: jax.Array) -> jax.Array:
    """Rows of an embedding table [vocab, embed] for integer ids [batch, seq].

    The result is laid out like the residual stream. 1-D gathers the table's
    fsdp shards and lets GSPMD do a vocabulary-parallel lookup; 2-D / 3-D use
    `parallel.tensor.sharded_lookup`, which never gathers the whole table.
    """
    value = table[...]
    ctx = active()
    if not _own_matmul(ctx):
        # Gather the table's d_model shards (ZeRO-3) before the vocabulary-parallel
        # lookup; a lookup into a table split both ways has no efficient partition.
        return jnp.take(constrain(value, ("vocab", "act_embed")), ids, axis=0)
    mesh, rules = ctx
    t_spec = axes_spec(_gathered_axes(table, rules), mesh)
    out_spec = spec(["act_batch"] + [None] * (ids.ndim - 1) + ["act_embed"], rules, mesh)
    return tensor.sharded_lookup(value, ids, mesh=mesh, table_spec=t_spec, out_spec=out_spec)


def _without(axes: MeshAxes, drop: str) -> MeshAxes:
    """Axes minus `drop`: fsdp shards are gathered by GSPMD before a shard_map."""
    kept = tuple(a for a in axes_tuple(axes) if a != drop)
    return kept or None


def _gathered_axes(w: nnx.Variable, rules: Rules) -> list[MeshAxes]:
    """The mesh axes of each of w's dimensions once its fsdp shards are gathered."""
    logical, fan_in = param_meta(w)
    return [_without(a, "fsdp") for a in rules.param_axes(logical, fan_in)]
