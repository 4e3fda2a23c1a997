"""File-backed token datasets: a flat binary of uint16/uint32 ids (nanoGPT style).

Row r of step k starts at an offset drawn from (seed, k, r), so any process can
read exactly its rows with no shared state, and a resumed run on any mesh sees
the same batches.

A loss mask beside the file (OUT.bin.loss_mask, one byte per token, 1 where the
model learns to predict the token: `plait data --prompt-field` writes it, 0 on
each prompt) travels into the batch as ~id for the tokens the loss leaves out
(plait.loss_mask).

A document index beside it (OUT.bin.documents, the int64 offset where each
document starts, written by `plait data` for JSON Lines / Parquet records) lets
rows start where documents start (data.row_start): row r of step k then starts
at the document drawn from (seed, k, r) and runs on into the next ones, so a
fine-tuning example is seen from its beginning, prompt included.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from plait.data.inputs import TEXT_SUFFIXES
from plait.data.tokenizer import HFTokenizer, sidecar
from plait.errors import UserError
from plait.loss_mask import DOC_START

MASK_SUFFIX = ".loss_mask"
INDEX_SUFFIX = ".documents"


class TokenFile:
    def __init__(self, path: str | Path, dtype: str, seq_len: int, seed: int, vocab: int,
                 key: str = "data.path", spare: int = 1, row_start: str = "auto",
                 document_mask: bool = False, dtype_key: str = "data.dtype"):
        """`spare`: tokens the file must hold past one window of seq_len + 1 (random
        offsets need one; consecutive windows, plait eval's, none). `row_start`
        (data.row_start): rows start "anywhere", at a "document" start, or "auto"
        (at documents where the file has a loss mask and an index: fine-tuning
        records). `document_mask`: each token that starts a document carries DOC_START
        (plait.loss_mask), from the file's document index. `dtype_key`: where the user
        sets `dtype`, for the messages."""
        path = Path(path)
        if not path.is_file():
            raise UserError(
                f"data file '{path}' not found ({key}); make one with `plait data TEXT_FILE "
                f"{path}` or fix {key}" if str(path) not in ("", ".") else
                "data.source = \"tokens\" needs data.path, a token file; make one with "
                "`plait data TEXT_FILE data/tokens.bin` and set data.path to it"
            )
        itemsize = np.dtype(dtype).itemsize
        size = path.stat().st_size
        if size % itemsize:
            raise UserError(_text_given(path, key) or
                f"data file '{path}' is {size} bytes, not a whole number of {dtype} tokens; "
                f"check {dtype_key}"
            )
        need = seq_len + 1 + spare
        if size // itemsize < max(need, 1):  # an empty file cannot even be mapped
            raise UserError(
                f"data file '{path}' ({key}) holds {size // itemsize} tokens, fewer than "
                f"model.seq_len + {1 + spare} = {need}; use a longer file or shorter "
                "sequences"
            )
        self.path, self.tokens = path, np.memmap(path, dtype=dtype, mode="r")
        self.seq_len, self.seed, self.vocab, self.key = seq_len, seed, vocab, key
        self.dtype, self.dtype_key = dtype, dtype_key
        self.mask = _read_mask(path, len(self.tokens), key)
        self.row_start = resolve_row_start(path, row_start, key)
        if document_mask and not index_path(path).is_file():
            raise UserError(f"data.document_mask needs the document index beside '{path}' "
                            f"({key}), which plait data writes for JSON Lines / Parquet "
                            "records; make the file that way or set data.document_mask = "
                            "false")
        index = (_read_index(path, len(self.tokens), key)
                 if document_mask or self.row_start == "document" else None)
        # Where a document starts: each one for the document mask, those early enough
        # to start a row for data.row_start = "document".
        self.documents = index if document_mask else None
        self.starts = (_row_starts(index, len(self.tokens), seq_len + 1, path, key)
                       if self.row_start == "document" else None)
        # The tokenizer the file was made with (None: byte-level), kept by the run.
        self.tokenizer: Path | None = sidecar(path) if sidecar(path).is_file() else None
        if self.tokenizer is not None:
            size = HFTokenizer(self.tokenizer).vocab_size
            if size > vocab:
                raise UserError(
                    f"data file '{path}' was tokenized with {self.tokenizer.name} ({size:,} "
                    f"ids) but model.vocab = {vocab:,}; set model.vocab >= {size}")
        # The first million ids now; every window's as it is read (`window`): an id past
        # the vocabulary would otherwise be clamped by the embedding lookup, silently.
        self._check(self.tokens[: min(len(self.tokens), 1 << 20)], 0)

    def rows(self, step: int, start: int, stop: int) -> np.ndarray:
        length = self.seq_len + 1
        hi = len(self.tokens) - length
        out = np.empty((stop - start, length), np.int32)
        for i, row in enumerate(range(start, stop)):
            rng = np.random.default_rng([self.seed, step, row])
            offset = (int(rng.integers(0, hi + 1)) if self.starts is None
                      else int(self.starts[rng.integers(0, len(self.starts))]))
            out[i] = self.window(offset, length)
        return out

    def window(self, offset: int, length: int) -> np.ndarray:
        """int32 tokens [offset, offset + length), those the loss mask leaves out as ~id,
        those that start a document with DOC_START (document_mask)."""
        ids = np.asarray(self.tokens[offset: offset + length], np.int32)
        self._check(ids, offset)
        if self.documents is not None:  # the documents starting in the window
            first, last = np.searchsorted(self.documents, [offset, offset + length])
            ids[self.documents[first:last] - offset] |= DOC_START
        if self.mask is None:
            return ids
        return np.where(self.mask[offset: offset + length] != 0, ids, ~ids)

    def _check(self, ids: np.ndarray, offset: int) -> None:
        top = int(ids.max()) if ids.size else 0
        if top >= self.vocab:
            at = offset + int(np.argmax(np.asarray(ids) >= self.vocab))
            raise UserError(_text_given(self.path, self.key) or
                            f"data file '{self.path}' ({self.key}) has token id {top} >= "
                            f"model.vocab = {self.vocab} (the first at token {at:,}); raise "
                            f"model.vocab or re-tokenize, or check {self.dtype_key} "
                            f"({self.dtype}: the file's id width)")


def _text_given(path: Path, key: str) -> str:
    """The message for a file of text or records given where a token file goes (whose
    bytes then read as ids past the vocabulary, or as a part of one), by its name."""
    if path.suffix.lower() not in TEXT_SUFFIXES:
        return ""
    return (f"data file '{path}' ({key}) is text, not a token file; make one with `plait "
            f"data {path} {path.with_suffix('.bin')}` (with the run's --tokenizer, if it "
            "has one) and pass that")


def loss_mask_path(token_file: str | Path) -> Path:
    """The loss mask kept beside a token file (it may not exist: every token counts)."""
    return Path(str(token_file) + MASK_SUFFIX)


def index_path(token_file: str | Path) -> Path:
    """The document index kept beside a token file (it may not exist: a text file)."""
    return Path(str(token_file) + INDEX_SUFFIX)


def resolve_row_start(path: str | Path, setting: str, key: str = "data.path") -> str:
    """data.row_start for this file: "auto" is "document" where the file has a loss mask
    and a document index (fine-tuning records, each best seen whole from its start),
    "anywhere" otherwise (pretraining text)."""
    has_index = index_path(path).is_file()
    if setting == "document" and not has_index:
        raise UserError(f"data.row_start = \"document\" needs the document index beside "
                        f"'{path}' ({key}), which plait data writes for JSON Lines / Parquet "
                        "records; make the file that way or set data.row_start = "
                        "\"anywhere\"")
    if setting == "auto":
        return "document" if has_index and loss_mask_path(path).is_file() else "anywhere"
    return setting


def _read_index(path: Path, tokens: int, key: str) -> np.ndarray:
    """The document index beside a token file, checked against it."""
    side = index_path(path)
    starts = np.fromfile(side, dtype="<i8")
    if starts.size == 0 or np.any(np.diff(starts) <= 0) or starts[0] != 0 \
            or starts[-1] >= tokens:
        raise UserError(f"the document index '{side}' does not fit '{path}' ({key}); write "
                        "both again with plait data (or delete the index)")
    return starts


def _row_starts(starts: np.ndarray, tokens: int, length: int, path: Path, key: str
                ) -> np.ndarray:
    """The starts of the documents a row of `length` tokens can start at (those early
    enough to hold it)."""
    usable = starts[: np.searchsorted(starts, tokens - length, side="right")]
    if usable.size == 0:
        raise UserError(f"no document of '{path}' ({key}) starts early enough for a row of "
                        f"{length} tokens; use a longer file, shorter sequences, or "
                        "data.row_start = \"anywhere\"")
    return usable


def _read_mask(path: Path, tokens: int, key: str) -> np.ndarray | None:
    side = loss_mask_path(path)
    if not side.is_file():
        return None
    size = side.stat().st_size
    if size != tokens:
        raise UserError(f"the loss mask '{side}' holds {size} entries but '{path}' ({key}) "
                        f"{tokens} tokens; write both again with plait data (or delete the "
                        "mask to train on every token)")
    return np.memmap(side, dtype=np.uint8, mode="r")
