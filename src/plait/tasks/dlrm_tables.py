"""A DLRM's embedding tables in the train state: fused buffers in memory, whole tables on disk.

In memory the tables of one placement share a fused buffer (and the sparse
optimizer's fields lie beside it, `parallel.embedding`); checkpoints hold each
table whole under its own name ("t0", "t1", ... and the same for its optimizer
fields), split by rows (or columns) over the devices when they divide, so a run
resumes under another plan or mesh.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from plait.parallel import embedding as emb
from plait.parallel.sparse_optim import OPTIMIZERS, ROW


def _canonical_spec(shape: tuple[int, ...], axes: tuple[str, ...], n: int) -> P:
    """Checkpoint layout of one table: split by rows, else by columns, else whole."""
    ax = axes if len(axes) > 1 else axes[0]
    if n > 1 and shape[0] % n == 0:
        return P(ax, *([None] * (len(shape) - 1)))
    if n > 1 and len(shape) > 1 and shape[1] % n == 0:
        return P(None, ax)
    return P(*([None] * len(shape)))


class TableState:
    """The `tables` and `table_opt` entries of the state, in both layouts."""

    def __init__(self, tables: emb.TableLayout, optimizer: str, mesh: Mesh):
        self.tables, self.mesh = tables, mesh
        self.fields = OPTIMIZERS[optimizer].fields
        self.optimizer = optimizer

    def shapes(self) -> tuple[dict, dict]:
        """Shapes and shardings of {"tables", "table_opt"} in memory (fused)."""
        lay = self.tables
        tables_sh, opt_sh = emb.shardings(lay, self.mesh, self.optimizer)
        shapes = {k: jax.ShapeDtypeStruct(lay.buffer_shape(k), jnp.float32) for k in lay.present}
        return ({"tables": shapes, "table_opt": emb.opt_state_shapes(lay, self.optimizer)},
                {"tables": tables_sh, "table_opt": opt_sh})

    def canonical_shapes(self) -> tuple[dict, dict]:
        """Shapes and shardings of {"tables", "table_opt"} in checkpoints (per table)."""
        lay = self.tables

        def placed(x: jax.ShapeDtypeStruct) -> NamedSharding:
            return NamedSharding(self.mesh, _canonical_spec(x.shape, lay.axes, lay.devices))

        shapes = {"tables": {}, "table_opt": {}}
        for t, r in enumerate(lay.rows):
            shapes["tables"][f"t{t}"] = jax.ShapeDtypeStruct((r, lay.dim), jnp.float32)
            shapes["table_opt"][f"t{t}"] = OPTIMIZERS[self.optimizer].state_shapes(r, lay.dim)
        return shapes, jax.tree.map(placed, shapes)

    def to_canonical(self, state: dict) -> dict:
        lay = self.tables
        opt = {f"t{t}": {} for t in range(len(lay.rows))}
        for field, how in self.fields.items():
            bufs = {k: v[field][:, None] if how == ROW else v[field]
                    for k, v in state["table_opt"].items()}
            for t, a in enumerate(emb.unfuse(lay, bufs)):
                opt[f"t{t}"][field] = a[:, 0] if how == ROW else a
        tables = {f"t{t}": a for t, a in enumerate(emb.unfuse(lay, state["tables"]))}
        return dict(state, tables=tables, table_opt=opt)

    def from_canonical(self, state: dict) -> dict:
        lay = self.tables
        T = len(lay.rows)
        opt = {k: {} for k in lay.present}
        for field, how in self.fields.items():
            per = [state["table_opt"][f"t{t}"][field] for t in range(T)]
            fused = emb.fuse(lay, [a[:, None] for a in per] if how == ROW else per)
            for k, a in fused.items():
                opt[k][field] = a[:, 0] if how == ROW else a
        tables = emb.fuse(lay, [state["tables"][f"t{t}"] for t in range(T)])
        return dict(state, tables=tables, table_opt=opt)

    def init_canonical(self, seed: int) -> dict:
        """Fresh tables (the reference DLRM's init) and zero optimizer fields, per table."""
        lay = self.tables
        shapes, _ = self.canonical_shapes()
        return {"tables": {f"t{t}": emb.init_table(seed, t, r, lay.dim)
                           for t, r in enumerate(lay.rows)},
                "table_opt": jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype),
                                          shapes["table_opt"])}

    def describe(self, state: dict) -> str:
        """Which placement each table has, and how much of the tables this process holds
        (from the shardings: `state` may be the abstract one, before the state is made)."""
        lay = self.tables
        kinds = ", ".join(f"{k} x{lay.kinds.count(k)}" for k in emb.PLACEMENTS
                          if k in lay.kinds)
        parts = []
        for k, v in state["tables"].items():
            parts.append(f"{k} {_held_once(v):,}/{math.prod(v.shape):,}")
        return (f"plait: tables {kinds}; elements held by this process's devices "
                f"(one copy): {'; '.join(parts)}")


def _held_once(array) -> int:
    """Elements of `array` on this process's devices, each distinct shard counted once."""
    seen = {tuple((i.start, i.stop) for i in index) for index in
            array.sharding.addressable_devices_indices_map(array.shape).values()}
    return sum(math.prod(len(range(*slice(a, b).indices(n))) for (a, b), n in
                         zip(index, array.shape, strict=True)) for index in seen)
