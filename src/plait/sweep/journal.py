"""A sweep's journal: the figures of each compiled program, appended as it is read.

A large sweep compiles for most of an hour (mixtral-8x7b over 64 devices: ~700
programs); a kill, a lost machine or a bug that ends plait must not throw away what
was compiled. Each program's figures go to `<out>/programs.jsonl` as they arrive,
and a sweep into the same directory reads back those of its own programs instead of
compiling them again. "Its own": the same experiment, device count, node size and
kernel counting, compiled by the same plait and JAX sources; anything else in the
file is dropped when it is opened. Figures, not predictions, are kept, so a rerun
with other `--hardware` of the same node size prices again without compiling.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from plait.config import Experiment

NAME = "programs.jsonl"


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


class Journal:
    """Figures by program key for one sweep identity, read from and appended to a file."""

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
                    self.entries[entry["program"]] = entry
                    kept.append(line)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(line + "\n" for line in kept))

    def get(self, key: tuple) -> tuple[dict | None, float] | None:
        """(figures, seconds) of a program journaled before (figures None: XLA aborted
        compiling it), or None if it was not."""
        entry = self.entries.get(repr(key))
        if entry is None:
            return None
        return _decode(entry["figures"]), entry["compile_s"]

    def add(self, key: tuple, label: str, figures: dict | None, seconds: float) -> None:
        entry = {"sweep": self.identity, "program": repr(key), "label": label,
                 "figures": _encode(figures), "compile_s": seconds}
        line = json.dumps(entry, default=_scalar)
        self.entries[entry["program"]] = json.loads(line)
        with open(self.path, "a") as f:
            f.write(line + "\n")
