"""What the backward keeps between forward and backward (docs/architecture.md, "What a
layer keeps for the backward"): norms their input and per-token statistics, the MLPs'
activations their input and output, the loss the logits in their own dtype and one
log-sum-exp a token; their gradients those of plain autodiff."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import make_mesh, tiny
from jax._src.ad_checkpoint import saved_residuals

from plait.models.activations import gelu, swiglu, swiglu_halves
from plait.models.keys import ParamKeys
from plait.models.loss import _per_token, cross_entropy
from plait.models.norms import LayerNorm, rms

B, S, D, F, V = 2, 8, 16, 48, 40


class P:
    """An nnx.Param stand-in: `rms` reads scale[...]."""

    def __init__(self, v):
        self.v = v

    def __getitem__(self, _):
        return self.v


def _kept(f, *args) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, shape) of each value f's backward keeps, f's own arguments included."""
    return sorted((str(a.dtype), tuple(a.shape)) for a, _ in saved_residuals(f, *args))


def test_norms_keep_only_per_token_statistics_and_match_autodiff():
    """An RMSNorm and a LayerNorm keep float32 [B, S, 1] statistics only (their input is
    the caller's), not the float32 copies of [B, S, D] they kept before; value and
    gradients equal the plain formulas' autodiff."""
    x = jax.random.normal(jax.random.key(0), (B, S, D), jnp.bfloat16)
    scale = jax.random.normal(jax.random.key(1), (D,))

    def ours(x, scale):
        return rms(x, P(scale), 1e-5).astype(jnp.float32)

    def plain(x, scale):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + 1e-5)
        return (y.astype(x.dtype) * scale.astype(x.dtype)).astype(jnp.float32)

    kept = _kept(lambda x, s: ours(x, s).sum(), x, scale)
    assert ("float32", (B, S, D)) not in kept and ("float32", (B, S, 1)) in kept, kept
    assert ("float32", (B, S, D)) in _kept(lambda x, s: plain(x, s).sum(), x, scale)
    g = jax.random.normal(jax.random.key(2), (B, S, D))
    for a, b in zip(jax.vjp(ours, x, scale)[1](g), jax.vjp(plain, x, scale)[1](g),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))

    ln = LayerNorm(D, 1e-5, ParamKeys(0))
    kept = _kept(lambda x: ln(x).astype(jnp.float32).sum(), x)
    assert [k for k in kept if len(k[1]) == 3] == [("bfloat16", (B, S, D))] + [
        ("float32", (B, S, 1))] * 3, kept  # the input; mean, variance, reciprocal root


def _row_reductions(f, *args) -> int:
    """Reductions over the last axis in f's program as XLA:CPU compiles it (the
    remat's dead recomputations removed)."""
    text = jax.jit(f).lower(*args).compile().as_text()
    return len(re.findall(r" reduce\(.*dimensions=\{2\}", text))


@pytest.mark.parametrize("offset", [0.0, 1e4])
def test_layer_norm_moments_in_one_pass_equal_the_two_pass_formula(offset):
    """LayerNorm's statistics from one reduction of x (shifted by each row's first
    value) and their backward from two: value and gradients equal the two-pass formula
    computed in float64, also where the mean is 1e4 times the spread, which the unshifted
    mean(x^2) - mean(x)^2 gets wrong in float32; five row reductions before (the
    variance's read the mean's, the backward's three), four now."""
    k = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(k[0], (B, S, D)) + offset
    scale, bias = (jax.random.normal(k[i], (D,)) for i in (1, 2))
    g = jax.random.normal(k[3], (B, S, D))
    from plait.models.norms import _KEEP_STATS, _layer_norm

    def reference(x, scale, bias):
        mean = x.mean(-1, keepdims=True)
        var = jnp.square(x - mean).mean(-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + 1e-5) * scale + bias

    def ours(x, scale, bias):  # as LayerNorm runs it
        return jax.checkpoint(_layer_norm, policy=_KEEP_STATS, static_argnums=(3,))(
            x, scale, bias, 1e-5)

    with jax.enable_x64():
        args64 = [np.asarray(a, np.float64) for a in (x, scale, bias)]
        want, pull = jax.vjp(reference, *args64)
        want_grads = pull(np.asarray(g, np.float64))
    got, pull = jax.vjp(ours, x, scale, bias)
    tol = 2e-4 + 2e-7 * offset  # float32's rounding of a mean that far out: 1e-3 at 1e4
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    for a, b in zip(pull(g), want_grads, strict=True):
        np.testing.assert_allclose(a, b, rtol=10 * tol, atol=10 * tol)
    naive = jax.lax.rsqrt(jnp.maximum(jnp.square(x).mean(-1) - jnp.square(x.mean(-1)), 0)
                          + 1e-5)
    exact = jax.lax.rsqrt(jnp.asarray(np.asarray(x, np.float64).var(-1) + 1e-5))
    assert offset == 0 or not np.allclose(naive, exact, rtol=0.1)  # the shift's reason
    for f, n in ((ours, 4), (reference, 5)):
        assert _row_reductions(lambda *a, f=f: jax.vjp(f, *a)[1](g), x, scale, bias) == n


def test_activations_keep_their_input_and_output_and_match_autodiff():
    """SwiGLU keeps the gate, the up half and the product (three [B, S, F], was six);
    GELU its input and output (was six); gradients equal plain autodiff's."""
    k = jax.random.split(jax.random.key(0), 3)
    g, u = (jax.random.normal(k[i], (B, S, F), jnp.bfloat16) for i in range(2))
    w = jax.random.normal(k[2], (F, D), jnp.bfloat16)

    def mlp(act):  # the activation's output feeds a matmul whose weight has a gradient
        return lambda *a: (act(*a[:-1]) @ a[-1]).astype(jnp.float32).sum()

    def wide(f, *args) -> int:
        return sum(shape == (B, S, F) for _, shape in _kept(f, *args))

    assert wide(mlp(swiglu), g, u, w) == 3  # g, u for silu's gradient; the product for w's
    assert wide(mlp(lambda g, u: jax.nn.silu(g) * u), g, u, w) == 6
    assert wide(mlp(gelu), g, w) == 2
    assert wide(mlp(lambda h: jax.nn.gelu(h, approximate=True)), g, w) == 6
    for ours, plain, args in ((swiglu, lambda g, u: jax.nn.silu(g) * u, (g, u, w)),
                              (gelu, lambda h: jax.nn.gelu(h, approximate=True), (g, w))):
        np.testing.assert_array_equal(
            np.asarray(jax.grad(mlp(ours), range(len(args)))(*args)[0], np.float32),
            np.asarray(jax.grad(mlp(plain), range(len(args)))(*args)[0], np.float32))


def test_swiglu_of_fused_halves_keeps_the_product_s_output_not_its_halves():
    """SwiGLU of one [..., 2, F] product output (Llama's fused gate and up) keeps that
    output itself and the activation: no [B, S, F] half apart (the checkpoint of two
    halves kept both, which a GPU writes out as a copy of the whole output). Value and
    gradients equal those of the halves through `swiglu`, bit for bit."""
    k = jax.random.split(jax.random.key(0), 2)
    pre = jax.random.normal(k[0], (B, S, 2, F), jnp.bfloat16)
    w = jax.random.normal(k[1], (F, D), jnp.bfloat16)

    def halves(pre, w):
        return (swiglu(pre[..., 0, :], pre[..., 1, :]) @ w).astype(jnp.float32).sum()

    def fused(pre, w):
        return (swiglu_halves(pre) @ w).astype(jnp.float32).sum()

    assert [s for _, s in _kept(halves, pre, w) if s[:2] == (B, S)] == [(B, S, F)] * 3
    assert [s for _, s in _kept(fused, pre, w) if s[:2] == (B, S)] == [
        (B, S, 2, F), (B, S, F)]
    (v1, g1), (v2, g2) = (jax.value_and_grad(f, (0, 1))(pre, w) for f in (halves, fused))
    assert v1 == v2
    for a, b in zip(g1, g2, strict=True):
        assert a.dtype == b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_loss_keeps_the_logits_and_one_number_a_token(dtype):
    """The unfused cross-entropy keeps the logits in their dtype and a float32
    log-sum-exp a token (before: three float32 and two boolean arrays of the logits'
    size); over a padded vocabulary its value and gradient equal optax's on the real
    ids."""
    dt = jnp.dtype(dtype)
    vocab = 37
    logits = jax.random.normal(jax.random.key(0), (B, S, V), dt) * 3
    t = jax.random.randint(jax.random.key(1), (B, S), 0, vocab)
    kept = _kept(lambda z: cross_entropy(z, t, vocab), logits)
    assert kept == sorted([(dtype, (B, S, V)), ("float32", (B, S)), ("int32", (B, S))]), kept
    before = _kept(lambda z: jnp.mean(_per_token(z, t, vocab)[0]), logits)
    assert sum(shape == (B, S, V) for _, shape in before) >= 5, before

    def reference(z):
        return optax.softmax_cross_entropy_with_integer_labels(
            z[..., :vocab].astype(jnp.float32), t).mean()

    (got, g), (want, gw) = (jax.value_and_grad(f)(logits)
                            for f in (lambda z: cross_entropy(z, t, vocab), reference))
    tol = 1e-6 if dtype == "float32" else 1e-2
    np.testing.assert_allclose(got, want, rtol=tol)
    assert g.dtype == dt and not np.asarray(g[..., vocab:], np.float32).any()
    np.testing.assert_allclose(np.asarray(g[..., :vocab], np.float32),
                               np.asarray(gw[..., :vocab], np.float32), atol=tol / (B * S))


def test_a_llama_layer_keeps_no_float32_copy_of_the_residual_stream():
    """Through the whole model (a 2-layer Llama, unrolled): no float32 array of the
    residual stream's size is kept, and of the MLP's a layer keeps its fused gate and up
    product's output [tokens, 2, d_ff] and the activation [tokens, d_ff], no more."""
    from plait.tasks.gpt import GPTTask

    exp = tiny(model={"kind": "llama", "kv_heads": 2, "d_ff": 96, "scan_layers": False},
               precision={"compute": "bfloat16"})
    task = GPTTask(exp, make_mesh("data=1"))
    params = task.layout.shapes["params"]
    b = task.abstract_batch()
    kept = _kept(task.loss, params, jax.ShapeDtypeStruct(b.shape[1:], b.dtype))
    rows, seq = exp.train.global_batch, exp.model.seq_len
    stream = [k for k in kept if k[1] == (rows, seq, exp.model.d_model)]
    assert stream and all(dt == "bfloat16" for dt, _ in stream), stream
    assert len([k for k in kept if k[1] == (rows, seq, 96)]) == exp.model.layers
    assert len([k for k in kept if k[1] == (rows, seq, 2, 96)]) == exp.model.layers


@pytest.mark.parametrize("kind", ["rmsnorm", "layernorm"])
def test_the_split_backward_recomputes_cheap_values_in_w_rather_than_hand_them_over(kind):
    """ZB-H1's W half reads a norm's normalised input for the scale's gradient, and
    the gradient at the norm's output in float32 for the scale's and the bias's. Bx
    made the first from the residuals (input and statistics) by elementwise steps, the
    second by a cast of its bf16 gradient; W computes them again rather than receive
    them in the frontier, which is held from Bx to W: the frontier is bf16 only. The
    halves' gradients equal the whole backward's."""
    from plait.models.norms import _KEEP_STATS, _layer_norm
    from plait.parallel.split_backward import LayerGrad

    def norm(p, h):
        if kind == "rmsnorm":
            return rms(h, P(p["scale"]), 1e-5)
        return jax.checkpoint(_layer_norm, policy=_KEEP_STATS, static_argnums=(3,))(
            h, p["scale"], p["bias"], 1e-5)

    def layer(p, h):
        return h + norm(p, h) @ p["w"]

    k = jax.random.split(jax.random.key(0), 5)
    p = {"scale": jax.random.normal(k[0], (D,), jnp.bfloat16),
         "bias": jax.random.normal(k[4], (D,), jnp.bfloat16),
         "w": jax.random.normal(k[1], (D, D), jnp.bfloat16)}
    h = jax.random.normal(k[2], (B, S, D), jnp.bfloat16)
    lg = LayerGrad(layer, p, h)
    frontier = [(str(a.dtype), a.shape) for a in lg.examples()["frontier"]]
    assert frontier and all(dt == "bfloat16" for dt, _ in frontier), frontier
    _, stashed = lg.forward(p, h)
    g = jax.random.normal(k[3], (B, S, D), jnp.bfloat16)
    whole_p, whole_h = lg.backward(p, stashed, g)
    by = dict(zip(lg.stashed, stashed, strict=True))
    dh, front = lg.backward_input(p, [by[i] for i in lg.res_b], [by[i] for i in lg.res_w], g)
    dp = lg.backward_weight(p, [by[i] for i in lg.res_w], front)
    np.testing.assert_array_equal(np.asarray(dh, np.float32), np.asarray(whole_h, np.float32))
    for name in p:
        np.testing.assert_array_equal(np.asarray(dp[name], np.float32),
                                      np.asarray(whole_p[name], np.float32))
