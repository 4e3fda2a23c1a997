"""Optimizers of embedding rows that touch only the rows a step looked up.

Each is a type that owns its state fields: a field is per row ("row": one
float, e.g. row-wise Adagrad's accumulator) or per element ("full": like the
row, e.g. Adam's moments). `parallel.embedding` lays the fields out beside
their table's buffer, the DLRM task converts them for checkpoints, the planner
counts their bytes, all from `fields`; only `update` differs.

How the ids of a bag are applied depends on the device (`by_position`): on a CPU
one scatter per bag position inside a scan is fastest (no [ids, cols] copy of
the gradients); on a GPU a scan is a device loop whose every iteration the host
launches and waits on (dlrm-bench's two 100-position scans held the host for
5.6 ms of a step whose kernels take 1.6 ms on an H100), so there one scatter
takes every id at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp

ROW, FULL = "row", "full"
UNROLL = 10  # bag positions per loop turn of the CPU's per-position gathers and scatters


def by_position(platform: str) -> bool:
    """Whether bags are gathered and scattered one bag position at a time (a scan)."""
    return platform == "cpu"


def add_per_id(buf: jax.Array, rows: jax.Array, g: jax.Array, by_position: bool) -> jax.Array:
    """buf with g[..., cols] (one row per bag) added at every id of rows [..., bag]; ids
    outside buf are dropped."""
    if by_position:
        def add(b, r):
            return b.at[r].add(g, mode="drop"), None

        # The ids of each position made contiguous once (else XLA copies a strided slice
        # of them per scatter), and positions unrolled (fewer loop turns): -25% on CPU.
        by_pos = jax.lax.optimization_barrier(jnp.moveaxis(rows, -1, 0))
        return jax.lax.scan(add, buf, by_pos, unroll=UNROLL)[0]
    every = jnp.broadcast_to(g[..., None, :], (*rows.shape, g.shape[-1]))
    return buf.at[rows.reshape(-1)].add(every.reshape(-1, g.shape[-1]), mode="drop")


@dataclass(frozen=True)
class SparseOptimizer:
    name: ClassVar[str]
    fields: ClassVar[dict[str, str]] = {}  # state field -> ROW or FULL
    lr: float
    eps: float = 1e-8
    b1: float = 0.9
    b2: float = 0.999
    by_position: bool = True  # see the module's docstring

    @classmethod
    def state_bytes_per_row(cls, dim: int) -> int:
        return sum(4 if kind == ROW else 4 * dim for kind in cls.fields.values())

    @classmethod
    def row_state_bytes(cls) -> int:
        """Bytes of the per-row (ROW) fields of one row: whole on every column shard."""
        return 4 * sum(1 for kind in cls.fields.values() if kind == ROW)

    @classmethod
    def update_bytes_per_id(cls, dim: int) -> int:
        """Bytes an update reads and writes per looked-up id, beyond gathering the row:
        the row and each field, read and written."""
        return 2 * (4 * dim + cls.state_bytes_per_row(dim))

    @classmethod
    def state_shapes(cls, rows: int, dim: int) -> dict:
        return {f: jax.ShapeDtypeStruct((rows,) if kind == ROW else (rows, dim), jnp.float32)
                for f, kind in cls.fields.items()}

    def update(self, buf, state, rows, g, lr, step, row_sq_sum, cols_total):
        """New (buf, state) after updating the rows `rows` [..., bag] (buf.shape[0] = not
        here) with their bags' gradients g [..., cols]."""
        raise NotImplementedError


class SGD(SparseOptimizer):
    name = "sgd"

    def update(self, buf, state, rows, g, lr, step, row_sq_sum, cols_total):
        # SGD is linear: duplicates merge in the scatter-add itself. On CPU one scatter
        # per bag position (no [..., bag, cols] copy of the gradients): 116 ms against 220
        # for 2048 x 100 ids x 8 tables.
        return add_per_id(buf, rows, -lr * g, self.by_position), state


def unique_rows(flat: jax.Array, fill: int, by_position: bool = True
                ) -> tuple[jax.Array, jax.Array]:
    """jnp.unique(flat, return_inverse=True, size=n, fill_value=fill), 2.8x faster on CPU.

    XLA's CPU sort is fast on bare keys and slow on (key, index) pairs, which is how
    jnp.unique finds the inverse (1.6M ids: 538 ms). Sorting the keys alone, then
    finding each id's first occurrence by binary search, takes 195 ms. (The binary
    search is a loop; off the CPU it is a sort instead.)"""
    n = flat.shape[0]
    s = jax.lax.sort(flat)
    first_of_run = jnp.concatenate([jnp.ones((1,), bool), s[1:] != s[:-1]])
    run = jnp.cumsum(first_of_run) - 1
    method = "scan" if by_position else "sort"
    inverse = run[jnp.searchsorted(s, flat, side="left", method=method)]
    uniq = jnp.full((n,), fill, flat.dtype).at[run].set(s)
    return uniq, inverse


def merged_gradients(rows, g, sentinel: int, by_position: bool = True
                     ) -> tuple[jax.Array, jax.Array]:
    """The distinct rows (padded with `sentinel`) and each one's gradient summed over its
    ids."""
    flat = rows.reshape(-1)
    n = flat.shape[0]
    uniq, inv = unique_rows(flat, sentinel, by_position)
    gu = add_per_id(jnp.zeros((n, g.shape[-1]), g.dtype), inv.reshape(rows.shape), g,
                    by_position)
    return uniq, gu


class RowwiseAdagrad(SparseOptimizer):
    """One accumulator per row: the mean of g^2 over the row (TorchRec / FBGEMM, MLPerf)."""

    name = "adagrad"
    fields = {"acc": ROW}

    def update(self, buf, state, rows, g, lr, step, row_sq_sum, cols_total):
        uniq, gu = merged_gradients(rows, g, buf.shape[0], self.by_position)
        sq = row_sq_sum(jnp.sum(gu * gu, axis=-1)) / cols_total
        acc = state["acc"].at[uniq].add(sq, mode="drop")
        a = acc.at[uniq].get(mode="fill", fill_value=1.0)
        upd = -lr * gu / (jnp.sqrt(a)[:, None] + self.eps)
        return buf.at[uniq].add(upd, mode="drop"), {"acc": acc}


class RowAdam(SparseOptimizer):
    """Adam on the touched rows (lazy: untouched rows' moments do not decay), bias
    correction by the global step."""

    name = "adam"
    fields = {"m": FULL, "v": FULL}

    def update(self, buf, state, rows, g, lr, step, row_sq_sum, cols_total):
        uniq, gu = merged_gradients(rows, g, buf.shape[0], self.by_position)
        t = (step + 1).astype(jnp.float32)
        b1, b2 = self.b1, self.b2
        m = state["m"].at[uniq].get(mode="fill", fill_value=0.0) * b1 + (1 - b1) * gu
        v = state["v"].at[uniq].get(mode="fill", fill_value=0.0) * b2 + (1 - b2) * gu * gu
        upd = -lr * (m / (1 - b1 ** t)) / (jnp.sqrt(v / (1 - b2 ** t)) + self.eps)
        return (buf.at[uniq].add(upd, mode="drop"),
                {"m": state["m"].at[uniq].set(m, mode="drop"),
                 "v": state["v"].at[uniq].set(v, mode="drop")})


OPTIMIZERS: dict[str, type[SparseOptimizer]] = {o.name: o for o in (SGD, RowwiseAdagrad, RowAdam)}
