"""What every benchmark script shares at its edges: the one way it hands back its
figures (JSON on stdout, and the same text in the file --json names; benchmarks/results/
keeps those), and the one way it ends (a mistake of the user's, or a run plait refuses,
as plait's own commands end it: one line, no traceback)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path


def report(result: dict, json_path: str | Path | None) -> None:
    """Print `result` as indented JSON; with a path, write the same text there."""
    text = json.dumps(result, indent=2)
    print(text)
    if json_path:
        Path(json_path).write_text(text + "\n")


def run_script(main: Callable[[], int | None]) -> None:
    """Run a script's `main` and exit with its status; a plait UserError (a bad key, fp8
    asked of a CPU) ends in one line and status 2, as with `plait` itself
    (`plait.errors.reported`). A script stops at the first such error: a benchmark that
    refuses one of its runs has no figure to give."""
    from plait.errors import reported

    raise SystemExit(reported(Path(sys.argv[0]).name, main))
