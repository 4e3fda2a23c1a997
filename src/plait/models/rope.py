"""Rotary position embeddings (Llama's): what they need of the config, the angle per
position step of each feature pair (with Llama 3.1's long-wavelength scaling), and the
rotation of q and k."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from plait.config import GPTConfig

Rope = tuple[int, float, tuple[float, float, float, int] | None]  # head, theta, scaling


def rope_of(cfg: GPTConfig) -> Rope | None:
    """What rotary positions need of the config (hashable: it lives in the module graph)."""
    if cfg.position != "rope":
        return None
    sc = cfg.rope_scaling
    scaling = None if sc is None else (sc.factor, sc.low_freq_factor, sc.high_freq_factor,
                                       sc.original_context)
    return cfg.head_size, cfg.rope_theta, scaling


@functools.lru_cache(maxsize=16)
def rope_frequencies(rope: Rope) -> np.ndarray:
    """The rotary angle per position step of each pair of a head's features [head/2]
    (float32, as Llama's reference computes it), with Llama 3.1's scaling of the long
    wavelengths when the model has it."""
    hd, theta, scaling = rope
    inv = (1.0 / (np.float32(theta) ** (np.arange(0, hd, 2).astype(np.float32) / hd))
           ).astype(np.float32)
    if scaling is None:
        return inv
    factor, low_f, high_f, context = scaling
    wavelength = 2 * math.pi / inv
    low, high = context / low_f, context / high_f
    scaled = np.where(wavelength > low, inv / factor, inv)
    smooth = (context / wavelength - low_f) / (high_f - low_f)
    between = (1 - smooth) * scaled / factor + smooth * scaled
    middle = (wavelength >= high) & (wavelength <= low)
    return np.where(middle, between, scaled).astype(np.float32)


def rotate(x: jax.Array, positions: jax.Array, rope: Rope) -> jax.Array:
    """Rotary position embedding of x [batch, T, heads, head] at positions [T]: the two
    halves of each head rotated as pairs (Hugging Face's layout of Llama weights)."""
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(rope_frequencies(rope))[None]
    cos, sin = (f(angles)[None, :, None, :] for f in (jnp.cos, jnp.sin))
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)
