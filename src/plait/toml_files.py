"""Reading a TOML file, with one-line errors: the bottom floor that mesh, hardware and
experiment files all stand on (it imports nothing of plait but its errors)."""

from __future__ import annotations

import sys
from pathlib import Path

from plait.errors import UserError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def read_toml(path: Path, what: str) -> dict:
    """The file's table; a directory, a missing file, bytes that are not text or text
    that is not TOML are one line naming `what` it was meant to be."""
    if path.is_dir():
        raise UserError(f"{what} '{path}' is a directory; pass a .toml file in it")
    if not path.is_file():
        raise UserError(f"{what} '{path}' not found; check the path")
    try:  # utf-8-sig: a byte-order mark (Windows editors write one) is not TOML's
        return tomllib.loads(path.read_text(encoding="utf-8-sig"))
    except UnicodeDecodeError:
        raise UserError(f"{what} '{path}' is not a text file (not UTF-8); pass a TOML "
                        "file") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{what} '{path}' is not valid TOML: {e}") from None
