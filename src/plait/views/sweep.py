"""`plait sweep`'s outputs: the ranked table, sweep.csv / sweep.json, and sweep.png."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from plait.views.common import console, pyplot

COLUMNS = ["rank", "mesh", "pipeline_schedule", "pipeline_microbatches", "embedding_sharding",
           "embedding_kinds", "tensor_mode", "varied",
           "predicted_step_s", "predicted_units_per_s", "compute_s", "comm_s",
           "comm_across_nodes_s", "bubble_ratio", "flops_per_device", "collective_bytes",
           "collective_bytes_across_nodes", "memory_bytes", "fits", "measured_step_s",
           "measured_error"]


def write_outputs(rows: list[dict], out: Path, meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "sweep.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({**{k: r.get(k, "") for k in COLUMNS}, "varied": varied_of(r)})
    (out / "sweep.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    plot(rows, out / "sweep.png", meta)


def layout_of(r: dict) -> str:
    """What besides the mesh tells two rows apart: the pipeline's schedule and
    microbatches, or the embedding tables' placement; "" for neither."""
    if r.get("pipeline_schedule"):
        return f"{r['pipeline_schedule']} N={r['pipeline_microbatches']}"
    return f"tables {r['embedding_kinds']}" if r.get("embedding_sharding") else ""


def varied_of(r: dict) -> str:
    """The `--vary` settings of a row, as KEY=VALUE; "" for none."""
    from plait.sweep.shapes import settings_text

    return settings_text(r.get("varied") or {})


def label_of(r: dict) -> str:
    """A row's name: mesh, layout and `--vary` settings."""
    return " ".join(x for x in (r["mesh"], layout_of(r), varied_of(r)) if x)


def plot(rows: list[dict], path: Path, meta: dict, top: int = 25) -> None:
    plt = pyplot()
    shown = rows[:top]
    labels = [label_of(r) for r in shown]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 0.32 * len(shown) + 1.6), sharey=True)
    y = list(range(len(shown)))
    colors = ["#4c72b0" if r["fits"] else "#c44e52" for r in shown]
    ax1.barh(y, [r["compute_s"] for r in shown], color=colors, label="compute")
    ax1.barh(y, [r["predicted_step_s"] - r["compute_s"] for r in shown],
             left=[r["compute_s"] for r in shown], color="#dd8452",
             label="communication + bubble" + (" + fitted overheads" if meta.get("calibration")
                                               else ""))
    measured = [(i, r["measured_step_s"]) for i, r in enumerate(shown) if r.get("measured_step_s")]
    if measured:
        ax1.scatter([m for _, m in measured], [i for i, _ in measured], marker="D", s=14,
                    color="black", zorder=3, label="measured (--run)")
    ax1.set_yticks(y, labels, fontsize=7)
    ax1.invert_yaxis()
    ax1.set_xlabel("step time (s)")
    # Below the axes: inside, it hid the top rows' bars and measured marks.
    ax1.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.32 if len(shown) < 8
                                                                else -0.08), ncol=3)
    ax2.barh(y, [r["memory_bytes"] / 2**30 for r in shown], color=colors)
    ax2.axvline(meta["device_memory_bytes"] / 2**30, color="black", linestyle="--", linewidth=1)
    # Logarithmic: a small model's bars stay visible beside the device's memory.
    ax2.set_xscale("log")
    from matplotlib.ticker import FuncFormatter

    plain = FuncFormatter(lambda v, _: f"{v:g}")  # 40, not 4 x 10^1
    ax2.xaxis.set_major_formatter(plain)
    # Bars start at the axis's left end: well below the smallest, so lengths compare.
    gib = [r["memory_bytes"] / 2**30 for r in shown] + [meta["device_memory_bytes"] / 2**30]
    ax2.set_xlim(left=min(gib) / 4)
    if math.log10(max(gib) / (min(gib) / 4)) < 2:  # minor labels overlap over more decades
        ax2.xaxis.set_minor_formatter(plain)
        ax2.tick_params(axis="x", which="minor", labelsize=7)
    ax2.set_xlabel("memory per device (GiB, log scale)\ndashed: device memory; red: does not fit")
    fig.suptitle(f"{meta['experiment']} on {meta['devices']} x {meta['hardware']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(rows: list[dict], meta: dict) -> None:
    from rich.table import Table

    c = console()
    t = Table(title=f"{meta['experiment']}: {meta['devices']} devices, predicted on "
                    f"{meta['hardware']} (sweep {meta['sweep_s']:.0f}s)")
    kinds = {("pipeline" if r.get("pipeline_schedule") else "tables") for r in rows
             if layout_of(r)}
    # No layout column where no row has one (one device; a sweep of --vary settings).
    layout = next(iter(kinds)) if len(kinds) == 1 else "layout" if kinds else None
    varied = any(r.get("varied") for r in rows)
    cols = ["rank", "mesh", *([layout] if layout else []), *(["settings"] if varied else []),
            "tensor", "step s",
            f"{meta.get('unit', 'units')}/s", "compute s", "comm s", "across nodes s",
            "bubble", "GiB/device", "fits"]
    if any("measured_step_s" in r for r in rows):  # failures said on stderr as they ran
        cols.append("measured s")
    for col in cols:
        # the mesh whole, the other columns narrower: cut to "data=2,pipeline=2,tens…",
        # data=2,pipeline=2,tensor=2 and data=2,pipeline=2,fsdp=2 looked alike
        t.add_column(col, justify="left" if col in ("mesh", layout, "settings", "tensor")
                     else "right",
                     min_width=max((len(r["mesh"]) for r in rows), default=4)
                     if col == "mesh" else max(len(varied_of(r)) for r in rows)
                     if col == "settings" else None)
    for r in rows:
        cells = [str(r["rank"]), r["mesh"], *([layout_of(r) or "-"] if layout else []),
                 *([varied_of(r) or "-"] if varied else []), r["tensor_mode"],
                 f"{r['predicted_step_s']:.4g}", f"{r['predicted_units_per_s']:,.0f}",
                 f"{r['compute_s']:.3g}", f"{r['comm_s']:.3g}",
                 f"{r.get('comm_across_nodes_s', 0.0):.3g}", f"{r['bubble_ratio']:.3f}",
                 f"{r['memory_bytes'] / 2**30:.2f}", "yes" if r["fits"] else "[red]no[/red]"]
        if "measured s" in cols:
            m = r.get("measured_step_s")
            cells.append(f"{m:.4g}" if m else "[red]failed[/red]" if "measured_error" in r
                         else "")
        t.add_row(*cells)
    c.print(t)


def render_calibration(rows: list[dict], fit: dict) -> None:
    """The overheads `--run` fitted, and each measured shape's model, calibrated and
    measured step beside its rank and layout (one mesh runs under several schedules)."""
    print(f"plait: overheads fitted to the {fit['measured_shapes']} measured shapes on "
          f"these devices: {fit['per_step_s'] * 1e3:.3g} ms per step + "
          f"{fit['per_kernel_s'] * 1e6:.3g} us per kernel"
          + (f" + {fit['per_pipelined_step_s'] * 1e3:.3g} ms per pipelined step"
             if fit.get("per_pipelined_step_s") else "")
          + ", added to every prediction "
          "(they describe the machine measured, whatever --hardware says)")
    for r in [r for r in rows if r.get("measured_step_s")]:
        rounds = r.get("measured_rounds_s") or []
        spread = (f", {len(rounds)} rounds {min(rounds) * 1e3:.3f}-{max(rounds) * 1e3:.3f} ms"
                  if len(rounds) > 1 else "")
        print(f"  {r['rank']:>4} {label_of(r):<40} model {r['model_step_s'] * 1e3:8.3f} ms, "
              f"calibrated {r['predicted_step_s'] * 1e3:8.3f} ms, measured "
              f"{r['measured_step_s'] * 1e3:8.3f} ms ({r['kernels']:,.0f} kernels{spread})")
