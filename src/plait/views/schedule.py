"""`plait schedule`'s views: the lockstep table as text, its figures, and a chart."""

from __future__ import annotations

import json

from plait.parallel import schedules
from plait.views.common import pyplot

MAX_INCHES = (60.0, 40.0)  # a chart's width and height at most (7200 x 4800 pixels)
_COLORS = {"F": "#4c72b0", "B": "#dd8452", "Bx": "#c44e52", "W": "#55a868"}
_NAMES = {"F": "F: forward", "B": "B: backward", "Bx": "Bx: backward, input gradients",
          "W": "W: backward, weight gradients"}
# What the text and the boxes say: "F3" is the forward of microbatch 3; "F3.1" the same on
# the second pipe (Chimera's up pipe), drawn hatched.
NOTATION = ("F3 = forward of microbatch 3 (B backward, Bx its input-gradient half, W its "
            "weight-gradient half); a .1 suffix = the second pipe (Chimera's up pipe), "
            "drawn hatched; . = idle")


def legend(s: schedules.Schedule, numbered: bool = True) -> list[tuple[str, str, str | None]]:
    """(label, colour, hatch) of each legend entry: the actions the table has, the
    second pipe when it has one, and what the numbers in the boxes are (when they are
    drawn: `numbered`)."""
    acts = [a for row in s.table for a in row if a is not None]
    kinds = sorted({a.kind for a in acts}, key=list(_COLORS).index)
    out: list[tuple[str, str, str | None]] = [(_NAMES[k], _COLORS[k], None) for k in kinds]
    if any(a.pipe for a in acts):
        out.append(("second pipe (x.1 in the text)", "white", "//"))
    out.append(("number in a box: microbatch" if numbered
                else "boxes too small to number: microbatches in the text table",
                "white", None))
    return out


def draw(s: schedules.Schedule, path: str) -> None:
    """One row per rank, one box per tick, coloured by action (like the Chimera paper's figures)."""
    from matplotlib.collections import PatchCollection
    from matplotlib.patches import Patch

    plt = pyplot()
    ticks = len(s.table)
    # A box is 0.32 x 0.45 inches until the chart would pass MAX_INCHES: then smaller,
    # and unnumbered once a number would not fit (64 stages x 512 microbatches of 1F1B
    # drew 1150 ticks 370 inches wide with 65k labels: 167 s and 2.2 GB).
    tick_w = min(0.32, (MAX_INCHES[0] - 4.0) / ticks)  # 1.5 of margins, 2.5 of legend
    rank_h = min(0.45, (MAX_INCHES[1] - 1.4) / s.stages)
    numbered = tick_w >= 0.2 and rank_h >= 0.25
    fig, ax = plt.subplots(figsize=(max(6.0, tick_w * ticks + 1.5) + 2.5, rank_h * s.stages + 1.4))
    # One collection of boxes per colour and hatch (the up pipe of Chimera is drawn
    # hatched): with a patch each, a 32-stage ZB-H1 chart took 12.3 s, now 7.4 s.
    boxes: dict[tuple[str, bool], list] = {}
    for t, row in enumerate(s.table):
        for r, a in enumerate(row):
            if a is None:
                continue
            boxes.setdefault((a.kind, bool(a.pipe)), []).append(
                plt.Rectangle((t, r), 0.95, 0.9))
            if numbered:
                ax.text(t + 0.47, r + 0.45, str(a.mb), ha="center", va="center", fontsize=7,
                        color="white")
    for (kind, pipe), rects in boxes.items():
        ax.add_collection(PatchCollection(rects, facecolor=_COLORS[kind], edgecolor=_COLORS[kind],
                                          hatch="//" if pipe else None, alpha=0.9))
    ax.set_xlim(0, ticks)
    ax.set_ylim(s.stages, 0)
    ax.set_yticks([r + 0.45 for r in range(s.stages)], [f"rank {r}" for r in range(s.stages)])
    ax.set_xlabel("tick")
    f = s.figures
    ax.set_title(f"{s.name}: D={s.stages}, N={s.microbatches}"
                 + (f", v={s.virtual}" if s.virtual > 1 else "")
                 + f" - bubble {f['bubble']:.3f}, {f['ticks']} ticks, "
                 f"peak in flight {max(f['peak_inflight'])}")
    handles = [Patch(facecolor=color, edgecolor="black" if hatch else color, hatch=hatch,
                     label=label) for label, color, hatch in legend(s, numbered)]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def timeline(s: schedules.Schedule) -> str:
    """The lockstep table as text: one row per rank, one column per tick."""
    width = max(len(str(a)) for row in s.table for a in row if a is not None) + 1
    lines = []
    for r in range(s.stages):
        cells = [(str(row[r]) if row[r] is not None else ".").ljust(width) for row in s.table]
        lines.append(f"rank {r}: " + "".join(cells).rstrip())
    return "\n".join(lines)


def executor(s: schedules.Schedule, recompute: bool = False) -> dict:
    """What the SPMD executor holds per rank for this table: slots of the stash (a
    microbatch's forward residuals, or its stage input with recompute), of the keep
    (zero-bubble with recompute: what W needs, from Bx to W) and of the inbox; and
    the work per rank, a recomputed forward included, in one stage's forward."""
    from plait.parallel.tick_table import tick_table

    t = tick_table(s, s.num_stages, recompute)
    work = s.figures["work_per_rank"]
    if recompute:
        backs = [sum(1 for a in prog if a.kind in (schedules.B, schedules.BX))
                 for prog in s.programs]
        work = [w + b for w, b in zip(work, backs, strict=True)]
    return {"recompute": recompute, "stash_slots_per_rank": t.held["stash"],
            "keep_slots_per_rank": t.held["keep"], "inbox_slots_per_rank": t.held["inbox"],
            "work_per_rank": work}


def show(s: schedules.Schedule, as_json: bool, png: str | None, recompute: bool = False) -> None:
    """Print the schedule (text or JSON) and draw it into `png`."""
    name, stages, microbatches, virtual = s.name, s.stages, s.microbatches, s.virtual
    if png:
        draw(s, png)
    held = executor(s, recompute)
    if as_json:
        print(json.dumps({**s.figures, "executor": held,
                          "table": [[str(a) if a else None for a in row] for row in s.table]}))
        return
    f = s.figures
    print(timeline(s))
    print(NOTATION)
    print(f"{name}: {stages} stages, {microbatches} microbatches"
          + (f", {virtual} virtual stages" if virtual > 1 else "")
          + f"; bubble {f['bubble']:.4f} of the makespan ({f['bubble_ratio']:.4f} of the "
          f"compute), {f['ticks']} lockstep ticks, peak in flight per rank "
          f"{f['peak_inflight']}" + (f"; drawn to {png}" if png else ""))
    what = "stage inputs" if recompute else "forward residuals"
    print(f"executor slots per rank: {what} {held['stash_slots_per_rank']}"
          + (f", weight-gradient inputs {held['keep_slots_per_rank']}"
             if any(held["keep_slots_per_rank"]) else "")
          + f", messages {held['inbox_slots_per_rank']}; work per rank "
          f"{held['work_per_rank']} (one stage's forward = 1)")
