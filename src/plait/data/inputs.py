"""Input files named on a command line (plait data's documents, Criteo days). A quoted
glob stands for the files it matches in natural order -- day_2 before day_10, as a
person numbers them (a shell's sort puts day_10 first) -- the order they are read in."""

from __future__ import annotations

import glob
import os
import re

RECORD_SUFFIXES = (".jsonl", ".json", ".parquet")  # plait data's documents
# Names of text or of records, never of a token file (plait data refuses to write one
# so named; where one is read, such a name is said to be text).
TEXT_SUFFIXES = (".txt", ".md", ".csv", ".tsv", *RECORD_SUFFIXES)


def matches(pattern: str) -> list[str]:
    """The files `pattern` names; [] for a glob that matches none. A name that only
    looks like a glob (`run[1].jsonl`, an existing file) is itself."""
    if not glob.has_magic(pattern):
        return [pattern]
    found = sorted(glob.glob(pattern), key=natural)
    if not found and os.path.exists(pattern):
        return [pattern]
    return found


def natural(name: str) -> list:
    """A sort key reading each run of digits as a number."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]
