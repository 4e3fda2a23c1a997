"""`plait plan`: a DLRM's embedding plan and each device's memory, without compiling."""

from __future__ import annotations

import json

from rich.table import Table

from plait.views.common import console, size_text


def render_plan(r: dict, as_json: bool) -> None:
    """The plan (DLRMTask.plan_report) as a table and each device's memory as bars."""
    if as_json:
        print(json.dumps(r))
        return
    c = console()
    t = Table(title=f"{r['experiment']}: embedding plan over {r['devices']} devices "
                    f"({','.join(r['axes'])}), {r['optimizer']} on the tables")
    for col in ("table", "rows", "kind", "where", "size", "per device", "why"):
        t.add_column(col, justify="right" if col in ("table", "rows", "size", "per device")
                     else "left")
    for x in r["tables"]:
        t.add_row(str(x["table"]), f"{x['rows']:,}", x["kind"], x["where"], size_text(x["bytes"]),
                  size_text(x["bytes_per_device"]), x["why"])
    c.print(t)
    m = Table(title=f"memory per device (tables + optimizer state + dense state; budget "
                    f"{size_text(r['budget_bytes'])})")
    m.add_column("device", justify="right")
    m.add_column("bytes", justify="right")
    m.add_column("", justify="left")
    top = max(r["device_bytes"]) or 1
    for i, b in enumerate(r["device_bytes"]):
        m.add_row(str(i), size_text(b), "#" * max(1, round(30 * b / top)))
    c.print(m)
