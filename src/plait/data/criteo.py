"""Criteo click logs (Kaggle / Terabyte TSV): label, 13 integer and 26 hex categorical fields.

Empty fields read as 0; dense features are log(max(x, 0) + 1); categorical
values are hashed modulo their table's rows (so ids never fall outside a
table). Sample r of step k is line (k x batch + r) mod lines, read by offset,
so any process reads only its own rows. A line that does not parse is skipped
(counted, and replaced by the next good line) or stops the run, by
data.malformed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from plait.errors import UserError

DENSE, CATEGORICAL = 13, 26


class CriteoTSV:
    def __init__(self, path: str, rows: list[int], batch: int, malformed: str):
        self.path = Path(path)
        if not self.path.is_file():
            raise UserError(f"data.path '{path}' not found; point it at a Criteo TSV file")
        if len(rows) != CATEGORICAL:
            raise UserError(f"a Criteo file has {CATEGORICAL} categorical fields; "
                            f"model.embedding_rows lists {len(rows)} tables")
        self.rows_per_table = np.asarray(rows, np.int64)
        self.batch, self.malformed = batch, malformed
        self.skipped = 0
        offsets, pos = [], 0
        with open(self.path, "rb") as f:
            for line in f:
                offsets.append(pos)
                pos += len(line)
        if not offsets:
            raise UserError(f"data.path '{path}' is empty")
        self.offsets = np.asarray(offsets, np.int64)

    def parse(self, line: bytes, number: int):
        fields = line.rstrip(b"\r\n").split(b"\t")
        try:
            if len(fields) != 1 + DENSE + CATEGORICAL:
                raise ValueError(f"{len(fields)} fields, expected {1 + DENSE + CATEGORICAL}")
            label = float(int(fields[0] or b"0"))
            dense = np.log(np.maximum([float(int(x or b"0")) for x in fields[1:1 + DENSE]], 0) + 1)
            cats = np.asarray([int(x or b"0", 16) for x in fields[1 + DENSE:]], np.int64)
        except ValueError as e:
            if self.malformed == "stop":
                raise UserError(f"{self.path}: line {number + 1} is malformed ({e}); fix it or "
                                "set data.malformed = \"skip\"") from None
            return None
        return label, dense, cats % self.rows_per_table

    def rows(self, step: int, start: int, stop: int) -> dict[str, np.ndarray]:
        n = stop - start
        dense = np.zeros((n, DENSE), np.float32)
        ids = np.zeros((n, CATEGORICAL, 1), np.int32)
        labels = np.zeros((n,), np.float32)
        total = len(self.offsets)
        with open(self.path, "rb") as f:
            for i, row in enumerate(range(start, stop)):
                number = (step * self.batch + row) % total
                for _ in range(total):
                    f.seek(self.offsets[number])
                    got = self.parse(f.readline(), number)
                    if got is not None:
                        break
                    self.skipped += 1
                    number = (number + 1) % total
                else:
                    raise UserError(f"{self.path}: no line parses; check the file format")
                labels[i], dense[i], ids[i, :, 0] = got
        return {"dense": dense, "ids": ids, "labels": labels}
