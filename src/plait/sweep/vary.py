"""`plait sweep --vary KEY=V1,V2`: settings besides the mesh to try on every shape.

On one device the mesh has a single shape, yet what fits and runs fastest still
turns on settings: rematerialisation, gradient accumulation, the loss in pieces.
Each value is checked as `--set` checks it (one line for an unknown key or a bad
value), every combination of the values given is checked as a whole, and the sweep
crosses each combination with every shape it allows.
"""

from __future__ import annotations

import functools
import itertools
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from plait.errors import UserError

# What the sweep itself chooses: the mesh, and the task's own settings per shape.
_PIPELINE = ("the sweep tries each pipeline schedule and microbatch count itself "
             "(--schedules picks the schedules)")
CHOSEN_BY_THE_SWEEP = {"mesh": "--devices and the sweep choose the mesh",
                       "pipeline.schedule": _PIPELINE, "pipeline.microbatches": _PIPELINE,
                       "pipeline.virtual_stages": _PIPELINE,
                       "embedding.sharding": "the sweep tries each embedding placement itself"}


def _split(text: str) -> list[str]:
    """V1,V2,... split at the commas outside brackets and quotes (a value may be a list)."""
    out, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(text[start:i])
            start = i + 1
    return [v.strip() for v in [*out, text[start:]] if v.strip()]


def _refused(key: str) -> str | None:
    for prefix, why in CHOSEN_BY_THE_SWEEP.items():
        if key == prefix or key.startswith(prefix + "."):
            return why
    return None


def combinations(path: str | Path, sets: list[str], texts: list[str]
                 ) -> list[dict[str, Any]]:
    """The settings to try, one dict per combination of the `--vary` values (with the
    experiment's `--set`s applied), each value as the validated config holds it; [{}]
    for no `--vary`."""
    from plait.config_files import load_experiment

    def load(assignments: list[str]):  # an error names --vary KEY, as the user wrote it
        keys = [a.split("=", 1)[0] for a in assignments]
        return load_experiment(path, [*sets, *assignments],
                               said={k: f"--vary {k}" for k in keys})

    values: dict[str, list[str]] = {}
    for text in texts:
        key, eq, rest = text.partition("=")
        key = key.strip()
        if not eq or not key or not _split(rest):
            raise UserError(f"--vary expects KEY=V1,V2,..., got {text!r} (e.g. --vary "
                            "model.remat=none,full)")
        if key in values:
            raise UserError(f"--vary {key} is given twice; list all its values in one --vary")
        if why := _refused(key):
            raise UserError(f"--vary {key}: {why}")
        values[key] = list(dict.fromkeys(_split(rest)))
        for v in values[key]:
            load([f"{key}={v}"])  # a bad value named alone, before any combination
    combos = []
    for picked in itertools.product(*values.values()):
        exp = load([f"{k}={v}" for k, v in zip(values, picked, strict=True)])
        combo = {k: functools.reduce(getattr, k.split("."), exp) for k in values}
        for k, v in combo.items():
            if isinstance(v, BaseModel):
                raise UserError(f"--vary {k} is a table; vary the keys in it instead "
                                f"(e.g. --vary {k}.{next(iter(type(v).model_fields))}=...)")
        combos.append(combo)
    if len({repr(sorted(c.items())) for c in combos}) < len(combos):
        raise UserError(f"--vary gives the same setting twice (e.g. {texts[0]!r} spells one "
                        "value two ways); list each value once")
    return combos
