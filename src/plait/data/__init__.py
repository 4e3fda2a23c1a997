"""Deterministic data: the global batch of step k is a pure function of (source, seed, k).

A batch is laid out [microbatches, rows per microbatch, seq_len + 1] and
sharded over the batch axes of the mesh; `global_batch` builds it with
`jax.make_array_from_callback`, so each process generates only the rows its
devices hold. Sources (`rows(step, start, stop)`) are made by each task
(`Task.source`).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding


def global_batch(source, step: int, shape: tuple[int, int, int],
                 sharding: NamedSharding, replicas: int = 1) -> jax.Array:
    """The batch of `step` as one global array; only local shards are generated.

    Row i of microbatch m is sample m * rows + i, except where `replicas` data replicas
    train apart (local SGD): then each replica's rows of every microbatch come from its
    own contiguous block of the global batch, so a replica trains on the same samples
    whatever train.microbatches is (as it does with one microbatch)."""
    n_micro, per_micro = shape[0], shape[1]
    q = per_micro // replicas  # rows of one replica in one microbatch
    cache: dict[tuple, np.ndarray] = {}

    def samples(m: int, start: int, stop: int) -> np.ndarray:
        pieces, i = [], start
        while i < stop:
            r, end = i // q, min(stop, (i // q + 1) * q)
            first = r * n_micro * q + m * q + i % q
            pieces.append(source.rows(step, first, first + end - i))
            i = end
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def shard(index: tuple[slice, ...]) -> np.ndarray:
        mb = range(n_micro)[index[0]]
        rows = range(per_micro)[index[1]]
        key = (mb.start, mb.stop, rows.start, rows.stop)
        if key not in cache:
            cache[key] = np.stack([samples(m, rows.start, rows.stop) for m in mb]
                                  )[(slice(None), slice(None), index[2])]
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
