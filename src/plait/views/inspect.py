"""`plait inspect`'s views: the compiled step's figures, and the tensor-mode comparison."""

from __future__ import annotations

from rich.table import Table

from plait import analysis
from plait.views.common import clip_shape, console, size_text


def render_comparison(name: str, rows: list[dict]) -> None:
    c = console(150)
    t = Table(title=f"{name}: tensor modes, per device per step")
    for col in ("mode", "mesh", "tensor-axis bytes (HLO)", "formula", "HLO/formula",
                "all collectives", "weights", "temp (activations)", "compile"):
        t.add_column(col, justify="left" if col in ("mode", "mesh") else "right")
    unmodelled = set()
    for r in rows:
        if "error" in r:
            t.add_row(r["mode"], r["mesh"], f"[red]{r['error']}[/red]", *[""] * 6)
            continue
        formula = r["tensor_formula_bytes"]
        if formula is None:
            unmodelled.add(r["tensor_formula_unmodelled"])
            shown, ratio = "-", "-"
        else:
            shown = size_text(formula)
            ratio = f"{r['tensor_wire_bytes'] / formula:.3f}" if formula else "nan"
        t.add_row(r["mode"], r["mesh"], size_text(r["tensor_wire_bytes"]), shown, ratio,
                  size_text(r["wire_bytes"]), size_text(r["param_bytes_per_device"]),
                  size_text(r["temp_bytes"]), f"{r['compile_s']:.0f}s")
    c.print(t)
    for what in sorted(unmodelled):
        c.print(f"no formula: the tensor modes' formulas do not model {what}")


def render(r: dict) -> None:
    c = console()
    c.print(f"[bold]{r['experiment']}[/bold] on mesh {r['mesh']} ({r['devices']} "
            f"{r['platform']} devices), {r['parameters'] / 1e6:.2f}M parameters, "
            f"{r['units_per_step']:,} {r['unit']}/step, compiled in {r['compile_s']:.1f}s")
    for note in r.get("notes") or []:
        c.print(note)
    if r.get("model_flops_per_device"):
        c.print(f"FLOPs per device per step: {r['flops_per_device']:.4g} from the HLO matmuls "
                f"(model FLOPs {r['model_flops_per_device']:.4g})")
    if r.get("tables"):  # a DLRM's embedding tables
        kinds = ", ".join(f"t{x['table']} {x['kind']}" for x in r["tables"])
        c.print(f"tables: {kinds}; largest collective {size_text(r['largest_collective_bytes'])} "
                f"against a largest table of {size_text(r['largest_table_bytes'])}")
    if r.get("pipeline"):
        p = r["pipeline"]
        c.print(f"pipeline {p['schedule']}: {p['stages']} stages, {p['microbatches']} "
                f"microbatches, bubble {p['bubble']:.3f}, {p['ticks']} ticks, peak in flight "
                f"{p['peak_inflight']}; executor slots per rank: stash "
                f"{p.get('stash_slots_per_rank')}"
                + (f", keep {p['keep_slots_per_rank']}" if any(p.get('keep_slots_per_rank') or [])
                   else ""))
    if "tensor_formula_bytes" in r:
        formula = (f" (formula {size_text(r['tensor_formula_bytes'])})"
                   if r["tensor_formula_bytes"] is not None else
                   f" (no formula for {r['tensor_formula_unmodelled']})")
        c.print(f"tensor mode {r['tensor_mode']}: {size_text(r['tensor_wire_bytes'])} over tensor "
                f"axes per device per step{formula}; parameters "
                f"{size_text(r['param_bytes_per_device'])} per device")
    if r.get("context"):
        x = r["context"]
        parts = ", ".join(f"{size_text(b)} {k}" for k, b in x["wire_bytes"].items()) or "none"
        if x["formula_bytes"] is None:
            c.print(f"context axis {x['size']} ({x['attention']} attention): {parts} over it "
                    "per device per step (no formula for a pipeline)")
        else:
            want = ", ".join(f"{size_text(b)} {k}" for k, b in x["formula_bytes"].items())
            c.print(f"context axis {x['size']} ({x['attention']} attention): {parts} over it "
                    f"per device per step (attention formula {want}; the all-reduces also "
                    "carry the weight gradients' sum over the axis)")
    if r.get("experts"):
        x = r["experts"]
        if x["formula_bytes"] is None:
            kinds = "all-gather and reduce-scatter" if x.get("dispatch") == "all-gather" \
                else "all-to-all"
            c.print(f"expert axis {x['size']}: {size_text(x['wire_bytes'])} of {kinds} over "
                    "it per device per step (no formula for a pipeline)")
        elif x.get("dispatch") == "all-gather":
            c.print(f"expert axis {x['size']}: {size_text(x['wire_bytes'])} of all-gather and "
                    f"reduce-scatter over it per device per step (formula "
                    f"{size_text(x['formula_bytes'])}: the tokens gathered to every expert "
                    "rank and the outputs summed back, forward and backward; dropless)")
        else:
            c.print(f"expert axis {x['size']}: {size_text(x['wire_bytes'])} of all-to-all over "
                    f"it per device per step (formula {size_text(x['formula_bytes'])}: the "
                    "dispatch buffer to the experts and back, forward and backward)")
    if r.get("phases"):
        names = list(r["phases"])
        ph = Table(title="wire bytes per device, by kind of step and mesh axes")
        ph.add_column("axes")
        for name in names:
            ph.add_column(name.replace("_", " "), justify="right")
        axes = sorted({a for p in r["phases"].values() for a in p["wire_by_axes"]})
        for a in axes:
            ph.add_row(a, *(size_text(r["phases"][n]["wire_by_axes"].get(a, 0.0))
                            for n in names))
        c.print(ph)
    if r.get("hosts", 1) > 1 or "link_seconds" in r:
        c.print(link_table(r))
    if r["wire_by_axes"]:
        ax = Table(title="wire bytes per device per step, by mesh axes")
        ax.add_column("axes")
        ax.add_column("bytes", justify="right")
        for axes, b in r["wire_by_axes"].items():
            ax.add_row(axes, size_text(b))
        c.print(ax)
    t = Table(title="collectives per device per step")
    for col in ("kind", "bytes", "wire bytes (ring)"):
        t.add_column(col, justify="right" if col != "kind" else "left")
    for kind in analysis.COLLECTIVE_KINDS:
        t.add_row(kind, size_text(r["collectives"][kind]), size_text(r["collectives_wire"][kind]))
    c.print(t)
    if r["collective_ops"]:
        ops = Table(title="largest collective ops")
        hosts = r.get("hosts", 1) > 1
        for col in ("kind", "shape", "axes", "group", *(["link"] * hosts), "count", "bytes"):
            ops.add_column(col)
        for op in r["collective_ops"][:12]:
            link = ["across hosts" if op.get("crosses_hosts") else "within host"] * hosts
            ops.add_row(op["kind"], clip_shape(op["shape"]), ",".join(op["axes"]) or "-",
                        str(op["group_size"]), *link, f"{op['count']:g}",
                        size_text(op["bytes"]))
        c.print(ops)
    m = r["memory"]
    if m:
        mt = Table(title="memory per device")
        mt.add_column("kind")
        mt.add_column("bytes", justify="right")
        for key in ("argument_bytes", "output_bytes", "temp_bytes", "alias_bytes", "total_bytes"):
            mt.add_row(key.removesuffix("_bytes"), size_text(m[key]))
        c.print(mt)


def link_table(r: dict) -> Table:
    """Collective bytes per device by the links they cross (per kind of step, where
    steps differ), and their time on the --hardware given."""
    parts = {"step": r, **{k.replace("_", " "): v for k, v in r.get("phases", {}).items()}}
    priced = "link_seconds" in r
    title = f"collectives per device per step by link ({r.get('hosts', 1)} hosts"
    title += f"; time on {r['hardware']})" if priced else ")"
    t = Table(title=title)
    t.add_column("link")
    for name in parts:
        t.add_column(f"{name} bytes", justify="right")
        t.add_column(f"{name} wire", justify="right")
        if priced:
            t.add_column(f"{name} time", justify="right")
    for link in analysis.LINKS:
        cells = []
        for p in parts.values():
            cells += [size_text(p["bytes_by_link"][link]), size_text(p["wire_by_link"][link])]
            if priced:
                cells.append(f"{p['link_seconds'][link] * 1e3:.3g} ms")
        t.add_row(link.replace("_", " "), *cells)
    return t
