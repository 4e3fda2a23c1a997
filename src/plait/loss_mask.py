"""Targets the loss leaves out, carried in the token batch itself.

A token file's loss mask (data.tokens: a prompt's tokens when fine-tuning on
its response) reaches the step as ~id (a negative number) in the int32 token
batch, so every path a batch takes (microbatches, pipeline stages, context and
data splits) carries it with no second array. `kept_targets(batch)` sets, for
the step being traced, the scale that makes each piece's loss (models.loss)
part of the mean over the kept targets of the whole batch; `token_ids` gives the
model its input ids back. Outside `kept_targets` nothing of this is traced.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
import jax.numpy as jnp

# (targets / kept targets) of the batch being traced; None: every target counts.
_SCALE: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar("kept_scale",
                                                                          default=None)


def _kept_and_all(batch: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(kept targets, all targets) of a token batch [..., seq + 1] whose left-out targets
    are stored as ~id, as float32 scalars (a batch that keeps none counts as one kept, so
    its loss and gradients are 0, not NaN)."""
    kept = jnp.sum(batch[..., 1:] >= 0, dtype=jnp.int32)
    return jnp.maximum(kept, 1).astype(jnp.float32), jnp.float32(batch[..., 1:].size)


@contextlib.contextmanager
def kept_targets(batch: jax.Array) -> Iterator[None]:
    """Within: the loss of any piece of `batch` leaves out its targets stored as ~id and is
    normalized by the kept targets of the whole of `batch` (the module docstring)."""
    kept, total = _kept_and_all(batch)
    token = _SCALE.set(total / kept)
    try:
        yield
    finally:
        _SCALE.reset(token)


def kept_scale() -> jax.Array | None:
    """(targets / kept targets) of the batch being traced inside `kept_targets`, else
    None: every target counts, and nothing of this is traced."""
    return _SCALE.get()


def token_ids(tokens: jax.Array) -> jax.Array:
    """The ids of tokens as the model reads them: ~id undone inside `kept_targets`."""
    return tokens if _SCALE.get() is None else jnp.where(tokens < 0, ~tokens, tokens)
