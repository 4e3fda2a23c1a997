"""How far a long command is, one way for every command: a rich display on stderr when
it is a terminal (redrawn, gone when done); off one (logs, nohup, CI), where rich would
draw nothing but a stray blank line, no display and a printed line now and then
instead. stdout keeps only the command's results (a report piped to a file gets no
progress in it)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

EVERY_S = 10.0  # off a terminal, a line at most this often (a quicker command says none)


class Display:
    """A rich Progress of `columns` on a terminal; `lines` is True where the caller's
    lines replace it. `shown=False` (a process that does not report, a job too short
    to need it) shows neither."""

    def __init__(self, *columns, shown: bool = True):
        from rich.console import Console
        from rich.progress import Progress

        self.lines = shown and not sys.stderr.isatty()
        self.bar = Progress(*columns, transient=True, console=Console(stderr=True),
                            disable=not shown or self.lines)
        self.t0 = self.said = time.monotonic()

    def __enter__(self) -> Display:
        self.bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.bar.__exit__(*exc)

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def due(self) -> bool:
        """Whether a line is due off a terminal (EVERY_S since the last one); counts it."""
        now = time.monotonic()
        if not self.lines or now - self.said < EVERY_S:
            return False
        self.said = now
        return True

    def say(self, line: str) -> None:
        """Print a line off a terminal (on one, the display shows it instead)."""
        if self.lines:
            print(line, file=sys.stderr, flush=True)


class Ticker(Display):
    """`total` units of work in `label` ("plait import: converting") with a bar; `shown`
    writes an amount (e.g. bytes as GiB)."""

    def __init__(self, label: str, total: float, shown: Callable[[float], str] = str):
        from rich.progress import BarColumn, TextColumn, TimeRemainingColumn

        super().__init__(TextColumn("{task.description}"), BarColumn(),
                         TextColumn("{task.fields[amount]}"), TimeRemainingColumn())
        self.label, self.total, self.shown, self.done = label, total, shown, 0.0

    def __enter__(self) -> Ticker:
        super().__enter__()
        self.task = self.bar.add_task(self.label, total=self.total, amount=self._amount())
        return self

    def _amount(self) -> str:
        return f"{self.shown(self.done)} of {self.shown(self.total)}"

    def advance(self, amount: float = 1.0) -> None:
        self.done += amount
        self.bar.update(self.task, completed=self.done, amount=self._amount())
        if self.due():
            self.say(f"{self.label}: {self._amount()} ({self.elapsed:.0f}s)")

    def phase(self, label: str) -> None:
        """A step after the counted work (writing what was made): the bar says it; off a
        terminal, a line if the work so far was long enough to have said anything."""
        self.bar.update(self.task, description=label)
        if self.elapsed >= EVERY_S:
            self.say(f"{label} ...")
