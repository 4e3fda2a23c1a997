"""Tokenizers: bytes by default, or a Hugging Face `tokenizers` JSON file the user passes.

`plait data TEXT OUT.bin --tokenizer tokenizer.json` encodes with it and keeps a
copy beside the token file (`OUT.bin.tokenizer.json`); training on that file
checks model.vocab against it and copies it into the run directory
(RUN_DIR/tokenizer.json), where `plait sample` finds it to encode the prompt
and decode what it generates. A token file without one is byte-level (ids
0-255). The `tokenizers` library reads the standard JSON offline; nothing is
downloaded.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Protocol

from plait.errors import UserError

SIDECAR = ".tokenizer.json"
RUN_FILE = "tokenizer.json"


class Codec(Protocol):
    name: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class Bytes:
    """UTF-8 bytes as ids (what `plait data` writes without --tokenizer)."""

    name = "bytes"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizers.Tokenizer` read from its JSON file."""

    def __init__(self, path: str | Path):
        path = Path(path)
        if not path.is_file():
            raise UserError(f"tokenizer file '{path}' not found; pass a tokenizer.json "
                            "(the Hugging Face tokenizers format)")
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise UserError("reading a tokenizer file needs the `tokenizers` package: "
                            "pip install tokenizers (or pip install 'plait[tokenizer]')") from None
        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the library's parse errors are one long line
            first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            raise UserError(f"tokenizer file '{path}' could not be read ({first}); pass a "
                            "tokenizer.json saved by the Hugging Face tokenizers library"
                            ) from None
        self.path, self.name = path, path.name
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def encode_lines(self, lines: list[str], special: bool = True) -> list[list[int]]:
        """Each line's ids; `special`: with the tokens the tokenizer adds around a text
        (a begin-of-text token), as a document starts; without, as text runs on."""
        return [e.ids for e in self.tok.encode_batch(lines, add_special_tokens=special)]

    def encode_with_offsets(self, texts: list[str]
                            ) -> list[tuple[list[int], list[tuple[int, int]]]]:
        """Each text's ids, with no tokens added around it, and the [start, end)
        characters of the text each one covers."""
        return [(e.ids, e.offsets) for e in self.tok.encode_batch(texts,
                                                                 add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)


def sidecar(token_file: str | Path) -> Path:
    """The tokenizer kept beside a token file (it may not exist: byte-level)."""
    return Path(str(token_file) + SIDECAR)


def for_token_file(token_file: str | Path) -> Codec:
    side = sidecar(token_file)
    return HFTokenizer(side) if side.is_file() else Bytes()


def for_run(run_dir: str | Path) -> Codec:
    path = Path(run_dir) / RUN_FILE
    return HFTokenizer(path) if path.is_file() else Bytes()


def check_tokenized_as_run(token_file: Path, run_dir: Path, what: str,
                           alternative: str = "") -> None:
    """One line where `token_file` (named `what`) was not tokenized as the run in
    `run_dir` was: the same tokenizer file beside both, or none (bytes) for both."""
    ours, theirs = run_dir / RUN_FILE, sidecar(token_file)
    mine = ours.read_bytes() if ours.is_file() else None
    made = theirs.read_bytes() if theirs.is_file() else None
    if mine != made:
        how = f"with {theirs.name}" if made is not None else "byte-level (no tokenizer)"
        fix = (f"plait data ... --tokenizer {ours}" if mine is not None
               else "plait data without --tokenizer")
        raise UserError(f"{what} was tokenized {how}, not as the run '{run_dir}' was; make "
                        f"it again with `{fix}`{alternative}")


def keep_beside(tokenizer: HFTokenizer, token_file: Path) -> None:
    tmp = sidecar(token_file).with_suffix(".tmp")
    shutil.copyfile(tokenizer.path, tmp)
    tmp.replace(sidecar(token_file))


def drop_sidecar(token_file: Path) -> None:
    """A token file rewritten byte-level must not keep an older tokenizer beside it."""
    sidecar(token_file).unlink(missing_ok=True)
