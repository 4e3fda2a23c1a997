"""The MLPs' activations, recomputed in the backward from their input instead of kept.

Autodiff keeps every intermediate an elementwise function's gradient reads: for
SwiGLU silu(g) * u that is the gate and up halves, the sigmoid, silu(g) and more,
six [tokens, d_ff] arrays a layer in jax.ad_checkpoint's account of llama3.2-1b
(docs/architecture.md, "What a layer keeps for the backward"); for GPT-2's tanh GELU
six as well. Under `jax.checkpoint` only the input is kept (and the output, which the next
matmul's weight gradient reads) and the rest is recomputed from it in the backward:
a few elementwise operations per element, no matmul, no collective. Whether a
compiler would have fused the intermediates away is then not left to it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _silu_times(gate: jax.Array, up: jax.Array) -> jax.Array:
    return jax.nn.silu(gate) * up


@jax.checkpoint
def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) * up (Llama's MLP; `parallel.experts`' too)."""
    return _silu_times(gate, up)


@jax.custom_vjp
def swiglu_halves(pre: jax.Array) -> jax.Array:
    """swiglu of pre [..., 2, f], its gate and up halves side by side as one fused
    [d, 2, f] projection writes them (Llama's MLP, the experts' bulk).

    What the backward keeps is `pre` itself, the product's output. Handed the halves
    as two arrays, the checkpoint above keeps those: on a GPU the forward's fusion then
    writes both halves out beside the activation (pre[..., 0, :] is not a contiguous
    piece of pre), a copy of the whole product's output every layer, 2.5% of
    mixtral-mini's step compiled for an H100 (docs/architecture.md, "SwiGLU's halves").
    The gradient is swiglu's own (the same operations as the checkpoint's
    recomputation), written as one [..., 2, f] array."""
    return _silu_times(pre[..., 0, :], pre[..., 1, :])


def _swiglu_halves_fwd(pre: jax.Array):
    return swiglu_halves(pre), pre


def _swiglu_halves_bwd(pre: jax.Array, dh: jax.Array):
    _, pull = jax.vjp(_silu_times, pre[..., 0, :], pre[..., 1, :])
    return (jnp.stack(pull(dh), axis=-2),)


swiglu_halves.defvjp(_swiglu_halves_fwd, _swiglu_halves_bwd)


@jax.checkpoint
def gelu(h: jax.Array) -> jax.Array:
    """GPT-2's GELU (the tanh approximation)."""
    return jax.nn.gelu(h, approximate=True)
