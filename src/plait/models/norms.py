"""The decoder's norms: LayerNorm (GPT-2) and RMSNorm (Llama), statistics in float32
whatever the compute dtype; `rms` also serves q/k norms over several axes (OLMoE)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from plait.config import GPTConfig
from plait.models.keys import ParamKeys
from plait.models.params import param as _param
from plait.parallel import norm_kernel
from plait.sharding import splits

# A norm keeps for the backward its input and its per-token statistics (two or three
# float32 numbers a token, named here), and recomputes the float32 copies, the
# normalised values and the casts from them: autodiff kept three float32 and two
# compute-dtype arrays of the input's size a norm (docs/architecture.md, "What a layer
# keeps for the backward"). The statistics are kept, not recomputed, so the backward
# repeats no reduction, which over a split embedding would be a collective.
STATS = "norm_stats"
_KEEP_STATS = jax.checkpoint_policies.save_only_these_names(STATS)


def _rms(x: jax.Array, scale: jax.Array, eps: float, axes: tuple[int, ...]) -> jax.Array:
    dtype = x.dtype
    x32 = x.astype(jnp.float32)
    # rsqrt's derivative reads its input too: both kept, or the backward sums again
    ms = checkpoint_name(jnp.square(x32).mean(axes, keepdims=True) + eps, STATS)
    r = checkpoint_name(jax.lax.rsqrt(ms), STATS)
    return (x32 * r).astype(dtype) * scale.astype(dtype)


def rms(x: jax.Array, scale: nnx.Param, eps: float, axes: tuple[int, ...] = (-1,)
        ) -> jax.Array:
    """x over its root mean square along `axes` (statistics in float32), then the scale
    applied in the compute dtype after the cast back, as Llama's reference code does."""
    return jax.checkpoint(_rms, policy=_KEEP_STATS, static_argnums=(2, 3))(
        x, scale[...], eps, tuple(axes))


def _layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array | None, eps: float
                ) -> jax.Array:
    dtype = x.dtype
    x = x.astype(jnp.float32)
    if splits("act_embed"):
        # split across devices: jax's two passes (the variance's sum needs the mean's)
        mean = checkpoint_name(x.mean(-1, keepdims=True), STATS)
        var = checkpoint_name(jnp.square(x - mean).mean(-1, keepdims=True) + eps, STATS)
    else:
        mean, var = _moments_one_pass(x, eps)
    r = checkpoint_name(jax.lax.rsqrt(var), STATS)
    y = (x - mean) * r * scale.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(dtype)


def _moments_one_pass(x: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
    """(mean, variance + eps) of x over its last axis from one reduction of x (the
    two-pass form read x again for the variance and its backward a third time:
    gpt2-1.3b compiled for an H100, 257 row reductions a step forward, not 129)."""
    mean, var = _moments(x)
    return mean, checkpoint_name(var + eps, STATS)


@jax.custom_jvp
def _moments(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(mean, variance) over the last axis, keepdims, in one reduction: the sums of d = x
    - c and of d^2, c the row's first value, variance = mean(d^2) - mean(d)^2. The shift
    keeps the subtraction exact where mean(x^2) - mean(x)^2 is not (a mean 1e4 times the
    spread: tests/test_residuals.py). Its derivative, the moments' own, reads x and the
    mean only: autodiff of the shifted sums would keep the shift too, or sum again."""
    c = x[..., :1]
    d = x - c
    shift = d.mean(-1, keepdims=True)
    var = jnp.maximum(jnp.square(d).mean(-1, keepdims=True) - jnp.square(shift), 0.0)
    return c + shift, var


@_moments.defjvp
def _moments_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    mean, var = _moments(x)
    mean = checkpoint_name(mean, STATS)  # the value the tangents read, kept
    return (mean, var), (dx.mean(-1, keepdims=True),
                         2 * ((x - mean) * dx).mean(-1, keepdims=True))


class LayerNorm(nnx.Module):
    """LayerNorm with statistics in float32 whatever the compute dtype (a bias unless the
    model has none). kernel "pallas" (model.norm_kernel): parallel.norm_kernel's one
    pass each way where it can run (`kernel_here`)."""

    def __init__(self, d: int, eps: float, rngs: ParamKeys, bias: bool = True,
                 kernel: str = "xla"):
        self.scale = _param(rngs, (d,), ("norm",), None, keep_float32=True)
        if bias:
            self.bias = _param(rngs, (d,), ("norm",), 0.0, keep_float32=True)
        self.eps = eps
        self.kernel = kernel

    def kernel_here(self) -> bool:
        """Whether the kernel runs in this trace: asked for, the embedding whole on each
        device (the statistics need no sum across devices), not in a pipeline's body."""
        return self.kernel == "pallas" and not splits("act_embed") and norm_kernel.usable()

    def _bias_or_zeros(self) -> jax.Array:
        return self.bias[...] if hasattr(self, "bias") else jnp.zeros_like(self.scale[...])

    def __call__(self, x):
        if self.kernel_here():
            return norm_kernel.layer_norm(x, self.scale[...], self._bias_or_zeros(), self.eps)
        bias = self.bias[...] if hasattr(self, "bias") else None
        return jax.checkpoint(_layer_norm, policy=_KEEP_STATS, static_argnums=(3,))(
            x, self.scale[...], bias, self.eps)

    def after_add(self, x: jax.Array, h: jax.Array, h_bias: jax.Array | float
                  ) -> tuple[jax.Array, jax.Array]:
        """(s, self(s)) for s = x + h + h_bias (a residual add of a projection's output h
        and its bias) in one kernel; for where `kernel_here` (elsewhere the model adds
        the bias to h first, as its products do, and then the residual)."""
        scale = self.scale[...]
        hb = jnp.broadcast_to(jnp.asarray(h_bias, h.dtype), scale.shape)
        return norm_kernel.add_layer_norm(x, h, hb, scale, self._bias_or_zeros(), self.eps)


class RMSNorm(nnx.Module):
    """Root-mean-square norm (Llama)."""

    def __init__(self, d: int, eps: float, rngs: ParamKeys, bias: bool = False,
                 kernel: str = "xla"):
        del bias, kernel  # an RMS norm has no bias, and no kernel yet
        self.scale = _param(rngs, (d,), ("norm",), None)
        self.eps = eps

    def __call__(self, x):
        return rms(x, self.scale, self.eps)

    def kernel_here(self) -> bool:
        return False


def norm(cfg: GPTConfig, rngs: ParamKeys) -> LayerNorm | RMSNorm:
    cls = RMSNorm if cfg.norm == "rmsnorm" else LayerNorm
    return cls(cfg.d_model, cfg.norm_eps, rngs, bias=cfg.bias, kernel=cfg.norm_kernel)
