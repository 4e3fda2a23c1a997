"""Synthetic click logs for DLRM: learnable, deterministic by (seed, step, row), made on
the devices.

Each sample has dense features U[0, 1) (in steps of 2^-16), one bag of ids per table (uniform or
power-law popularity; fixed or variable bag size, -1 pads) and a click label
drawn from a fixed logistic "teacher": a linear function of the dense features
plus, per table, the mean of a hashed score of the ids in the bag. A model
that learns the teacher's weights and the ids' scores beats AUC 0.5 clearly.

Sample r of step k is a pure function of jax.random's key
fold_in(fold_in(key(seed), k), r) (one threefry word, then a counter-based
integer hash for each draw), so a batch is one jitted program whose
output is sharded like the step's input: each device makes only its rows, in
microseconds, and no batch crosses the host. Every reduction inside a sample
runs in a fixed order (integer sums, an unrolled dot), so the numbers are the
same on any mesh and any number of processes (tests/test_data.py): dense
features are k / 2^16 and the teacher's weights quarters, so its dense logit
is an integer sum. Making a
2048-sample dlrm-bench batch this way takes milliseconds where the per-row
numpy generator it replaced took ~480 ms (docs/benchmarks.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

_SPREAD = 2654435761  # Knuth's multiplicative hash: popular ids spread over the table


def _mix(x: jax.Array) -> jax.Array:
    """A 32-bit integer hash with good avalanche (Wellons' lowbias32)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def _stream(word: jax.Array, stream: int, shape: tuple[int, ...]) -> jax.Array:
    """uint32 draws [shape] of one sample: its word hashed with a counter per element,
    the stream keeping dense features, ids, lengths and the label apart."""
    counter = jnp.arange(int(np.prod(shape)), dtype=jnp.uint32).reshape(shape)
    offset = jnp.uint32((stream * 0x632BE5AB) & 0xFFFFFFFF)
    return _mix(word + counter * jnp.uint32(0x9E3779B9) + offset)


def _id_score(ids: jax.Array, table: int) -> jax.Array:
    """A fixed pseudo-random integer score in [-2^15, 2^15) per (table, id)."""
    h = ids.astype(jnp.uint32) * jnp.uint32(0x9E3779B1) + jnp.uint32(
        (table * 0x85EBCA6B + 1) & 0xFFFFFFFF)
    h = h ^ (h >> 15)
    h = h * jnp.uint32(0x2C1B3C6D)
    return (h >> 16).astype(jnp.int32) - (1 << 15)


class SyntheticClicks:
    def __init__(self, rows: list[int], dense_features: int, bag: int, fixed: bool,
                 popularity: str, alpha: float, seed: int):
        self.rows_per_table = tuple(int(r) for r in rows)
        self.F, self.bag, self.fixed = dense_features, bag, fixed
        self.powerlaw, self.alpha, self.seed = popularity == "powerlaw", alpha, seed
        # The teacher's dense weights in quarters (integers in [-16, 16]): with dense
        # features drawn as k / 2^16, the dense logit is an exact integer sum.
        teacher = np.random.default_rng([seed, 0xC11C])
        self.w_dense = np.clip(np.round(4 * teacher.normal(0, 1.0, dense_features)),
                               -16, 16).astype(np.int32)

    # --------------------------------------------------------------- one sample
    def _ids(self, bits: jax.Array) -> jax.Array:
        """uint32 draws [T, bag] -> one bag per table, by each table's size and popularity."""
        R = jnp.asarray(self.rows_per_table, jnp.uint32)[:, None]
        if not self.powerlaw:
            return (bits % R).astype(jnp.int32)  # the modulo bias is below 1e-3 for R < 4M
        # Inverse CDF of p(x) ~ x^-a on [1, R + 1), then the popular ids spread over the
        # table by a fixed multiplier (hashed ids, as real logs have them).
        a, u = self.alpha, (bits >> 8).astype(jnp.float32) / 2.0**24
        R = R.astype(jnp.int32)
        Rf = R.astype(jnp.float32)
        x = ((jnp.power(Rf + 1, 1 - a) - 1) * u + 1) ** (1 / (1 - a))
        rank = jnp.clip(x.astype(jnp.int32) - 1, 0, R - 1)
        spread = rank.astype(jnp.uint32) * jnp.uint32(_SPREAD)
        return (spread % R.astype(jnp.uint32)).astype(jnp.int32)

    def sample(self, step_key: jax.Array, row: jax.Array) -> dict[str, jax.Array]:
        """Sample `row` of the step whose key is `step_key`."""
        # One threefry word per sample; its draws are that word hashed with a counter
        # (threefry for every draw made the batch 5x slower on the CPU).
        word = jax.random.bits(jax.random.fold_in(step_key, row), (), jnp.uint32)
        T = len(self.rows_per_table)
        x16 = (_stream(word, 0, (self.F,)) >> 16).astype(jnp.int32)
        bag = self._ids(_stream(word, 1, (T, self.bag)))
        length = jnp.full((T,), self.bag, jnp.int32)
        if not self.fixed:
            length = (_stream(word, 2, (T,)) % jnp.uint32(self.bag)).astype(jnp.int32) + 1
            bag = jnp.where(jnp.arange(self.bag)[None, :] < length[:, None], bag, -1)
        valid = bag >= 0
        score = jnp.float32(0.0)
        for t in range(T):  # integer sums: exact whatever the layout
            s = jnp.sum(jnp.where(valid[t], _id_score(bag[t], t), 0))
            score = score + s.astype(jnp.float32) / (length[t].astype(jnp.float32) * 2.0**15)
        # (x - 1/2) . w, centred so about half the samples click; exact in int32.
        w = jnp.asarray(self.w_dense)
        dense = jnp.sum(x16 * w) - (1 << 15) * int(self.w_dense.sum())
        logit = dense.astype(jnp.float32) / 2.0**16 + 2.0 * score / np.float32(np.sqrt(T))
        u = (_stream(word, 3, ()) >> 8).astype(jnp.float32) / 2.0**24
        label = (u < jax.nn.sigmoid(logit)).astype(jnp.float32)
        x = x16.astype(jnp.float32) / 2.0**16  # exact: U[0, 1) in steps of 2^-16
        return {"dense": x, "ids": bag.astype(jnp.int32), "labels": label}

    def _samples(self, step: jax.Array, rows: jax.Array) -> dict[str, jax.Array]:
        """step: [2] uint32, its high and low words (held-out steps pass 2^32)."""
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(self.seed), step[0]), step[1])
        return jax.vmap(functools.partial(self.sample, key))(rows)

    @staticmethod
    def _words(step: int) -> np.ndarray:
        return np.asarray([step >> 32, step & 0xFFFFFFFF], np.uint32)

    # --------------------------------------------------------------- batches
    @functools.lru_cache(maxsize=4)  # noqa: B019 (one source per run)
    def _batch_fn(self, batch: int, shardings: tuple[tuple[str, NamedSharding], ...]):
        return jax.jit(lambda step: self._samples(step, jnp.arange(batch)),
                       out_shardings=dict(shardings))

    def device_batch(self, step: int, batch: int, shardings: dict[str, NamedSharding]) -> dict:
        """The global batch of `step`, made where it lives: each device its rows."""
        fn = self._batch_fn(batch, tuple(sorted(shardings.items())))
        return fn(self._words(step))

    @functools.cached_property
    def _rows_fn(self):
        return jax.jit(self._samples)

    def rows(self, step: int, start: int, stop: int) -> dict[str, np.ndarray]:
        """Samples [start, stop) of the global batch of `step` (one device; for tests and
        tools: training uses device_batch)."""
        out = self._rows_fn(self._words(step), jnp.arange(start, stop))
        return {k: np.asarray(v) for k, v in out.items()}
