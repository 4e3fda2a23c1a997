"""Helpers every view uses: a console that does not wrap when piped, sizes in words,
and matplotlib without a display."""

from __future__ import annotations


def size_text(x: float) -> str:
    """Bytes in the largest binary unit that keeps the number at least 1."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if x >= scale:
            return f"{x / scale:,.2f} {unit}"
    return f"{x:,.0f} bytes"


def console(width: int = 160):
    """A rich console: the terminal's width, or `width` columns when piped (so tables
    keep their rows instead of wrapping a word per line)."""
    from rich.console import Console

    c = Console(highlight=False, soft_wrap=True)
    return c if c.is_terminal else Console(highlight=False, width=width, soft_wrap=True)


def pyplot():
    """matplotlib.pyplot on the Agg backend (files, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def clip_shape(text: str, width: int = 48) -> str:
    """An HLO shape cut to `width` at a boundary between its parts, never inside one:
    "(f32[16,1024,768], bf16[...])" keeps whole array shapes and ends with "...")."""
    if len(text) <= width:
        return text
    head = text[:width - 3]
    cut = max(head.rfind("], "), head.rfind("},")) + 1  # after a whole shape's ] or }
    if cut <= 0:
        cut = max(head.rfind(","), head.rfind("[")) + 1 or len(head)
    return text[:cut].rstrip(", ") + " ..."
