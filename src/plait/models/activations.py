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


@jax.checkpoint
def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) * up (Llama's MLP; `parallel.experts`' too)."""
    return jax.nn.silu(gate) * up


@jax.checkpoint
def gelu(h: jax.Array) -> jax.Array:
    """GPT-2's GELU (the tanh approximation)."""
    return jax.nn.gelu(h, approximate=True)
