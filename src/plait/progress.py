"""How far a long command is (plait import, plait export): a bar rich redraws on a
terminal (stderr, gone when done); off one (logs, nohup), where rich draws nothing, a
line every 10 s, so a command that ends sooner says nothing extra."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

EVERY_S = 10.0


class Ticker:
    """`total` units of work in `label` ("plait import: converting"), `shown` writes an
    amount (e.g. bytes as GiB)."""

    def __init__(self, label: str, total: float, shown: Callable[[float], str] = str):
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        self.label, self.total, self.shown, self.done = label, total, shown, 0.0
        self.lines = not sys.stderr.isatty()
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(),
                            TextColumn("{task.fields[amount]}"), TimeRemainingColumn(),
                            transient=True, console=Console(stderr=True), disable=self.lines)
        self.t0 = self.said = time.monotonic()

    def __enter__(self) -> Ticker:
        self.bar.__enter__()
        self.task = self.bar.add_task(self.label, total=self.total, amount=self._amount())
        return self

    def __exit__(self, *exc) -> None:
        self.bar.__exit__(*exc)

    def _amount(self) -> str:
        return f"{self.shown(self.done)} of {self.shown(self.total)}"

    def advance(self, amount: float = 1.0) -> None:
        self.done += amount
        self.bar.update(self.task, completed=self.done, amount=self._amount())
        now = time.monotonic()
        if self.lines and now - self.said >= EVERY_S:
            self.said = now
            print(f"{self.label}: {self._amount()} ({now - self.t0:.0f}s)", file=sys.stderr,
                  flush=True)

    def phase(self, label: str) -> None:
        """A step after the counted work (writing what was made): the bar says it; off a
        terminal, a line if the work so far was long enough to have said anything."""
        self.bar.update(self.task, description=label)
        if self.lines and time.monotonic() - self.t0 >= EVERY_S:
            print(f"{label} ...", file=sys.stderr, flush=True)
