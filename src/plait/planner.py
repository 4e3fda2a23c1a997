"""The embedding planner: a sharding kind (and owner) per table, from a stated cost model.

Per table of R rows, dimension d, L ids per bag, global batch B, over P devices,
with s bytes of optimizer state per row (SGD 0, row-wise Adagrad 4, Adam 8d):

  kind        memory per device          lookup work per device   collectives per step
  replicated  R(4d + s)                  B/P x L x d              all-gather of B x d grads
  table       R(4d + s) on the owner     B x L x d on the owner   2 all-to-alls of B x d
  row         R/P (4d + s)               B x L x d (masked)       reduce-scatter + all-gather
  column      R/P (4d + s)               B x L x d/P              2 all-to-alls of B x d

(plus an all-gather of the B x L ids for all but replicated). Collectives move
about the same bytes for every kind but replicated, so the planner trades memory
against lookup work and balance:

1. tables of at most `embedding.replicate_below_mib` (with optimizer state) are
   replicated: no forward communication, and memory they barely use;
2. the rest are placed whole (table-wise), largest first on the least-loaded
   device, as long as the busiest device then holds at most 1.25x the average
   bytes AND does at most 1.25x the average lookup work (B x L x d per table it
   owns: fewer tables than devices, or a remainder, leave devices idle);
3. while either is exceeded, the largest table is split instead: column-wise
   when P divides d (each device gathers d/P of every row), else row-wise.

`embedding.sharding` other than auto, and `embedding.overrides` per table, replace
the planner's choice.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.config import Experiment
from plait.errors import UserError
from plait.parallel.embedding import TableLayout
from plait.parallel.sparse_optim import OPTIMIZERS
from plait.views.common import size_text

BALANCE = 1.25  # table-wise while the busiest device holds at most this x the average


@dataclass
class TablePlan:
    layout: TableLayout
    why: list[str]  # per table: why this kind

    def per_device_bytes(self, opt: str) -> list[int]:
        return self.layout.per_device_table_bytes(opt)


def plan_tables(exp: Experiment, devices: int, axes: tuple[str, ...]) -> TablePlan:
    m, e = exp.model, exp.embedding
    rows, d, Pn = m.table_rows, m.embedding_dim, devices
    T = len(rows)
    overrides: dict[int, str] = {}
    for key, kind in e.overrides.items():
        try:
            t = int(key)
        except ValueError:
            t = -1
        if not 0 <= t < T:
            raise UserError(f"embedding.overrides names table '{key}', but the model has {T} "
                            f"tables (0 to {T - 1}); use their indices")
        overrides[t] = kind
    per_row = TableLayout(tuple(rows), d, ("replicated",) * T, Pn, axes).row_bytes(e.optimizer)
    size = [r * per_row for r in rows]
    kinds: list[str | None] = [None] * T
    why = [""] * T
    for t in range(T):
        if t in overrides:
            kinds[t], why[t] = overrides[t], "embedding.overrides"
        elif e.sharding != "auto":
            kinds[t], why[t] = e.sharding, "embedding.sharding"
        elif Pn == 1 or size[t] <= e.replicate_below_mib * 2**20:
            kinds[t] = "replicated"
            why[t] = "one device" if Pn == 1 else f"at most {e.replicate_below_mib:g} MiB"
    for t, k in enumerate(kinds):
        if k == "column" and d % Pn:
            raise UserError(f"table {t} is column-wise but model.embedding_dim = {d} does not "
                            f"split over {Pn} devices; choose row or table for it")
    # Table-wise where the devices stay balanced: place the candidates largest first on
    # the least-loaded device (LPT); while the busiest device holds more than
    # BALANCE x the average, split the largest candidate instead, and try again.
    asked = [t for t in range(T) if kinds[t] == "table"]
    free = sorted((t for t in range(T) if kinds[t] is None), key=lambda t: -size[t])
    lookups = exp.data.ids_per_lookup  # per bag, every table alike
    while True:
        load = [0] * Pn
        work = [0] * Pn
        owners = [-1] * T
        for t in sorted(asked + free, key=lambda t: -size[t]):
            p = min(range(Pn), key=lambda i: (load[i], work[i]))
            owners[t] = p
            load[p] += size[t]
            work[p] += lookups
        total, total_work = sum(load), sum(work)
        if not free or total == 0 or (max(load) <= BALANCE * total / Pn
                                      and max(work) <= BALANCE * total_work / Pn):
            break
        t = free.pop(0)
        kinds[t] = "column" if d % Pn == 0 else "row"
        why[t] = ("whole, it would leave the devices unbalanced: by "
                  + ("columns" if kinds[t] == "column" else f"rows ({Pn} does not divide "
                                                            f"dim {d})"))
    for t in free:
        kinds[t], why[t] = "table", "whole, on the least-loaded device"
    owners = [o if kinds[t] == "table" else -1 for t, o in enumerate(owners)]
    lay = TableLayout(tuple(rows), d, tuple(kinds), Pn, axes, tuple(owners))
    return TablePlan(lay, why)


def check_memory(plan: TablePlan, opt: str, budget: float, dense_bytes: int) -> None:
    """One line naming the table and the bytes missing where a device's share does not fit."""
    lay = plan.layout
    per = plan.per_device_bytes(opt)
    worst = max(range(lay.devices), key=lambda p: per[p])
    need = per[worst] + dense_bytes
    if need <= budget:
        return
    share = [lay.table_bytes_on(t, worst, opt) for t in range(len(lay.rows))]
    t = max(range(len(share)), key=lambda i: share[i])
    raise UserError(
        f"table {t} ({lay.rows[t]:,} rows x {lay.dim}, {lay.kinds[t]}) does not fit: device "
        f"{worst} needs {size_text(need)} of {size_text(budget)} "
        f"({size_text(need - budget)} missing); shard it (row or column) over more "
        "devices, cap model.max_embedding_rows, or use sgd (no optimizer state)")


def row_traffic_per_device(lay: TableLayout, opt: str, batch: int, ids_per_bag: int) -> float:
    """Bytes of table rows the busiest device moves per step: the gathers of the bags, and
    the reads and writes of every updated row and its optimizer fields."""
    gather = lay.dim * 4
    update = OPTIMIZERS[opt].update_bytes_per_id(lay.dim)
    ids, P = batch * ids_per_bag, lay.devices
    load = [0.0] * P
    for t, kind in enumerate(lay.kinds):
        if kind == "table":
            load[lay.owners[t]] += ids * (gather + update)
            continue
        for p in range(P):
            if kind == "replicated":  # local bags; every replica applies every update
                load[p] += ids / P * gather + ids * update
            elif kind == "row":  # every id is checked on every device, 1/P of them are here
                load[p] += ids * gather + ids / P * update
            else:  # column: every id, 1/P of each row
                load[p] += ids * (gather + update) / P
    return max(load)
