"""DLRM's dense part in Flax NNX: bottom MLP, interaction, top MLP (Naumov et al. 2019).

The embedding tables are not here: they are sharded and updated sparsely by
`plait.parallel.embedding`, and reach this module as pooled bags [B, T, d].
Interaction: the dot products of every pair (i > j) of the T + 1 vectors
(bottom output and the bags), concatenated with the bottom output; or, with
`cross_layers` > 0, DCNv2 full-rank cross layers over their concatenation
(the MLPerf model). Parameters carry logical names no rule maps, so the MLPs
are data parallel.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from plait.config import DLRMConfig
from plait.models.keys import ParamKeys


def _linear(keys: ParamKeys, n_in: int, n_out: int) -> tuple[nnx.Param, nnx.Param]:
    # The reference's init: N(0, sqrt(2 / (in + out))) weights, N(0, sqrt(1 / out)) biases.
    w = math.sqrt(2.0 / (n_in + n_out)) * jax.random.normal(keys.params(), (n_in, n_out))
    b = math.sqrt(1.0 / n_out) * jax.random.normal(keys.params(), (n_out,))
    return (nnx.Param(w, logical_axes=("dlrm_in", "dlrm_out"), fan_in=("dlrm_in",)),
            nnx.Param(b, logical_axes=("dlrm_out",), fan_in=()))


class MLP(nnx.Module):
    def __init__(self, widths: list[int], keys: ParamKeys, last_relu: bool):
        self.layers = nnx.List([nnx.List(_linear(keys, a, b))
                                for a, b in zip(widths[:-1], widths[1:], strict=True)])
        self.last_relu = last_relu

    def __call__(self, x):
        for i, (w, b) in enumerate(self.layers):
            x = x @ w[...].astype(x.dtype) + b[...].astype(x.dtype)
            if i < len(self.layers) - 1 or self.last_relu:
                x = jax.nn.relu(x)
        return x


class Cross(nnx.Module):
    """DCNv2 cross layer: x_{l+1} = x0 * (W x_l + b) + x_l."""

    def __init__(self, n: int, keys: ParamKeys):
        self.w, self.b = _linear(keys, n, n)

    def __call__(self, x0, x):
        return x0 * (x @ self.w[...].astype(x.dtype) + self.b[...].astype(x.dtype)) + x


class DLRM(nnx.Module):
    def __init__(self, cfg: DLRMConfig, keys: ParamKeys):
        d, T = cfg.embedding_dim, len(cfg.embedding_rows)
        self.bottom = MLP([cfg.dense_features, *cfg.bottom_mlp], keys, last_relu=True)
        if cfg.cross_layers:
            n = (T + 1) * d
            self.cross = nnx.List([Cross(n, keys) for _ in range(cfg.cross_layers)])
            top_in = n
        else:
            self.cross = nnx.List([])
            top_in = d + (T + 1) * T // 2
        self.top = MLP([top_in, *cfg.top_mlp], keys, last_relu=False)
        self.vectors = T + 1

    def __call__(self, dense: jax.Array, bags: jax.Array) -> jax.Array:
        """dense [B, F], bags [B, T, d] -> logits [B]."""
        x = self.bottom(dense.astype(bags.dtype))
        z = jnp.concatenate([x[:, None, :], bags], axis=1)  # [B, T + 1, d]
        if len(self.cross):
            x0 = z.reshape(z.shape[0], -1)
            h = x0
            for layer in self.cross:
                h = layer(x0, h)
            top_in = h
        else:
            dots = jnp.einsum("bid,bjd->bij", z, z)
            flat = dots.reshape(dots.shape[0], -1)[:, np.asarray(_lower_pairs(self.vectors))]
            top_in = jnp.concatenate([x, flat], axis=1)
        return self.top(top_in)[:, 0].astype(jnp.float32)


def _lower_pairs(n: int):
    """Flat indices of the pairs i > j of an n x n matrix (the reference's order)."""
    return [i * n + j for i in range(n) for j in range(i)]


def bce_with_logits(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean binary cross-entropy from logits: softplus(x) - x y, stable for large |x|, and
    its derivative sigmoid(x) - y is right everywhere (the max(x, 0) + log1p(exp(-|x|))
    form gives -1 instead of -0.5 at x = 0, from JAX's subgradients of max and abs)."""
    labels = labels.astype(jnp.float32)
    return jnp.mean(jax.nn.softplus(logits) - logits * labels)
