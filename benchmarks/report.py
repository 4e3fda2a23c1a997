"""The one way a benchmark script hands back its figures: JSON on stdout, and the same
text in the file --json names (benchmarks/results/ keeps those)."""

from __future__ import annotations

import json
from pathlib import Path


def report(result: dict, json_path: str | Path | None) -> None:
    """Print `result` as indented JSON; with a path, write the same text there."""
    text = json.dumps(result, indent=2)
    print(text)
    if json_path:
        Path(json_path).write_text(text + "\n")
