"""`plait plan`: a DLRM's embedding plan and each device's memory, without compiling."""

from __future__ import annotations

import json

from jax.sharding import Mesh
from rich.console import Console
from rich.table import Table

from plait.config import Experiment


def _mib(x: float) -> str:
    from plait.planner import size_text

    return size_text(x)


def plan_report(exp: Experiment, mesh: Mesh) -> dict:
    from plait.train.dlrm_job import DLRMJob

    job = DLRMJob(exp, mesh)
    lay, opt = job.lay, job.opt_name
    tables = []
    for t, (rows, kind) in enumerate(zip(lay.rows, lay.kinds, strict=True)):
        where = (f"device {lay.owners[t]}" if kind == "table" else
                 "every device" if kind == "replicated" else f"{lay.devices} devices")
        on = lay.owners[t] if kind == "table" else 0
        tables.append({"table": t, "rows": rows, "dim": lay.dim, "kind": kind, "where": where,
                       "bytes": rows * lay.row_bytes(opt),
                       "bytes_per_device": lay.table_bytes_on(t, on, opt),
                       "why": job.plan.why[t]})
    dense = job.dense_bytes
    per_device = [b + dense for b in job.plan.per_device_bytes(opt)]
    return {"experiment": exp.name, "devices": lay.devices, "axes": list(lay.axes),
            "optimizer": opt, "tables": tables, "dense_state_bytes": dense,
            "device_bytes": per_device, "budget_bytes": job.memory_budget}


def render_plan(exp: Experiment, mesh: Mesh, as_json: bool) -> None:
    r = plan_report(exp, mesh)
    if as_json:
        print(json.dumps(r))
        return
    c = Console(highlight=False)
    t = Table(title=f"{r['experiment']}: embedding plan over {r['devices']} devices "
                    f"({','.join(r['axes'])}), {r['optimizer']} on the tables")
    for col in ("table", "rows", "kind", "where", "size", "per device", "why"):
        t.add_column(col, justify="right" if col in ("table", "rows", "size", "per device")
                     else "left")
    for x in r["tables"]:
        t.add_row(str(x["table"]), f"{x['rows']:,}", x["kind"], x["where"], _mib(x["bytes"]),
                  _mib(x["bytes_per_device"]), x["why"])
    c.print(t)
    m = Table(title=f"memory per device (tables + optimizer state + dense state; budget "
                    f"{_mib(r['budget_bytes'])})")
    m.add_column("device", justify="right")
    m.add_column("bytes", justify="right")
    m.add_column("", justify="left")
    top = max(r["device_bytes"]) or 1
    for i, b in enumerate(r["device_bytes"]):
        m.add_row(str(i), _mib(b), "#" * max(1, round(30 * b / top)))
    c.print(m)
