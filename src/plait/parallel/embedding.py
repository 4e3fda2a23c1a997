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

KINDS = ("table", "row", "column", "replicated")


@dataclass(frozen=True)
class Layout:
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
        block = {k: 0 for k in KINDS}
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
        return [k for k in KINDS if self.tables(k)]

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
        """Bytes of one row with its optimizer state (SGD none, row-wise Adagrad one
        float, Adam two moments)."""
        return 4 * self.dim + {"sgd": 0, "adagrad": 4, "adam": 8 * self.dim}[opt]

    def table_bytes_on(self, t: int, p: int, opt: str) -> float:
        """Bytes of table t (with its optimizer state) on device p."""
        kind, whole = self.kinds[t], self.rows[t] * self.row_bytes(opt)
        if kind == "replicated":
            return whole
        if kind == "table":
            return whole if self.owners[t] == p else 0
        if kind == "row":
            return self.part(t) * self.row_bytes(opt)
        # column: the row's floats (and Adam's moments) split, Adagrad's accumulator whole
        acc = 4 * self.rows[t] if opt == "adagrad" else 0
        return (whole - acc) / self.devices + acc

    def per_device_table_bytes(self, opt: str) -> list[float]:
        """Each device's bytes of embedding tables and their optimizer state."""
        return [sum(self.table_bytes_on(t, p, opt) for t in range(len(self.rows)))
                for p in range(self.devices)]


# ---------------------------------------------------------------- state


def opt_state_shapes(lay: Layout, opt: str) -> dict:
    out = {}
    for kind in lay.present:
        shape = lay.buffer_shape(kind)
        if opt == "adagrad":
            out[kind] = {"acc": jax.ShapeDtypeStruct((shape[0],), jnp.float32)}
        elif opt == "adam":
            s = jax.ShapeDtypeStruct(shape, jnp.float32)
            out[kind] = {"m": s, "v": s}
        else:
            out[kind] = {}
    return out


def shardings(lay: Layout, mesh: Mesh, opt: str) -> tuple[dict, dict]:
    """Shardings of the fused buffers and of their optimizer state."""
    tables = {k: NamedSharding(mesh, lay.buffer_spec(k)) for k in lay.present}
    state = {}
    for kind in lay.present:
        if opt == "adagrad":
            state[kind] = {"acc": NamedSharding(mesh, lay.row_spec(kind))}
        elif opt == "adam":
            state[kind] = {"m": tables[kind], "v": tables[kind]}
        else:
            state[kind] = {}
    return tables, state


def init_table(seed: int, t: int, rows: int, dim: int) -> jax.Array:
    """Table t's initial values, as the reference DLRM draws them: U(-1/sqrt(rows), +)."""
    key = jax.random.fold_in(jax.random.key(seed), 1_000_003 + t)
    bound = 1.0 / math.sqrt(rows)
    return jax.random.uniform(key, (rows, dim), jnp.float32, -bound, bound)


def fuse(lay: Layout, tables: list[jax.Array]) -> dict:
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


def unfuse(lay: Layout, buffers: dict) -> list[jax.Array]:
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


def _index(lay: Layout):
    return jax.lax.axis_index(lay.axes)


def _gather_ids(lay: Layout, ids):
    return jax.lax.all_gather(ids, lay.axes, axis=1, tiled=True)


def _pool(buf, rows, valid):
    """Sum of buf[rows] over the bag (last axis of rows), invalid ids contributing 0.

    One gather per bag position, accumulated in a scan: gathering the whole
    [..., bag, dim] block first and summing it costs 7x more on CPU (a batch of
    2048 x 100 ids x 8 tables: 308 ms against 44)."""
    def add(acc, x):
        r, v = x
        got = jnp.take(buf, jnp.where(v, r, 0), axis=0, mode="clip")
        return acc + jnp.where(v[..., None], got, 0.0), None

    zero = jnp.zeros((*rows.shape[:-1], buf.shape[1]), buf.dtype)
    return jax.lax.scan(add, zero, (jnp.moveaxis(rows, -1, 0), jnp.moveaxis(valid, -1, 0)))[0]


def _table_maps(lay: Layout):
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


def _local_rows(lay: Layout, kind: str, ids_all, p):
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


def pooled(lay: Layout, mesh: Mesh, buffers: dict, ids: jax.Array, mean: bool) -> jax.Array:
    """Bags of every table for the batch: ids [T, B, bag] (-1 = no id) -> [T, B, dim].

    ids and the result are split over the batch axes (dim 1)."""
    ax = lay.axes if len(lay.axes) > 1 else lay.axes[0]
    specs = {k: lay.buffer_spec(k) for k in lay.present}

    def body(bufs, ids):
        p = _index(lay)
        out: list = [None] * len(lay.rows)
        for kind in lay.present:
            ts = lay.tables(kind)
            mine = ids[jnp.asarray(ts)]
            if kind == "replicated":
                rows, valid = _local_rows(lay, kind, mine, p)
                res = _pool(bufs[kind], rows, valid)
            else:
                rows, here = _local_rows(lay, kind, _gather_ids(lay, mine), p)
                part = _pool(bufs[kind], rows, here)
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


@dataclass(frozen=True)
class SparseOpt:
    name: str  # sgd | adagrad | adam
    lr: float
    eps: float = 1e-8
    b1: float = 0.9
    b2: float = 0.999


def _unique_rows(flat: jax.Array, fill: int) -> tuple[jax.Array, jax.Array]:
    """jnp.unique(flat, return_inverse=True, size=n, fill_value=fill), 2.8x faster on CPU.

    XLA's CPU sort is fast on bare keys and slow on (key, index) pairs, which is how
    jnp.unique finds the inverse (1.6M ids: 538 ms). Sorting the keys alone, then
    finding each id's first occurrence by binary search, takes 195 ms."""
    n = flat.shape[0]
    s = jax.lax.sort(flat)
    first_of_run = jnp.concatenate([jnp.ones((1,), bool), s[1:] != s[:-1]])
    run = jnp.cumsum(first_of_run) - 1
    inverse = run[jnp.searchsorted(s, flat, side="left", method="scan")]
    uniq = jnp.full((n,), fill, flat.dtype).at[run].set(s)
    return uniq, inverse


def _apply(opt: SparseOpt, buf, state, rows, here, g, lr, step, row_sq_sum, cols_total):
    """Update the rows of `buf` looked up by `rows` [..., bag] (where `here`), each bag's
    ids with its gradient g [..., cols]."""
    sentinel = buf.shape[0]
    rows = jnp.where(here, rows, sentinel)
    if opt.name == "sgd":
        # SGD is linear: duplicates merge in the scatter-add itself. One scatter per bag
        # position (no [..., bag, cols] copy of the gradients): 116 ms against 220 for
        # 2048 x 100 ids x 8 tables on CPU.
        upd = -lr * g

        def add(b, r):
            return b.at[r].add(upd, mode="drop"), None

        return jax.lax.scan(add, buf, jnp.moveaxis(rows, -1, 0))[0], state
    flat = rows.reshape(-1)
    n = flat.shape[0]
    uniq, inv = _unique_rows(flat, sentinel)
    # Merge duplicates: each distinct row's gradient summed over its ids, one bag
    # position at a time (no [ids, cols] copy of the bags' gradients).
    inv = jnp.moveaxis(inv.reshape(rows.shape), -1, 0)
    gu = jax.lax.scan(lambda acc, i: (acc.at[i].add(g), None),
                      jnp.zeros((n, g.shape[-1]), g.dtype), inv)[0]
    if opt.name == "adagrad":
        sq = row_sq_sum(jnp.sum(gu * gu, axis=-1)) / cols_total
        acc = state["acc"].at[uniq].add(sq, mode="drop")
        a = acc.at[uniq].get(mode="fill", fill_value=1.0)
        upd = -lr * gu / (jnp.sqrt(a)[:, None] + opt.eps)
        return buf.at[uniq].add(upd, mode="drop"), {"acc": acc}
    t = (step + 1).astype(jnp.float32)
    m = state["m"].at[uniq].get(mode="fill", fill_value=0.0) * opt.b1 + (1 - opt.b1) * gu
    v = state["v"].at[uniq].get(mode="fill", fill_value=0.0) * opt.b2 + (1 - opt.b2) * gu * gu
    mhat = m / (1 - opt.b1 ** t)
    vhat = v / (1 - opt.b2 ** t)
    upd = -lr * mhat / (jnp.sqrt(vhat) + opt.eps)
    return (buf.at[uniq].add(upd, mode="drop"),
            {"m": state["m"].at[uniq].set(m, mode="drop"),
             "v": state["v"].at[uniq].set(v, mode="drop")})


def sparse_update(lay: Layout, mesh: Mesh, opt: SparseOpt, buffers: dict, state: dict,
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
            new_b[kind], new_s[kind] = _apply(opt, bufs[kind], st[kind], rows, here, g, lr,
                                              step, row_sq_sum, cols_total)
        return new_b, new_s

    return jax.shard_map(
        body, mesh=mesh,
        in_specs=(specs, state_specs, P(None, ax, None), P(None, ax, None), P(), P()),
        out_specs=(specs, state_specs), check_vma=False)(buffers, state, ids, grads, lr, step)
