"""The pipeline executor's per-microbatch buffers: which slot each item takes, and
how a slot's bytes hold arrays of several shapes and dtypes.

Two sets of arrays that are never live together share buffers where their
shapes allow: zero-bubble's input-gradient pass overwrites the residuals only it
read with what it keeps for the weight-gradient pass, so a rank holds about
what 1F1B's whole backward would per microbatch.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def colour(intervals: list[tuple[int, int, int, object]], ranks: int
           ) -> tuple[dict, list[int]]:
    """Greedy interval colouring per rank: item -> slot in its rank's buffer, and the
    slots each rank needs (SPMD: every rank allocates the largest count). An interval
    (start, end, rank, item) holds its slot from tick start to tick end, both in."""
    ends: dict[int, list[int]] = {r: [] for r in range(ranks)}
    slot_of = {}
    for start, end, rank, item in sorted(intervals, key=lambda x: (x[0], x[1])):
        mine = ends[rank]
        for k, e in enumerate(mine):
            if e < start:
                mine[k] = end
                slot_of[item] = k
                break
        else:
            slot_of[item] = len(mine)
            mine.append(end)
    return slot_of, [len(ends[r]) for r in range(ranks)]


class Rows:
    """Named groups of arrays kept per microbatch in a list of slot buffers
    ([slots + 1, *shape] each, the last slot the trash). A group may reuse another
    group's buffers of the same shape and dtype, each once: the arrays keep their
    shapes (so data, fsdp and tensor shardings pass through untouched, with no
    resharding collective inside a pipeline branch), and what is never live
    together shares memory."""

    def __init__(self):
        self.avals: list[jax.ShapeDtypeStruct] = []
        self.groups: dict[str, list[int]] = {}

    def add(self, name: str, avals: Sequence, share: str | None = None) -> None:
        free = list(self.groups.get(share, [])) if share else []
        where = []
        for a in avals:
            a = jax.ShapeDtypeStruct(a.shape, a.dtype)
            j = next((k for k in free if self.avals[k] == a), None)
            if j is None:
                j = len(self.avals)
                self.avals.append(a)
            else:
                free.remove(j)
            where.append(j)
        self.groups[name] = where

    def zeros(self) -> list[jax.Array]:
        """One row of every buffer."""
        return [jnp.zeros(a.shape, a.dtype) for a in self.avals]

    def buffers(self, n_slots: int) -> list[jax.Array]:
        return [jnp.zeros((n_slots + 1, *a.shape), a.dtype) for a in self.avals]

    def read(self, rows: Sequence[jax.Array], name: str) -> list[jax.Array]:
        return [rows[j] for j in self.groups[name]]

    def write(self, rows: Sequence[jax.Array], name: str, values: Sequence) -> list[jax.Array]:
        rows = list(rows)
        for j, v in zip(self.groups[name], values, strict=True):
            rows[j] = v
        return rows

    def nbytes(self) -> int:
        return sum(int(np.prod(a.shape, dtype=np.int64)) * np.dtype(a.dtype).itemsize
                   for a in self.avals)
