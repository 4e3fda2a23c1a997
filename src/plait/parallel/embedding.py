"""Embedding tables sharded over the mesh, looked up and updated inside shard_map.

Tables of one kind share one fused buffer (all tables have the same dimension):

- replicated: every device holds every row; lookups are local, the backward
  all-gathers the pooled gradients and ids (batch-sized) so every replica makes
  the same sparse update;
- row: each table split into P equal parts, part p on device p; every device
  looks up the ids of the whole batch among its rows (masked) and the partial
  bags are reduce-scattered over the batch;
- table: whole tables on single devices (planned to balance); the owner pools
  its tables for the whole batch and an all-to-all returns each device its
  samples' bags;
- column: each table's dimension split over the devices; every device pools
  its columns for the whole batch and an all-to-all reassembles the rows.

Ids of the whole batch are all-gathered where needed (batch x bag integers).
No collective moves anything the size of a table, and the update touches only
the rows the step looked up (`sparse_update`): SGD as a scatter-add, row-wise
Adagrad and Adam on the merged gradient of each distinct row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from plait.config import TABLE_PLACEMENTS as PLACEMENTS
from plait.parallel.sparse_optim import OPTIMIZERS, ROW, UNROLL, SparseOptimizer, by_position


@dataclass(frozen=True)
class TableLayout:
    """Where each table's rows live: the fused buffer of its kind, and its place in it."""

    rows: tuple[int, ...]
    dim: int
    kinds: tuple[str, ...]
    devices: int  # P: devices the tables are spread over
    axes: tuple[str, ...]  # mesh axes those devices span (the batch axes)
    owners: tuple[int, ...] = ()  # table-wise: owning device per table (-1 otherwise)
    offsets: tuple[int, ...] = field(init=False)
    slots: tuple[int, ...] = field(init=False)  # table-wise: index among the owner's tables
    block_rows: dict = field(init=False)  # kind -> rows of the buffer on each device

    def __post_init__(self):
        Pn = self.devices
        owners = self.owners or tuple(-1 for _ in self.rows)
        object.__setattr__(self, "owners", owners)
        offsets, slots = [0] * len(self.rows), [0] * len(self.rows)
        block = {k: 0 for k in PLACEMENTS}
        per_owner = [0] * Pn
        per_owner_count = [0] * Pn
        for t, (r, kind) in enumerate(zip(self.rows, self.kinds, strict=True)):
            if kind == "row":
                offsets[t] = block["row"]
                block["row"] += self.part(t)
            elif kind == "table":
                o = owners[t]
                offsets[t], slots[t] = per_owner[o], per_owner_count[o]
                per_owner[o] += r
                per_owner_count[o] += 1
            else:
                offsets[t] = block[kind]
                block[kind] += r
        block["table"] = max(per_owner)
        object.__setattr__(self, "offsets", tuple(offsets))
        object.__setattr__(self, "slots", tuple(slots))
        object.__setattr__(self, "block_rows", block)

    def part(self, t: int) -> int:
        """Rows of row-wise table t on each device."""
        return math.ceil(self.rows[t] / self.devices)

    def tables(self, kind: str) -> list[int]:
        return [t for t, k in enumerate(self.kinds) if k == kind]

    @property
    def present(self) -> list[str]:
        return [k for k in PLACEMENTS if self.tables(k)]

    @property
    def slots_per_device(self) -> int:
        owners = [self.owners[t] for t in self.tables("table")]
        return max((owners.count(o) for o in set(owners)), default=0)

    def buffer_shape(self, kind: str) -> tuple[int, int]:
        if kind in ("row", "table"):
            return (self.devices * self.block_rows[kind], self.dim)
        return (self.block_rows[kind], self.dim)

    def buffer_spec(self, kind: str) -> P:
        ax = self.axes if len(self.axes) > 1 else self.axes[0]
        return {"row": P(ax, None), "table": P(ax, None), "column": P(None, ax),
                "replicated": P(None, None)}[kind]

    def row_spec(self, kind: str) -> P:
        """Spec of a per-row vector (Adagrad's accumulator) laid like the buffer's rows."""
        ax = self.axes if len(self.axes) > 1 else self.axes[0]
        return P(ax) if kind in ("row", "table") else P(None)

    def row_bytes(self, opt: str) -> int:
        """Bytes of one row with its sparse optimizer's state."""
        return 4 * self.dim + OPTIMIZERS[opt].state_bytes_per_row(self.dim)

    def table_bytes_on(self, t: int, p: int, opt: str) -> float:
        """Bytes of table t (with its optimizer state) on device p."""
        kind, whole = self.kinds[t], self.rows[t] * self.row_bytes(opt)
        if kind == "replicated":
            return whole
        if kind == "table":
            return whole if self.owners[t] == p else 0
        if kind == "row":
            return self.part(t) * self.row_bytes(opt)
        # column: the row's floats (and full-row state) split, per-row state whole
        per_row = self.rows[t] * OPTIMIZERS[opt].row_state_bytes()
        return (whole - per_row) / self.devices + per_row

    def per_device_table_bytes(self, opt: str) -> list[float]:
        """Each device's bytes of embedding tables and their optimizer state."""
        return [sum(self.table_bytes_on(t, p, opt) for t in range(len(self.rows)))
                for p in range(self.devices)]


# ---------------------------------------------------------------- state


def opt_state_shapes(lay: TableLayout, opt: str) -> dict:
    """The sparse optimizer's state beside each fused buffer."""
    return {kind: OPTIMIZERS[opt].state_shapes(*lay.buffer_shape(kind)) for kind in lay.present}


def shardings(lay: TableLayout, mesh: Mesh, opt: str) -> tuple[dict, dict]:
    """Shardings of the fused buffers and of their optimizer state (laid like the rows)."""
    tables = {k: NamedSharding(mesh, lay.buffer_spec(k)) for k in lay.present}
    fields = OPTIMIZERS[opt].fields
    state = {kind: {f: NamedSharding(mesh, lay.row_spec(kind)) if how == ROW else tables[kind]
                    for f, how in fields.items()}
             for kind in lay.present}
    return tables, state


def init_table(seed: int, t: int, rows: int, dim: int) -> jax.Array:
    """Table t's initial values, as the reference DLRM draws them: U(-1/sqrt(rows), +)."""
    key = jax.random.fold_in(jax.random.key(seed), 1_000_003 + t)
    bound = 1.0 / math.sqrt(rows)
    return jax.random.uniform(key, (rows, dim), jnp.float32, -bound, bound)


def fuse(lay: TableLayout, tables: list[jax.Array]) -> dict:
    """Per-table arrays [rows_t, cols] -> the fused buffers of the layout (jnp; jit it).
    cols is the embedding dimension for tables and Adam's moments, 1 for Adagrad's
    accumulators."""
    out = {}
    Pn = lay.devices
    cols = tables[0].shape[1]
    for kind in lay.present:
        ts = lay.tables(kind)
        if kind == "row":
            parts = []
            for t in ts:
                a = tables[t]
                a = jnp.pad(a, ((0, Pn * lay.part(t) - a.shape[0]), (0, 0)))
                parts.append(a.reshape(Pn, lay.part(t), cols))
            out[kind] = jnp.concatenate(parts, axis=1).reshape(-1, cols)
        elif kind == "table":
            blocks = []
            for p in range(Pn):
                mine = sorted((t for t in ts if lay.owners[t] == p), key=lambda t: lay.slots[t])
                b = (jnp.concatenate([tables[t] for t in mine]) if mine
                     else jnp.zeros((0, cols), tables[0].dtype))
                blocks.append(jnp.pad(b, ((0, lay.block_rows["table"] - b.shape[0]), (0, 0))))
            out[kind] = jnp.concatenate(blocks)
        else:
            out[kind] = jnp.concatenate([tables[t] for t in ts])
    return out


def unfuse(lay: TableLayout, buffers: dict) -> list[jax.Array]:
    """The fused buffers -> per-table arrays [rows_t, cols] (checkpoints hold these)."""
    Pn = lay.devices
    out: list = [None] * len(lay.rows)
    for kind in lay.present:
        buf = buffers[kind]
        cols = buf.shape[1]
        for t in lay.tables(kind):
            o, r = lay.offsets[t], lay.rows[t]
            if kind == "row":
                blocks = buf.reshape(Pn, lay.block_rows["row"], cols)
                out[t] = blocks[:, o:o + lay.part(t)].reshape(-1, cols)[:r]
            elif kind == "table":
                start = lay.owners[t] * lay.block_rows["table"] + o
                out[t] = buf[start:start + r]
            else:
                out[t] = buf[o:o + r]
    return out


# ---------------------------------------------------------------- lookup


def _index(lay: TableLayout):
    return jax.lax.axis_index(lay.axes)


def _gather_ids(lay: TableLayout, ids):
    return jax.lax.all_gather(ids, lay.axes, axis=1, tiled=True)


def _pool(buf, rows, valid, by_position: bool):
    """Sum of buf[rows] over the bag (last axis of rows), invalid ids contributing 0.

    On CPU one gather per bag position, accumulated in a scan: gathering the whole
    [..., bag, dim] block first and summing it costs 7x more there (a batch of
    2048 x 100 ids x 8 tables: 308 ms against 44). Elsewhere the whole block, in one
    gather and one sum (a scan is a host-driven loop on a GPU: sparse_optim)."""
    if not by_position:
        got = jnp.take(buf, jnp.where(valid, rows, 0), axis=0, mode="clip")
        return jnp.sum(jnp.where(valid[..., None], got, 0.0), axis=-2)

    def add(acc, x):
        r, v = x
        got = jnp.take(buf, jnp.where(v, r, 0), axis=0, mode="clip")
        return acc + jnp.where(v[..., None], got, 0.0), None

    zero = jnp.zeros((*rows.shape[:-1], buf.shape[1]), buf.dtype)
    # Unrolled, XLA fuses several positions' gathers into one pass over the accumulator.
    return jax.lax.scan(add, zero, (jnp.moveaxis(rows, -1, 0), jnp.moveaxis(valid, -1, 0)),
                        unroll=UNROLL)[0]


def _table_maps(lay: TableLayout):
    """Table-wise bookkeeping: per device and slot, which table (index among the kind's
    tables, -1 = empty slot) and its offset; per table, its row in the all-to-all output."""
    ts = lay.tables("table")
    k = lay.slots_per_device
    sel = -np.ones((lay.devices, k), np.int32)
    off = np.zeros((lay.devices, k), np.int32)
    recv = np.zeros(len(ts), np.int32)
    for i, t in enumerate(ts):
        o, s = lay.owners[t], lay.slots[t]
        sel[o, s], off[o, s] = i, lay.offsets[t]
        recv[i] = o * k + s
    return sel, off, recv


def _local_rows(lay: TableLayout, kind: str, ids_all, p):
    """Rows of this device's block the ids of `kind`'s tables touch, and which ids are here.

    ids_all: [T_kind, B, bag] global ids (all-gathered). Returns (rows, valid) with the
    table-wise result laid [slots, B, bag] (this device's tables)."""
    ts = lay.tables(kind)
    valid = ids_all >= 0
    if kind == "row":
        part = jnp.asarray([lay.part(t) for t in ts], jnp.int32)[:, None, None]
        off = jnp.asarray([lay.offsets[t] for t in ts], jnp.int32)[:, None, None]
        here = valid & (ids_all // part == p)
        return ids_all - p * part + off, here
    if kind == "table":
        sel, off, _ = _table_maps(lay)
        my_sel = jnp.asarray(sel)[p]
        my_off = jnp.asarray(off)[p]
        ids = ids_all[jnp.maximum(my_sel, 0)]
        here = (ids >= 0) & (my_sel >= 0)[:, None, None]
        return ids + my_off[:, None, None], here
    off = jnp.asarray([lay.offsets[t] for t in ts], jnp.int32)[:, None, None]
    return ids_all + off, valid


def pooled(lay: TableLayout, mesh: Mesh, buffers: dict, ids: jax.Array, mean: bool,
           per_position: bool | None = None) -> jax.Array:
    """Bags of every table for the batch: ids [T, B, bag] (-1 = no id) -> [T, B, dim].

    ids and the result are split over the batch axes (dim 1). per_position: gather one
    bag position at a time (default: on CPUs, sparse_optim.by_position)."""
    ax = lay.axes if len(lay.axes) > 1 else lay.axes[0]
    specs = {k: lay.buffer_spec(k) for k in lay.present}
    if per_position is None:
        per_position = by_position(mesh.devices.flat[0].platform)

    def body(bufs, ids):
        p = _index(lay)
        out: list = [None] * len(lay.rows)
        for kind in lay.present:
            ts = lay.tables(kind)
            mine = ids[jnp.asarray(ts)]
            if kind == "replicated":
                rows, valid = _local_rows(lay, kind, mine, p)
                res = _pool(bufs[kind], rows, valid, per_position)
            else:
                rows, here = _local_rows(lay, kind, _gather_ids(lay, mine), p)
                part = _pool(bufs[kind], rows, here, per_position)
                if kind == "row":
                    res = jax.lax.psum_scatter(part, lay.axes, scatter_dimension=1, tiled=True)
                elif kind == "table":
                    recv = jax.lax.all_to_all(part, lay.axes, 1, 0, tiled=True)
                    res = recv[jnp.asarray(_table_maps(lay)[2])]
                else:
                    res = jax.lax.all_to_all(part, lay.axes, 1, 2, tiled=True)
            for i, t in enumerate(ts):
                out[t] = res[i]
        bags = jnp.stack(out)
        if mean:
            counts = jnp.maximum(jnp.sum(ids >= 0, axis=-1), 1).astype(bags.dtype)
            bags = bags / counts[..., None]
        return bags

    return jax.shard_map(body, mesh=mesh, in_specs=(specs, P(None, ax, None)),
                         out_specs=P(None, ax, None), check_vma=False)(buffers, ids)


# ---------------------------------------------------------------- sparse update


def sparse_update(lay: TableLayout, mesh: Mesh, opt: SparseOptimizer, buffers: dict, state: dict,
                  ids: jax.Array, grads: jax.Array, lr: jax.Array, step: jax.Array,
                  mean: bool):
    """Apply the gradient of the bags (grads [T, B, dim], batch-split like ids) to the rows
    the ids touched. Returns (buffers, state), laid out as given."""
    ax = lay.axes if len(lay.axes) > 1 else lay.axes[0]
    specs = {k: lay.buffer_spec(k) for k in lay.present}
    _, state_sh = shardings(lay, mesh, opt.name)
    state_specs = jax.tree.map(lambda s: s.spec, state_sh)

    def body(bufs, st, ids, grads, lr, step):
        p = _index(lay)
        if mean:
            counts = jnp.maximum(jnp.sum(ids >= 0, axis=-1), 1).astype(grads.dtype)
            grads = grads / counts[..., None]
        new_b, new_s = {}, {}
        for kind in lay.present:
            ts = jnp.asarray(lay.tables(kind))
            mine, g = ids[ts], grads[ts]
            cols_total = lay.dim
            row_sq_sum = (lambda x: x)
            if kind == "replicated":
                mine = _gather_ids(lay, mine)
                g = jax.lax.all_gather(g, lay.axes, axis=1, tiled=True)
                rows, here = _local_rows(lay, kind, mine, p)
            elif kind == "row":
                rows, here = _local_rows(lay, kind, _gather_ids(lay, mine), p)
                g = jax.lax.all_gather(g, lay.axes, axis=1, tiled=True)
            elif kind == "table":
                sel, _, recv = _table_maps(lay)
                k = lay.slots_per_device
                send = jnp.zeros((lay.devices * k, *g.shape[1:]), g.dtype).at[
                    jnp.asarray(recv)].set(g)
                g = jax.lax.all_to_all(send, lay.axes, 0, 1, tiled=True)  # [k, B, dim]
                rows, here = _local_rows(lay, kind, _gather_ids(lay, mine), p)
            else:
                g = jax.lax.all_to_all(g, lay.axes, 2, 1, tiled=True)  # [T, B, dim/P]
                rows, here = _local_rows(lay, kind, _gather_ids(lay, mine), p)
                row_sq_sum = (lambda x: jax.lax.psum(x, lay.axes))
            rows = jnp.where(here, rows, bufs[kind].shape[0])  # elsewhere: dropped
            new_b[kind], new_s[kind] = opt.update(bufs[kind], st[kind], rows, g, lr, step,
                                                  row_sq_sum, cols_total)
        return new_b, new_s

    return jax.shard_map(
        body, mesh=mesh,
        in_specs=(specs, state_specs, P(None, ax, None), P(None, ax, None), P(), P()),
        out_specs=(specs, state_specs), check_vma=False)(buffers, state, ids, grads, lr, step)
