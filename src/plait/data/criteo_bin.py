"""Criteo click logs converted once into column files that training memory-maps.

`plait data criteo DAY.tsv[.gz] ... --out DIR` parses each day file once
into one *part* of DIR:

    DIR/manifest.json          {"format": "plait-criteo-1", "parts": [...]}
    DIR/<part>/labels.u8       uint8 [rows]
    DIR/<part>/dense.f32       float32 [rows, 13]   log(max(x, 0) + 1), as the TSV reader
    DIR/<part>/sparse.u32      uint32 [rows, 26]    the raw 32-bit hex values

The categorical values stay raw and are hashed modulo each table's rows at
read time (one vectorised modulo per batch), so one conversion serves any
`model.embedding_rows`. A part is written under DIR/.partial-<part>/ and
renamed when whole, then listed in the manifest: an interrupted conversion
leaves no half part behind, and rerunning the same command converts only the
days not yet listed (a listed day whose source changed size is converted
again). Lines that do not parse are skipped and counted, or stop the
conversion with one line naming the file and line (`--malformed stop`).

`data.source = "criteo_bin"` with `data.path = DIR` reads the parts in
manifest order as one dataset: sample r of step k is row (k x batch + r) mod
rows, read by slicing the memory maps, so each process reads only its rows,
nothing is parsed while training, and a resumed run reads exactly what the
uninterrupted one would.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from plait import output_paths
from plait.data.inputs import matches
from plait.errors import UserError
from plait.progress import Display

FORMAT = "plait-criteo-1"
DENSE, CATEGORICAL = 13, 26
FIELDS = 1 + DENSE + CATEGORICAL
COLUMNS = {"labels": (np.uint8, ()), "dense": (np.float32, (DENSE,)),
           "sparse": (np.uint32, (CATEGORICAL,))}
FILES = {"labels": "labels.u8", "dense": "dense.f32", "sparse": "sparse.u32"}
CHUNK = 65536  # lines parsed before each write


def _open(path: Path):
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def parse_line(line: bytes) -> tuple[int, list[int], list[int]]:
    """(label, 13 integers, 26 raw categorical values) of one TSV line; ValueError if the
    line is not a Criteo line."""
    fields = line.rstrip(b"\r\n").split(b"\t")
    if len(fields) != FIELDS:
        raise ValueError(f"{len(fields)} fields, expected {FIELDS}")
    label = int(fields[0] or b"0")
    if label not in (0, 1):
        raise ValueError(f"label {label} is not 0 or 1")
    dense = [int(x or b"0") for x in fields[1:1 + DENSE]]
    cats = [int(x or b"0", 16) for x in fields[1 + DENSE:]]
    if any(c >> 32 for c in cats) or any(c < 0 for c in cats):
        raise ValueError("a categorical value is not a 32-bit hex number")
    return label, dense, cats


def _part_name(source: Path) -> str:
    name = source.name
    for suffix in (".gz", ".tsv", ".txt"):
        name = name.removesuffix(suffix)
    return name


# ASCII byte -> hex digit value; 254 marks numpy's right padding, 255 a non-hex byte.
_HEX = np.full(256, 255, np.uint8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX[_c] = 10 + _i
_HEX[0] = 254


def _fast_columns(lines: list[bytes]) -> dict[str, np.ndarray]:
    """A chunk of well-formed lines parsed column-wise by numpy (ValueError if any line is
    not well formed: the caller then parses the chunk line by line)."""
    blob = b"".join(lines).replace(b"\r\n", b"\n")
    if not blob.endswith(b"\n"):
        blob += b"\n"
    raw = np.frombuffer(blob, np.uint8)
    ends = np.flatnonzero(raw == 10)
    if len(ends) != len(lines):
        raise ValueError("a line break inside a line")
    starts = np.concatenate([[0], ends[:-1] + 1])
    if (np.add.reduceat((raw == 9).astype(np.int32), starts) != FIELDS - 1).any():
        raise ValueError("a line with another field count")
    # One C-level split of the whole chunk: [lines x fields] byte strings.
    table = np.array(blob[:-1].replace(b"\n", b"\t").split(b"\t")).reshape(len(lines), FIELDS)
    table[table == b""] = b"0"
    labels = table[:, 0].astype(np.int64)
    if ((labels != 0) & (labels != 1)).any():
        raise ValueError("a label that is not 0 or 1")
    dense = table[:, 1:1 + DENSE].astype(np.int64)
    cats = table[:, 1 + DENSE:]
    if cats.dtype.itemsize > 8 and (np.char.str_len(cats) > 8).any():
        raise ValueError("a categorical value longer than 8 hex digits")
    digits = _HEX[cats.astype("S8").view(np.uint8).reshape(len(lines), CATEGORICAL, 8)]
    if (digits == 255).any():
        raise ValueError("a categorical value that is not hex")
    value = np.zeros((len(lines), CATEGORICAL), np.uint64)
    for i in range(8):
        d = digits[:, :, i]
        value = np.where(d != 254, value * 16 + d, value)
    return {"labels": labels.astype(np.uint8),
            "dense": np.log(np.maximum(dense, 0).astype(np.float64) + 1).astype(np.float32),
            "sparse": value.astype(np.uint32)}


def _slow_columns(lines: list[bytes], first: int, source: Path, malformed: str,
                  counts: dict) -> dict[str, np.ndarray] | None:
    """The same, line by line: skips (counts) or stops at the lines that do not parse."""
    labels, dense, sparse = [], [], []
    for number, line in enumerate(lines, first):
        try:
            label, d, c = parse_line(line)
        except ValueError as e:
            if malformed == "stop":
                raise UserError(f"{source}: line {number} is malformed ({e}); fix it or "
                                "convert with --malformed skip") from None
            counts["skipped"] += 1
            continue
        labels.append(label)
        dense.append(d)
        sparse.append(c)
    if not labels:
        return None
    d64 = np.asarray(dense, np.float64)
    return {"labels": np.asarray(labels, np.uint8),
            "dense": np.log(np.maximum(d64, 0) + 1).astype(np.float32),
            "sparse": np.asarray(sparse, np.uint32)}


def _chunks(source: Path, malformed: str, counts: dict) -> Iterator[dict[str, np.ndarray]]:
    first, lines = 1, []
    with _open(source) as f:
        for line in f:
            counts["bytes"] += len(line)
            lines.append(line)
            if len(lines) == CHUNK:
                yield from _parse(lines, first, source, malformed, counts)
                first, lines = first + len(lines), []
    if lines:
        yield from _parse(lines, first, source, malformed, counts)


def _parse(lines, first, source, malformed, counts) -> Iterator[dict[str, np.ndarray]]:
    try:
        yield _fast_columns(lines)
    except ValueError:
        chunk = _slow_columns(lines, first, source, malformed, counts)
        if chunk is not None:
            yield chunk


def _manifest(out: Path) -> dict:
    path = out / "manifest.json"
    if not path.is_file():
        return {"format": FORMAT, "parts": []}
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path} is unreadable ({e}); delete {out} and convert again") from None
    if manifest.get("format") != FORMAT:
        raise UserError(f"{path} is not a plait Criteo directory ({manifest.get('format')!r}); "
                        "pick another --out")
    return manifest


def convert(sources: list[str], out: str, malformed: str = "skip",
            report: Callable[[str], None] = print) -> dict:
    """Convert Criteo TSV day files into `out`; returns the manifest."""
    paths = [Path(s) for s in _expanded(sources)]
    for p in paths:
        if p.is_dir():
            raise UserError(f"'{p}' is a directory; pass its Criteo TSV day files (.tsv or "
                            f".gz, or a quoted glob such as '{p}/day_*')")
        if not p.is_file():
            raise UserError(f"'{p}' not found; pass Criteo TSV day files (.tsv or .gz)")
    names = [_part_name(p) for p in paths]
    if len(set(names)) != len(names):
        raise UserError("two inputs have the same name; rename one (each becomes a part)")
    dest = output_paths.directory(out, "--out")
    manifest = _manifest(dest)
    for source, name in zip(paths, names, strict=True):
        size = source.stat().st_size
        done = next((p for p in manifest["parts"] if p["name"] == name), None)
        if done and done["source_size"] == size and (dest / name).is_dir():
            report(f"plait: {source.name}: already converted ({done['rows']:,} rows), skipped")
            continue
        if done:
            manifest["parts"].remove(done)
        part = _convert_one(source, dest, name, malformed, size, report)
        manifest["parts"].append(part)
        tmp = dest / "manifest.json.tmp"
        tmp.write_text(json.dumps(manifest, indent=1))
        os.replace(tmp, dest / "manifest.json")
    return manifest


def _expanded(sources: list[str]) -> list[str]:
    """Each source; a quoted glob as the files it matches (data.inputs: day_2 before
    day_10, the parts' order)."""
    out = []
    for s in sources:
        found = matches(s)
        if not found:
            raise UserError(f"'{s}' matches no file; pass Criteo TSV day files (.tsv or .gz)")
        out.extend(found)
    return out


def _convert_one(source: Path, dest: Path, name: str, malformed: str, size: int,
                 report: Callable[[str], None]) -> dict:
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    partial = dest / f".partial-{name}"
    shutil.rmtree(partial, ignore_errors=True)  # what an interrupted run left
    partial.mkdir()
    counts = {"rows": 0, "skipped": 0, "bytes": 0}
    t0 = time.perf_counter()
    # A gzip file's size is compressed bytes: its bar counts uncompressed ones.
    total = None if source.suffix == ".gz" else size
    with contextlib.ExitStack() as stack:
        files = {k: stack.enter_context(open(partial / f, "wb")) for k, f in FILES.items()}
        shown = stack.enter_context(Display(
            TextColumn(f"plait: {source.name}"), BarColumn(), DownloadColumn(),
            TransferSpeedColumn(), TimeRemainingColumn()))
        task = shown.bar.add_task("convert", total=total)
        for chunk in _chunks(source, malformed, counts):
            for key, f in files.items():
                f.write(np.ascontiguousarray(chunk[key]).tobytes())
            counts["rows"] += len(chunk["labels"])
            shown.bar.update(task, completed=counts["bytes"])
            if shown.due():
                read = counts["bytes"] / 2**20
                shown.say(f"plait data: {source.name}: {counts['rows']:,} rows, {read:,.0f} "
                          + (f"of {total / 2**20:,.0f} " if total else "") + "MiB read "
                          f"({read / shown.elapsed:,.0f} MiB/s)")
    if counts["rows"] == 0:
        shutil.rmtree(partial)
        raise UserError(f"{source}: no line parses as a Criteo line; check the file")
    final = dest / name
    shutil.rmtree(final, ignore_errors=True)
    os.replace(partial, final)
    seconds = time.perf_counter() - t0
    report(f"plait: {source.name}: {counts['rows']:,} rows in {seconds:.1f}s "
           f"({counts['rows'] / max(seconds, 1e-9):,.0f} rows/s)"
           + (f", {counts['skipped']:,} malformed lines skipped" if counts["skipped"] else ""))
    return {"name": name, "source": str(source), "source_size": size, "rows": counts["rows"],
            "skipped": counts["skipped"]}


class CriteoBinary:
    """A converted Criteo directory read by memory map: sample r of step k is row
    (k x batch + r) mod rows of the parts in manifest order."""

    def __init__(self, path: str, rows: list[int], batch: int, what: str = "data.path"):
        root = Path(path)
        if not (root / "manifest.json").is_file():
            raise UserError(f"{what} '{path}' is not a converted Criteo directory (no "
                            "manifest.json); make one with: plait data criteo DAY.tsv --out "
                            f"{path}")
        if len(rows) != CATEGORICAL:
            raise UserError(f"a Criteo file has {CATEGORICAL} categorical fields; "
                            f"model.embedding_rows lists {len(rows)} tables")
        manifest = _manifest(root)
        if not manifest["parts"]:
            raise UserError(f"{what} '{path}' holds no converted day; convert one into it")
        self.rows_per_table = np.asarray(rows, np.uint32)
        self.batch = batch
        self.parts = []
        for part in manifest["parts"]:
            n = part["rows"]
            cols = {}
            for key, (dtype, shape) in COLUMNS.items():
                file = root / part["name"] / FILES[key]
                want = n * int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
                if not file.is_file() or file.stat().st_size != want:
                    raise UserError(f"{file} is missing or truncated; convert "
                                    f"{part['source']} again into {path}")
                cols[key] = np.memmap(file, dtype=dtype, mode="r", shape=(n, *shape))
            self.parts.append(cols)
        self.starts = np.cumsum([0] + [p["rows"] for p in manifest["parts"]])
        self.total = int(self.starts[-1])

    def _slice(self, first: int, n: int) -> dict[str, np.ndarray]:
        """n consecutive rows from global row `first` (no wrap)."""
        out: dict[str, list] = {k: [] for k in COLUMNS}
        while n:
            i = int(np.searchsorted(self.starts, first, side="right")) - 1
            lo = first - int(self.starts[i])
            take = min(n, int(self.starts[i + 1]) - first)
            for k in COLUMNS:
                out[k].append(self.parts[i][k][lo:lo + take])
            first, n = first + take, n - take
        return {k: np.concatenate(v) for k, v in out.items()}

    def rows(self, step: int, start: int, stop: int) -> dict[str, np.ndarray]:
        first = (step * self.batch + start) % self.total
        n = stop - start
        pieces = []
        while n:  # wraps around the end of the dataset
            take = min(n, self.total - first)
            pieces.append(self._slice(first, take))
            first, n = 0, n - take
        cols = {k: np.concatenate([p[k] for p in pieces]) for k in COLUMNS}
        ids = (cols["sparse"] % self.rows_per_table).astype(np.int32)
        return {"dense": np.ascontiguousarray(cols["dense"]), "ids": ids[:, :, None],
                "labels": cols["labels"].astype(np.float32)}
