"""The one way the decoder's modules make a parameter: logical axis names and the
dimensions a matmul contracts (`fan_in`) ride along as metadata for plait.sharding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from plait.models.keys import ParamKeys


def param(rngs: ParamKeys, shape, logical, std: float | None, fan_in=(),
          used: tuple[int, ...] | None = None, keep_float32: bool = False) -> nnx.Param:
    """A parameter of `shape`; with `used`, only that leading block is drawn and the rest
    (vocabulary padding) is zeros, so the values do not depend on the padding."""
    if std is None:  # ones (norm scales)
        value = jnp.ones(shape, jnp.float32)
    elif std == 0.0:
        value = jnp.zeros(shape, jnp.float32)
    else:
        value = std * jax.random.normal(rngs.params(), used or shape, jnp.float32)
        value = jnp.pad(value, [(0, full - u) for full, u in zip(shape, value.shape,
                                                                   strict=True)])
    extra = {"keep_float32": True} if keep_float32 else {}
    return nnx.Param(value, logical_axes=tuple(logical), fan_in=tuple(fan_in), **extra)
