"""Progress goes to stderr, a display on a terminal and lines off one, and never into
stdout, which holds a command's results (plait sweep's table, plait eval's report): a
bar rich drew on stdout left blank lines in a report piped to a file."""

import sys

import pytest
import sweep_abort as sa

from plait import progress
from plait.sweep.run import _compile_all

MESHES = ["data=2", "fsdp=2"]


def _compile(monkeypatch, terminal: bool) -> list:
    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)
    return list(_compile_all(None, 2, [[sa.Shape(m)] for m in MESHES], 1, True,
                             measure=sa.measure, init=sa.init))


def test_on_a_terminal_the_display_is_on_stderr(monkeypatch, capsys):
    assert len(_compile(monkeypatch, terminal=True)) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "compiling" in err  # rich's redrawn line


@pytest.mark.parametrize("every_s", [progress.EVERY_S, 0.0])
def test_off_a_terminal_only_lines_are_printed(monkeypatch, capsys, every_s):
    monkeypatch.setattr(progress, "EVERY_S", every_s)
    _compile(monkeypatch, terminal=False)
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == ["plait sweep: compiled 1/2 data=2 (0.0s)",
                                "plait sweep: compiled 2/2 fsdp=2 (0.0s)"]
    with progress.Display() as shown:
        assert not shown.due() if every_s else shown.due()
        shown.say("said")
    out, err = capsys.readouterr()
    assert (out, err) == ("", "said\n")
