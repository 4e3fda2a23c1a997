"""File-backed token datasets: a flat binary of uint16/uint32 ids (nanoGPT style).

Row r of step k starts at an offset drawn from (seed, k, r), so any process can
read exactly its rows with no shared state, and a resumed run on any mesh sees
the same batches.

A loss mask beside the file (OUT.bin.loss_mask, one byte per token, 1 where the
model learns to predict the token: `plait data --prompt-field` writes it, 0 on
each prompt) travels into the batch as ~id for the tokens the loss leaves out
(plait.loss_mask).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from plait.data.tokenizer import HFTokenizer, drop_sidecar, keep_beside, sidecar
from plait.errors import UserError

MASK_SUFFIX = ".loss_mask"


class TokenFile:
    def __init__(self, path: str | Path, dtype: str, seq_len: int, seed: int, vocab: int,
                 key: str = "data.path", spare: int = 1):
        """`spare`: tokens the file must hold past one window of seq_len + 1 (random
        offsets need one; consecutive windows, plait eval's, none)."""
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
            raise UserError(
                f"data file '{path}' is {size} bytes, not a whole number of {dtype} tokens; "
                "check data.dtype"
            )
        need = seq_len + 1 + spare
        if size // itemsize < max(need, 1):  # an empty file cannot even be mapped
            raise UserError(
                f"data file '{path}' ({key}) holds {size // itemsize} tokens, fewer than "
                f"model.seq_len + {1 + spare} = {need}; use a longer file or shorter "
                "sequences"
            )
        self.path, self.tokens = path, np.memmap(path, dtype=dtype, mode="r")
        self.seq_len, self.seed = seq_len, seed
        self.mask = _read_mask(path, len(self.tokens), key)
        # The tokenizer the file was made with (None: byte-level), kept by the run.
        self.tokenizer: Path | None = sidecar(path) if sidecar(path).is_file() else None
        if self.tokenizer is not None:
            size = HFTokenizer(self.tokenizer).vocab_size
            if size > vocab:
                raise UserError(
                    f"data file '{path}' was tokenized with {self.tokenizer.name} ({size:,} "
                    f"ids) but model.vocab = {vocab:,}; set model.vocab >= {size}")
        top = int(self.tokens[: min(len(self.tokens), 1 << 20)].max())
        if top >= vocab:
            raise UserError(
                f"data file '{path}' has token id {top} >= model.vocab = {vocab}; "
                "raise model.vocab or re-tokenize"
            )

    def rows(self, step: int, start: int, stop: int) -> np.ndarray:
        length = self.seq_len + 1
        hi = len(self.tokens) - length
        out = np.empty((stop - start, length), np.int32)
        for i, row in enumerate(range(start, stop)):
            offset = int(np.random.default_rng([self.seed, step, row]).integers(0, hi + 1))
            out[i] = self.window(offset, length)
        return out

    def window(self, offset: int, length: int) -> np.ndarray:
        """int32 tokens [offset, offset + length), those the loss mask leaves out as ~id."""
        ids = np.asarray(self.tokens[offset: offset + length], np.int32)
        if self.mask is None:
            return ids
        return np.where(self.mask[offset: offset + length] != 0, ids, ~ids)


def loss_mask_path(token_file: str | Path) -> Path:
    """The loss mask kept beside a token file (it may not exist: every token counts)."""
    return Path(str(token_file) + MASK_SUFFIX)


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


def encode_text_file(text_path: str | Path, out_path: str | Path, dtype: str = "uint16",
                     tokenizer: str | Path | None = None, held_out: float = 0.0
                     ) -> list[int]:
    """Tokenize a UTF-8 text file into a flat binary of ids; returns how many (and, with
    `held_out`, how many of the text's last tokens went to OUT.val.bin instead).

    Without `tokenizer`: byte-level (ids 0-255, no vocabulary file). With a
    tokenizer.json: its ids, the text encoded line by line (each line with its
    newline, in batches), and a copy of the tokenizer kept beside the output.
    """
    text_path = Path(text_path)
    if not text_path.is_file():
        raise UserError(f"text file '{text_path}' not found; check the path")
    if tokenizer is None:
        ids = np.frombuffer(text_path.read_bytes(), dtype=np.uint8)
        return _write_split(ids, Path(out_path), dtype, f"text file '{text_path}'", held_out,
                            None)
    tok = HFTokenizer(tokenizer)
    if tok.vocab_size - 1 > np.iinfo(dtype).max:
        raise UserError(f"{tok.name} has {tok.vocab_size:,} ids, more than {dtype} holds; "
                        "use --dtype uint32")
    try:
        lines = text_path.read_text(encoding="utf-8").splitlines(keepends=True)
    except UnicodeDecodeError as e:
        raise UserError(f"text file '{text_path}' is not UTF-8 ({e.reason} at byte "
                        f"{e.start}); convert it first") from None
    from rich.progress import track

    batches = [lines[i:i + 4096] for i in range(0, len(lines), 4096)]
    parts = [np.asarray([i for ids in tok.encode_lines(b) for i in ids], np.int64)
             for b in track(batches, description=f"tokenizing with {tok.name}",
                            transient=True, disable=len(batches) < 8)]
    ids = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    return _write_split(ids, Path(out_path), dtype, f"text file '{text_path}'", held_out, tok)


def held_out_path(out_path: str | Path) -> Path:
    """Where `--held-out` writes what it holds out: OUT.bin -> OUT.val.bin."""
    out = Path(out_path)
    return out.with_name(f"{out.stem}.val{out.suffix}")


def _write_split(ids: np.ndarray, out: Path, dtype: str, source: str, held_out: float,
                 tok: HFTokenizer | None) -> list[int]:
    """OUT, and with `held_out` the last part of the text in OUT.val.bin (a text file's
    lines run on into each other: a contiguous tail, as nanoGPT's prepare scripts hold
    out); each with the tokenizer beside it, or none."""
    cut = len(ids) - int(round(len(ids) * held_out))
    if held_out and len(ids) and not 0 < cut < len(ids):  # (none at all: said below)
        raise UserError(f"--held-out {held_out} of {len(ids)} tokens leaves "
                        f"{'none' if cut == len(ids) else 'nothing to train on'}; nothing "
                        "was written; choose another fraction")
    pieces = [(out, ids[:cut])] + [(held_out_path(out), ids[cut:])] * bool(held_out)
    return [write_with_tokenizer(part, path, dtype, source, tok) for path, part in pieces]


def write_with_tokenizer(ids: np.ndarray, path: Path, dtype: str, source: str,
                         tok: HFTokenizer | None, mask: np.ndarray | None = None) -> int:
    """`write_tokens`, then the tokenizer that made the ids kept beside the file (or, for
    byte-level ids, any older one removed), and the loss mask beside it (or, without one,
    any older one removed: a file written again is trained on whole)."""
    n = write_tokens(ids, path, dtype, source)
    if tok is not None:
        keep_beside(tok, path)
    else:
        drop_sidecar(path)
    side = loss_mask_path(path)
    if mask is None:
        side.unlink(missing_ok=True)
    else:
        tmp = side.with_name(side.name + ".tmp")
        np.asarray(mask, np.uint8).tofile(tmp)
        tmp.replace(side)
    return n


def write_tokens(ids: np.ndarray, out_path: str | Path, dtype: str = "uint16",
                 source: str = "the input") -> int:
    """Write ids as a flat binary (atomically); no tokens at all is a user's mistake (an
    empty corpus) and nothing is written."""
    ids = np.asarray(ids)
    if ids.size == 0:
        raise UserError(f"{source} gives no tokens (it is empty); nothing was written to "
                        f"{out_path}; pass a file with text in it")
    if ids.size and int(ids.max()) > np.iinfo(dtype).max:
        raise UserError(f"token id {int(ids.max())} does not fit in {dtype}; use uint32")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_suffix(out_path.suffix + ".tmp")
    ids.astype(dtype).tofile(tmp)
    tmp.replace(out_path)
    return int(ids.size)
