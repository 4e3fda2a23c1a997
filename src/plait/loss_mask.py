"""What the token batch carries besides ids: targets the loss leaves out, and where
documents start.

A token file's loss mask (data.tokens: a prompt's tokens when fine-tuning on
its response) reaches the step as ~id (a negative number) in the int32 token
batch, and with data.document_mask each token that starts a document has bit
DOC_START set, so every path a batch takes (microbatches, context and data
splits) carries them with no second array. `kept_targets(batch)` sets, for the
step being traced, the scale that makes each piece's loss (models.loss) part of
the mean over the kept targets of the whole batch; `flagged()` says the ids may
carry DOC_START; `token_ids` gives the model its ids back; `documents(segments,
positions)` gives attention each token's document and learned position embeddings
each token's place in it (parallel.context). Outside them nothing of this is
traced.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
import jax.numpy as jnp

DOC_START = 1 << 30  # the bit of a token that starts a document (ids stay below it)

# (targets / kept targets) of the batch being traced; None: every target counts.
_SCALE: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar("kept_scale",
                                                                          default=None)


@contextlib.contextmanager
def _setting(var: contextvars.ContextVar, value) -> Iterator[None]:
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def kept_count(batch: jax.Array) -> jax.Array:
    """How many targets of a token batch [..., seq + 1] the loss keeps (those not stored as
    ~id), an int32 scalar."""
    return jnp.sum(batch[..., 1:] >= 0, dtype=jnp.int32)


def kept_targets(batch: jax.Array) -> contextlib.AbstractContextManager:
    """Within: the loss of any piece of `batch` leaves out its targets stored as ~id and is
    normalized by the kept targets of the whole of `batch` (the module docstring). A
    batch that keeps none counts as one kept, so its loss and gradients are 0, not NaN."""
    kept = jnp.maximum(kept_count(batch), 1).astype(jnp.float32)
    return _setting(_SCALE, jnp.float32(batch[..., 1:].size) / kept)


def kept_scale() -> jax.Array | None:
    """(targets / kept targets) of the batch being traced inside `kept_targets`, else
    None: every target counts, and nothing of this is traced."""
    return _SCALE.get()


_FLAGGED: contextvars.ContextVar[bool] = contextvars.ContextVar("flagged", default=False)
# Each stored token's document [rows, seq] in the attention being traced; None: one causal
# mask over the whole row.
_SEGMENTS: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar(
    "segments", default=None)
# Each stored token's position within its document [rows, seq]; None: its place in the row.
_POSITIONS: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar(
    "document_positions", default=None)


def flagged() -> contextlib.AbstractContextManager:
    """Within: the batch's ids may carry DOC_START (data.document_mask)."""
    return _setting(_FLAGGED, True)


@contextlib.contextmanager
def documents(segments: jax.Array | None, positions: jax.Array | None = None
              ) -> Iterator[None]:
    """Within: attention keeps each token to the earlier tokens of its own document
    (segments [rows, seq], in the order the model stores a sequence), and learned
    position embeddings read each token's position within its document (positions
    [rows, seq]; None: its place in the row); None: no change."""
    with _setting(_SEGMENTS, segments), _setting(_POSITIONS, positions):
        yield


def segments() -> jax.Array | None:
    return _SEGMENTS.get()


def document_positions() -> jax.Array | None:
    return _POSITIONS.get()


def _unmasked(tokens: jax.Array) -> jax.Array:
    """Tokens with ~id undone (the DOC_START bit, if any, kept)."""
    return jnp.where(tokens < 0, ~tokens, tokens)


def starts(tokens: jax.Array) -> jax.Array:
    """Whether each token starts a document (inside `flagged`; else all False)."""
    if not _FLAGGED.get():
        return jnp.zeros(tokens.shape, bool)
    return (_unmasked(tokens) & DOC_START) != 0


def token_ids(tokens: jax.Array) -> jax.Array:
    """The ids of tokens as the model reads them: ~id undone inside `kept_targets`, the
    DOC_START bit cleared inside `flagged`."""
    if _FLAGGED.get():
        return _unmasked(tokens) & (DOC_START - 1)
    return tokens if _SCALE.get() is None else _unmasked(tokens)
