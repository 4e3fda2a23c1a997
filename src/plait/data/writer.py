"""Token files written as they are made: `plait data` of a text file or of documents.

Ids (and a loss mask) go to temporary files beside OUT a batch at a time, in the
file's own dtype, so the host holds one batch of a corpus, not the corpus (before,
16 bytes a token at the peak, int64 pieces and their concatenation: 160 GB for a
10B-token corpus; docs/benchmarks.md, "plait data memory"). OUT is replaced only when every
part is complete (renamed, the tokenizer and loss mask beside it); a mistake
found on the way or at the end (an empty corpus, a held-out split that keeps
nothing) removes the temporary files and leaves what the user had untouched.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from plait.data.tokenizer import HFTokenizer, drop_sidecar, keep_beside
from plait.data.tokens import index_path, loss_mask_path
from plait.errors import UserError
from plait.progress import Display

CHUNK_BYTES = 1 << 24  # a text file read byte-level 16 MiB at a time
LINES = 1024  # lines encoded together (tokenizers' encode_batch uses every core)


class Status(Display):
    """How far `plait data` is, with rates, as one line (progress.Display: redrawn on a
    terminal, printed every 10 s off one)."""

    def __init__(self):
        from rich.progress import TextColumn, TimeElapsedColumn

        super().__init__(TextColumn("{task.description}"), TimeElapsedColumn())

    def __enter__(self) -> Status:
        super().__enter__()
        self.task = self.bar.add_task("")
        return self

    def show(self, docs: int | None, tokens: int, name: str, read: tuple[int, int] | None = None
             ) -> None:
        """`docs` documents (None: a text file, `read` = (bytes read, its size)) and
        `tokens` tokens so far, tokenized with `name`."""
        took = max(self.elapsed, 1e-9)
        done = (f"{docs:,} documents" if docs is not None
                else f"{read[0] / 2**20:,.0f} of {read[1] / 2**20:,.0f} MiB")
        rate = (f"{docs / took:,.0f} docs/s, " if docs is not None else "")
        line = (f"tokenizing with {name}: {done}, {tokens:,} tokens ({rate}"
                f"{tokens / took:,.0f} tokens/s)")
        self.bar.update(self.task, description=line)
        if self.due():
            self.say(f"plait data: {line}")


class TokenWriter:
    """One token file (its loss mask, its document index) written a batch at a time;
    published with `publish`, or discarded (on an exception inside `with`, or by
    `discard`)."""

    def __init__(self, path: str | Path, dtype: str, source: str, masked: bool = False,
                 indexed: bool = False):
        self.path, self.dtype, self.source = Path(path), dtype, source
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        self.mask_tmp = loss_mask_path(self.tmp) if masked else None
        self.index_tmp = index_path(self.tmp) if indexed else None
        self._ids = self.tmp.open("wb")
        self._mask = self.mask_tmp.open("wb") if self.mask_tmp else None
        self._index = self.index_tmp.open("wb") if self.index_tmp else None
        self.tokens = self.kept = self.documents = 0

    def __enter__(self) -> TokenWriter:
        return self

    def __exit__(self, kind, *_) -> None:
        if kind is not None:
            self.discard()

    def append(self, ids: np.ndarray | list[int], mask: np.ndarray | list[int] | None = None,
               starts: list[int] | None = None) -> None:
        """`ids` (and their loss mask) after what was written; `starts`: where in `ids` the
        documents they hold start."""
        ids = np.asarray(ids)
        if ids.size and int(ids.max()) > np.iinfo(self.dtype).max:
            raise UserError(f"token id {int(ids.max())} does not fit in {self.dtype}; use "
                            "uint32")
        ids.astype(self.dtype).tofile(self._ids)
        if self._index is not None:
            (self.tokens + np.asarray(starts, np.int64)).astype("<i8").tofile(self._index)
            self.documents += len(starts)
        self.tokens += int(ids.size)
        if self._mask is not None:
            mask = np.asarray(mask, np.uint8)
            mask.tofile(self._mask)
            self.kept += int(np.count_nonzero(mask))

    def close(self) -> None:
        for f in (self._ids, self._mask, self._index):
            if f is not None and not f.closed:
                f.close()

    def discard(self) -> None:
        self.close()
        for tmp in (self.tmp, self.mask_tmp, self.index_tmp):
            if tmp is not None:
                tmp.unlink(missing_ok=True)

    def check_not_empty(self) -> None:
        """No tokens at all is a user's mistake (an empty corpus): nothing is written."""
        if self.tokens == 0:
            self.discard()
            raise UserError(f"{self.source} gives no tokens (it is empty); nothing was "
                            f"written to {self.path}; pass a file with text in it")

    def publish(self, tok: HFTokenizer | None) -> int:
        """Replace OUT by what was written, with the tokenizer that made the ids beside it
        (byte-level: any older one removed), the loss mask and the document index (none:
        any older one removed, so a file written again is not read by stale ones);
        returns the tokens."""
        self.check_not_empty()
        self.close()
        self.tmp.replace(self.path)
        if tok is not None:
            keep_beside(tok, self.path)
        else:
            drop_sidecar(self.path)
        for tmp, side in ((self.mask_tmp, loss_mask_path(self.path)),
                          (self.index_tmp, index_path(self.path))):
            if tmp is not None:
                tmp.replace(side)
            else:
                side.unlink(missing_ok=True)
        return self.tokens


def write_tokens(ids: np.ndarray, out_path: str | Path, dtype: str = "uint16",
                 source: str = "the input") -> int:
    """Write ids as a flat binary (atomically); no tokens at all is a user's mistake and
    nothing is written. Leaves any tokenizer or mask beside OUT as it is."""
    with TokenWriter(out_path, dtype, source) as w:
        w.append(ids)
        w.check_not_empty()
        w.close()
        w.tmp.replace(w.path)
        return w.tokens


def held_out_path(out_path: str | Path) -> Path:
    """Where `--held-out` writes what it holds out: OUT.bin -> OUT.val.bin."""
    out = Path(out_path)
    return out.with_name(f"{out.stem}.val{out.suffix}")


def encode_text_file(text_path: str | Path, out_path: str | Path, dtype: str = "uint16",
                     tokenizer: str | Path | None = None, held_out: float = 0.0
                     ) -> list[int]:
    """Tokenize a UTF-8 text file into a flat binary of ids; returns how many (and, with
    `held_out`, how many of the text's last tokens went to OUT.val.bin instead).

    Without `tokenizer`: byte-level (ids 0-255, no vocabulary file). With a
    tokenizer.json: its ids, the text encoded line by line (each line with its
    newline, LINES lines at a time), and a copy of the tokenizer kept beside the
    output. Either way the text is read and written a piece at a time.
    """
    text_path = Path(text_path)
    if not text_path.is_file():
        raise UserError(f"text file '{text_path}' not found; check the path")
    tok = HFTokenizer(tokenizer) if tokenizer is not None else None
    if tok is not None and tok.vocab_size - 1 > np.iinfo(dtype).max:
        raise UserError(f"{tok.name} has {tok.vocab_size:,} ids, more than {dtype} holds; "
                        "use --dtype uint32")
    source = f"text file '{text_path}'"
    size, done = text_path.stat().st_size, 0
    with TokenWriter(out_path, dtype, source) as w, text_path.open("rb") as f, \
            Status() as status:
        while True:
            if tok is None:
                chunk = f.read(CHUNK_BYTES)
                ids = np.frombuffer(chunk, np.uint8)
            else:
                lines = [line for _, line in zip(range(LINES), f, strict=False)]
                chunk = b"".join(lines)
                encoded = tok.encode_lines(_utf8(lines, done, text_path))
                ids = np.fromiter((i for line_ids in encoded for i in line_ids), np.int64)
            if not chunk:
                break
            w.append(ids)
            done += len(chunk)
            status.show(None, w.tokens, tok.name if tok else "bytes", (done, size))
        w.close()
        return _split_tail(w, held_out, tok)


def _utf8(lines: list[bytes], offset: int, path: Path) -> list[str]:
    """Lines of bytes as text; a byte that is not UTF-8 named at its place in the file
    (`offset`: where the first line starts)."""
    try:
        return [line.decode("utf-8") for line in lines]
    except UnicodeDecodeError:
        try:
            b"".join(lines).decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"text file '{path}' is not UTF-8 ({e.reason} at byte "
                            f"{offset + e.start}); convert it first") from None
        raise


def _split_tail(w: TokenWriter, held_out: float, tok: HFTokenizer | None) -> list[int]:
    """Publish OUT, and with `held_out` the last part of the text in OUT.val.bin (a text
    file's lines run on into each other: a contiguous tail, as nanoGPT's prepare scripts
    hold out), moved there from the end of what was written."""
    n = w.tokens
    cut = n - int(round(n * held_out))
    if held_out and n and not 0 < cut < n:  # (none at all: publish says so)
        w.discard()
        raise UserError(f"--held-out {held_out} of {n} tokens leaves "
                        f"{'none' if cut == n else 'nothing to train on'}; nothing "
                        "was written; choose another fraction")
    if not held_out or not n:
        return [w.publish(tok)]
    itemsize = np.dtype(w.dtype).itemsize
    with TokenWriter(held_out_path(w.path), w.dtype, w.source) as tail:
        written = np.memmap(w.tmp, dtype=w.dtype, mode="r")
        for start in range(cut, n, CHUNK_BYTES):
            tail.append(written[start:min(start + CHUNK_BYTES, n)])
        del written
        os.truncate(w.tmp, cut * itemsize)
        w.tokens = cut
        return [w.publish(tok), tail.publish(tok)]
