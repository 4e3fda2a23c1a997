"""The router's auxiliary losses (load balancing, z-loss) add their gradients where they
are computed, inside each mixture-of-experts layer (in a pipeline stage's backward too),
instead of travelling to the loss: the returned language-model loss stays what every
mesh computes, and the auxiliary values are reported beside it. The cotangent of an
auxiliary term is the scale of the loss it joins: 1 for one microbatch's loss,
1 / microbatches in a pipeline, whose stages see each microbatch's gradient already
divided."""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp

_AUX_SCALE: contextvars.ContextVar[float] = contextvars.ContextVar("aux_scale", default=1.0)


@contextlib.contextmanager
def aux_scale(scale: float) -> Iterator[None]:
    token = _AUX_SCALE.set(scale)
    try:
        yield
    finally:
        _AUX_SCALE.reset(token)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _attach(x: jax.Array, aux: jax.Array, scale: float) -> jax.Array:
    return x


def _attach_fwd(x, aux, scale):
    return x, aux


def _attach_bwd(scale, aux, g):
    return g, jnp.full_like(aux, scale)


_attach.defvjp(_attach_fwd, _attach_bwd)


def add_aux_gradient(x: jax.Array, aux: jax.Array) -> jax.Array:
    """x unchanged; in the backward, `aux` (a scalar term of the loss) gets its gradient."""
    return _attach(x, aux, _AUX_SCALE.get())
