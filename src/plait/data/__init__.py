"""Deterministic data: the global batch of step k is a pure function of (source, seed, k).

A batch is laid out [microbatches, rows per microbatch, seq_len + 1] and
sharded over the batch axes of the mesh; `global_batch` builds it with
`jax.make_array_from_callback`, so each process generates only the rows its
devices hold.
"""

from __future__ import annotations

from typing import Protocol

import jax
import numpy as np
from jax.sharding import NamedSharding

from plait.config import Experiment
from plait.data.synthetic import SyntheticTokens
from plait.data.tokens import TokenFile
from plait.errors import UserError


class Source(Protocol):
    def rows(self, step: int, start: int, stop: int) -> np.ndarray: ...


def make_source(exp: Experiment) -> Source:
    m, d = exp.model, exp.data
    if m.kind == "dlrm":
        if d.source == "clicks":
            from plait.data.clicks import SyntheticClicks

            return SyntheticClicks(m.table_rows, m.dense_features, d.ids_per_lookup,
                                   d.ids_fixed, d.popularity, d.powerlaw_alpha, exp.seed)
        if d.source == "criteo":
            from plait.data.criteo import CriteoTSV

            return CriteoTSV(d.path or "", m.table_rows, exp.train.global_batch, d.malformed)
        raise UserError(f"data.source = \"{d.source}\" is for GPT models; a DLRM reads "
                        "\"clicks\" (synthetic) or \"criteo\" (TSV)")
    if d.source in ("clicks", "criteo"):
        raise UserError(f"data.source = \"{d.source}\" is for DLRM models (model.kind = "
                        "\"dlrm\"); a GPT reads \"synthetic\" or \"tokens\"")
    if d.source == "synthetic":
        return SyntheticTokens(m.vocab, m.seq_len, exp.seed, d.successors)
    return TokenFile(d.path or "", d.dtype, m.seq_len, exp.seed, m.vocab)


def batch_shape(exp: Experiment) -> tuple[int, int, int]:
    t = exp.train
    return (t.microbatches, t.global_batch // t.microbatches, exp.model.seq_len + 1)


def global_batch(source: Source, step: int, shape: tuple[int, int, int],
                 sharding: NamedSharding) -> jax.Array:
    """The batch of `step` as one global array; only local shards are generated."""
    per_micro = shape[1]
    cache: dict[tuple, np.ndarray] = {}

    def shard(index: tuple[slice, ...]) -> np.ndarray:
        mb = range(shape[0])[index[0]]
        rows = range(per_micro)[index[1]]
        key = (mb.start, mb.stop, rows.start, rows.stop)
        if key not in cache:
            cache[key] = np.stack([
                source.rows(step, m * per_micro + rows.start, m * per_micro + rows.stop)
                for m in mb
            ])[(slice(None), slice(None), index[2])]
        return cache[key]

    return jax.make_array_from_callback(shape, sharding, shard)


def global_dict_batch(source, step: int, shapes: dict, shardings: dict) -> dict:
    """A batch of named arrays split over their first (sample) dimension; each process
    generates only the samples its devices hold (each shard once for all names)."""
    cache: dict[tuple, dict] = {}

    def field(name: str):
        def shard(index: tuple[slice, ...]) -> np.ndarray:
            rows = range(shapes[name][0][0])[index[0]]
            key = (rows.start, rows.stop)
            if key not in cache:
                cache[key] = source.rows(step, rows.start, rows.stop)
            return cache[key][name][(slice(None), *index[1:])]
        return shard

    return {name: jax.make_array_from_callback(shape, shardings[name], field(name))
            for name, (shape, _) in shapes.items()}
