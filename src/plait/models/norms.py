"""The decoder's norms: LayerNorm (GPT-2) and RMSNorm (Llama), statistics in float32
whatever the compute dtype; `rms` also serves q/k norms over several axes (OLMoE)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from plait.config import GPTConfig
from plait.models.keys import ParamKeys
from plait.models.params import param as _param


def rms(x: jax.Array, scale: nnx.Param, eps: float, axes: tuple[int, ...] = (-1,)
        ) -> jax.Array:
    """x over its root mean square along `axes` (statistics in float32), then the scale
    applied in the compute dtype after the cast back, as Llama's reference code does."""
    dtype = x.dtype
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.square(x32).mean(axes, keepdims=True) + eps)
    return y.astype(dtype) * scale[...].astype(dtype)


class LayerNorm(nnx.Module):
    """LayerNorm with statistics in float32 whatever the compute dtype (a bias unless the
    model has none)."""

    def __init__(self, d: int, eps: float, rngs: ParamKeys, bias: bool = True):
        self.scale = _param(rngs, (d,), ("norm",), None)
        if bias:
            self.bias = _param(rngs, (d,), ("norm",), 0.0)
        self.eps = eps

    def __call__(self, x):
        dtype = x.dtype
        x = x.astype(jnp.float32)
        mean = x.mean(-1, keepdims=True)
        var = jnp.square(x - mean).mean(-1, keepdims=True)
        y = (x - mean) * jax.lax.rsqrt(var + self.eps) * self.scale[...].astype(jnp.float32)
        if hasattr(self, "bias"):
            y = y + self.bias[...].astype(jnp.float32)
        return y.astype(dtype)


class RMSNorm(nnx.Module):
    """Root-mean-square norm (Llama)."""

    def __init__(self, d: int, eps: float, rngs: ParamKeys, bias: bool = False):
        del bias  # an RMS norm has none
        self.scale = _param(rngs, (d,), ("norm",), None)
        self.eps = eps

    def __call__(self, x):
        return rms(x, self.scale, self.eps)


def norm(cfg: GPTConfig, rngs: ParamKeys) -> LayerNorm | RMSNorm:
    cls = RMSNorm if cfg.norm == "rmsnorm" else LayerNorm
    return cls(cfg.d_model, cfg.norm_eps, rngs, bias=cfg.bias)
