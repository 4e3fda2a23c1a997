"""Where a command will write, checked before its work starts.

An evaluation, a sweep or a tokenizing pass can take minutes; a plot, a JSON file or a
directory it writes at the end must not then fail as a traceback (a path under a file,
a directory where a file goes) and lose that work. Each is refused in one line before
the work, and the directories it needs are made then, as `plait train` makes its run
directory."""

from __future__ import annotations

from pathlib import Path

from plait.errors import UserError


def directory(path: str | Path, flag: str) -> Path:
    """`path`, a directory a command fills (`flag` names it to the user), made now with
    its parents."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag} '{path}' is a file, not a directory; pass a directory (it "
                        "is made if missing)")
    _make(path, f"{flag} '{path}'", flag)
    return path


def file(path: str | Path, flag: str, suffix: str) -> Path:
    """`path`, a file a command writes when its work is done (`suffix`: what such a file's
    name ends in): not a directory, and the directory it goes in made now."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{flag} '{path}' is a directory; pass a file's name (e.g. "
                        f"'{path / ('out' + suffix)}')")
    parent(path, flag)
    return path


def picture(path: str | Path, flag: str) -> Path:
    """`file` for a plot: its name's suffix is the picture's format (matplotlib's: .png,
    .svg, .pdf ...; none is a PNG), checked now rather than by savefig after the work."""
    from matplotlib.backend_bases import FigureCanvasBase

    path = file(path, flag, ".png")
    kinds = FigureCanvasBase.get_supported_filetypes()
    if path.suffix and path.suffix[1:].lower() not in kinds:
        raise UserError(f"{flag} '{path}': a picture is written in the format its name ends "
                        f"in, and '{path.suffix}' is none (.png, .svg, .pdf, .jpg ...); name "
                        f"it e.g. '{path.with_suffix('.png')}'")
    return path


def parent(path: Path, flag: str) -> None:
    """The directory `path` goes in, made now with its parents."""
    _make(path.parent, f"the directory of {flag} '{path}'", flag)


def _make(path: Path, what: str, flag: str) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise UserError(f"cannot make {what}: a part of its path is a file; pass another "
                        f"{flag}") from None
    except OSError as e:
        raise UserError(f"cannot make {what}: {(e.strerror or str(e)).lower()}; pass "
                        f"another {flag}") from None
