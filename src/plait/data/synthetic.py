"""Synthetic token streams with learnable structure.

Each token has a few fixed successors (drawn once from the seed) with skewed
probabilities, so a model can learn the transition table and drive the loss
from log(vocab) down to the chain's entropy (1.14 nats with 4 successors).
"""

from __future__ import annotations

import numpy as np


class SyntheticTokens:
    def __init__(self, vocab: int, seq_len: int, seed: int, successors: int = 4):
        self.vocab, self.seq_len, self.seed = vocab, seq_len, seed
        table_rng = np.random.default_rng([seed, 0x5EED])
        self.successors = table_rng.integers(0, vocab, size=(vocab, successors))
        p = 0.5 ** np.arange(successors, dtype=np.float64)
        self.cdf = np.cumsum(p / p.sum())

    def entropy(self) -> float:
        """Per-token entropy of the chain (nats): the loss a perfect model reaches."""
        p = np.diff(np.concatenate([[0.0], self.cdf]))
        return float(-(p * np.log(p)).sum())

    def rows(self, step: int, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of the global batch of `step`, each seq_len + 1 tokens."""
        n, length = stop - start, self.seq_len + 1
        out = np.empty((n, length), np.int32)
        u = np.empty((n, length))
        for i, row in enumerate(range(start, stop)):
            rng = np.random.default_rng([self.seed, step, row])
            out[i, 0] = rng.integers(0, self.vocab)
            u[i] = rng.random(length)
        choice = np.minimum(np.searchsorted(self.cdf, u), self.successors.shape[1] - 1)
        for t in range(1, length):
            out[:, t] = self.successors[out[:, t - 1], choice[:, t]]
        return out
