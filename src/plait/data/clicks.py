"""Synthetic click logs for DLRM: learnable, deterministic by (seed, step, row).

Each sample has dense features U[0, 1), one bag of ids per table (uniform or
power-law popularity; fixed or variable bag size, -1 pads) and a click label
drawn from a fixed logistic "teacher": a linear function of the dense features
plus, per table, the mean of a hashed score of the ids in the bag. A model
that learns the teacher's weights and the ids' scores beats AUC 0.5 clearly.
"""

from __future__ import annotations

import numpy as np


def _id_score(ids: np.ndarray, table: int) -> np.ndarray:
    """A fixed pseudo-random score in [-1, 1) per (table, id)."""
    h = (ids.astype(np.uint64) * np.uint64(0x9E3779B1) + np.uint64(table * 0x85EBCA6B + 1))
    h ^= h >> np.uint64(15)
    h = (h * np.uint64(0x2C1B3C6D)) & np.uint64(0xFFFFFFFF)
    return h.astype(np.float64) / 2**31 - 1.0


class SyntheticClicks:
    def __init__(self, rows: list[int], dense_features: int, bag: int, fixed: bool,
                 popularity: str, alpha: float, seed: int):
        self.rows_per_table = np.asarray(rows, np.int64)
        self.F, self.bag, self.fixed = dense_features, bag, fixed
        self.powerlaw, self.alpha, self.seed = popularity == "powerlaw", alpha, seed
        teacher = np.random.default_rng([seed, 0xC11C])
        self.w_dense = teacher.normal(0, 1.0, dense_features)
        self.b = -0.5 * self.w_dense.sum()  # centred: about half the samples click

    def _ids(self, u: np.ndarray) -> np.ndarray:
        """Uniform draws [T, bag] -> ids, per table's size and popularity."""
        R = self.rows_per_table[:, None].astype(np.float64)
        if not self.powerlaw:
            return np.minimum((u * R).astype(np.int64), R.astype(np.int64) - 1)
        a = self.alpha
        # Inverse CDF of p(x) ~ x^-a on [1, R + 1), then spread the popular ids over the
        # table with a fixed odd multiplier (hashed ids, as real logs have them).
        x = ((np.power(R + 1, 1 - a) - 1) * u + 1) ** (1 / (1 - a))
        rank = np.minimum(x.astype(np.int64) - 1, R.astype(np.int64) - 1)
        return (rank * 2654435761) % R.astype(np.int64)

    def rows(self, step: int, start: int, stop: int) -> dict[str, np.ndarray]:
        """Samples [start, stop) of the global batch of `step`."""
        n, T = stop - start, len(self.rows_per_table)
        dense = np.empty((n, self.F), np.float32)
        ids = np.empty((n, T, self.bag), np.int32)
        labels = np.empty((n,), np.float32)
        for i, row in enumerate(range(start, stop)):
            rng = np.random.default_rng([self.seed, step, row])
            x = rng.random(self.F)
            bag = self._ids(rng.random((T, self.bag)))
            if not self.fixed:
                length = rng.integers(1, self.bag + 1, size=T)
                bag = np.where(np.arange(self.bag)[None, :] < length[:, None], bag, -1)
            scores = sum(np.mean(_id_score(bag[t][bag[t] >= 0], t)) for t in range(T))
            logit = 4.0 * (x @ self.w_dense + self.b) + 2.0 * scores / np.sqrt(T)
            labels[i] = float(rng.random() < 1.0 / (1.0 + np.exp(-logit)))
            dense[i], ids[i] = x, bag
        return {"dense": dense, "ids": ids, "labels": labels}
