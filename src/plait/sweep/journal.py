"""A sweep's journal: the figures of each compiled program, appended as it is read.

A large sweep compiles for most of an hour (mixtral-8x7b over 64 devices: ~700
programs); a kill, a lost machine or a bug that ends plait must not throw away what
was compiled. Each program's figures go to `<out>/programs.jsonl` as they arrive,
and a sweep into the same directory reads back those of its own programs instead of
compiling them again. "Its own": the same experiment, device count, node size and
kernel counting, compiled by the same plait and JAX sources; anything else in the
file is dropped when it is opened. Figures, not predictions, are kept, so a rerun
with other `--hardware` of the same node size prices again without compiling.

`--run` keeps its measurements the same way, in `<out>/runs.jsonl`: training every
top shape of moe-tiny's 8-device sweep takes 25 minutes here, and a rerun (or one
with a larger `--top` or more `--run-rounds`) trains only the shapes and rounds not yet
measured by the same plait on the same machine.
"""

from __future__ import annotations

import hashlib
import json
import platform
from pathlib import Path

from plait.config import Experiment

NAME = "programs.jsonl"
RUNS = "runs.jsonl"


def sources_digest() -> str:
    """What compiled the figures: plait's and JAX's versions and plait's own sources."""
    import jax

    import plait

    h = hashlib.sha256(f"{plait.__version__} {jax.__version__}".encode())
    root = Path(plait.__file__).parent
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def sweep_identity(exp: Experiment, n: int, per_node: int | None, kernels: bool) -> str:
    text = json.dumps([exp.model_dump(mode="json"), n, per_node, kernels, sources_digest()],
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def run_identity(exp: Experiment, n: int, steps: int) -> str:
    """What a measured step time depends on: the experiment, the devices, the steps timed,
    plait's sources and the machine measured."""
    import jax

    machine = [platform.node(), jax.devices()[0].device_kind, jax.device_count()]
    text = json.dumps([exp.model_dump(mode="json"), n, steps, sources_digest(), machine],
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _encode(figures: dict | None) -> dict | None:
    if figures is None:
        return None
    groups = [[*key, *value] for key, value in figures["groups"].items()]
    return {**figures, "groups": groups}


def _decode(figures: dict | None) -> dict | None:
    if figures is None:
        return None
    groups = {(k, axes, g, cross): [count, nbytes]
              for k, axes, g, cross, count, nbytes in figures["groups"]}
    return {**figures, "groups": groups}


def _scalar(x):
    """numpy scalars as Python numbers (float repr round-trips exactly through JSON)."""
    return x.item()


class _Lines:
    """The entries of one identity in a JSON-lines file, by key: read once (the others,
    and a line a kill cut short, dropped from the file), then appended to."""

    def __init__(self, path: Path, identity: str, fresh: bool = False):
        self.path = path
        self.identity = identity
        self.entries: dict[str, dict] = {}
        kept: list[str] = []
        if path.exists() and not fresh:
            for line in path.read_text().splitlines():
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:  # the line a kill cut short
                    continue
                if isinstance(entry, dict) and entry.get("sweep") == identity:
                    self.entries[entry["key"]] = entry
                    kept.append(line)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(line + "\n" for line in kept))

    def _append(self, key: str, **fields) -> None:
        line = json.dumps({"sweep": self.identity, "key": key, **fields}, default=_scalar)
        self.entries[key] = json.loads(line)
        with open(self.path, "a") as f:
            f.write(line + "\n")


class Journal(_Lines):
    """Figures by program key for one sweep identity."""

    def get(self, key: tuple) -> tuple[dict | None, float] | None:
        """(figures, seconds) of a program journaled before (figures None: XLA aborted
        compiling it), or None if it was not."""
        entry = self.entries.get(repr(key))
        if entry is None:
            return None
        return _decode(entry["figures"]), entry["compile_s"]

    def add(self, key: tuple, label: str, figures: dict | None, seconds: float) -> None:
        self._append(repr(key), label=label, figures=_encode(figures), compile_s=seconds)


def _shape_key(row: dict, round_: int) -> str:
    return json.dumps([row["mesh"], row.get("settings") or {}, round_], sort_keys=True)


class Measured(_Lines):
    """`--run`'s median step times by shape (mesh and settings) and round, for one run
    identity: a rerun with more `--run-rounds` measures only the rounds not yet kept. A
    shape that failed to run is not kept: a rerun tries it again."""

    def get(self, row: dict, round_: int) -> float | None:
        entry = self.entries.get(_shape_key(row, round_))
        return None if entry is None else entry["measured_step_s"]

    def add(self, row: dict, round_: int, label: str, step_s: float) -> None:
        self._append(_shape_key(row, round_), label=label, round=round_, measured_step_s=step_s)
