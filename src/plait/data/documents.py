"""Corpora of documents -> one token file: JSON Lines and Parquet (a text field of each
record), several files or globs, each document ended by the tokenizer's end-of-text
token so a model fine-tuned on it learns where documents stop.

Parquet is streamed a record batch at a time through pyarrow (a row group never
has to fit whole with the rest), JSON Lines a line at a time; documents are
encoded in batches by the `tokenizers` library, whose `encode_batch` runs on
every core. A progress line shows documents, tokens and their rates.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from plait.data import inputs
from plait.data.tokenizer import Bytes, HFTokenizer
from plait.errors import UserError

SUFFIXES = inputs.RECORD_SUFFIXES
# End-of-text tokens by the names the common tokenizers give them, in order of preference.
END_OF_TEXT = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")
BATCH = 1024


def is_corpus(paths: list[str]) -> bool:
    """Whether the inputs are documents (JSON Lines / Parquet) rather than plain text."""
    return any(p.endswith(SUFFIXES) for p in paths)


def expand(patterns: list[str]) -> list[Path]:
    """Files in the order given, each glob's in natural order (data.inputs); a pattern
    that matches nothing is an error."""
    out: list[Path] = []
    for pattern in patterns:
        matches = inputs.matches(pattern)
        if not matches or not Path(matches[0]).is_file():
            raise UserError(f"input '{pattern}' matches no file; check the path")
        bad = [m for m in matches if not m.endswith(SUFFIXES)]
        if bad:
            raise UserError(f"'{bad[0]}' is not a JSON Lines (.jsonl) or Parquet (.parquet) "
                            "file; plain text goes alone: plait data TEXT_FILE OUT.bin")
        out += [Path(m) for m in matches]
    return out


# Each field read, by the flag that names it: what its error message tells the user to pass.
Fields = dict[str, str]


def _jsonl(path: Path, fields: Fields) -> Iterator[tuple]:
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise UserError(f"{path}:{n} is not JSON ({e}); fix or drop that line") from None
            for field, flag in fields.items():
                if not isinstance(record, dict) or field not in record:
                    raise UserError(f"{path}:{n} has no field '{field}'; pass the field's "
                                    f"name with {flag}")
            yield tuple(record[field] for field in fields)


def _parquet(path: Path, fields: Fields) -> Iterator[tuple]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError("reading Parquet needs pyarrow: pip install pyarrow (or "
                        "pip install 'plait[corpus]')") from None
    try:
        f = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - the library's error, on one line
        raise UserError(f"{path} is not a readable Parquet file ({str(e).splitlines()[0]})"
                        ) from None
    for field, flag in fields.items():
        if field not in f.schema_arrow.names:
            raise UserError(f"{path} has no column '{field}' (it has "
                            f"{', '.join(f.schema_arrow.names)}); pass the column's name "
                            f"with {flag}")
    for batch in f.iter_batches(columns=list(fields), batch_size=BATCH):
        columns = [batch.column(field).to_pylist() for field in fields]
        yield from (row for row in zip(*columns, strict=True) if None not in row)


def documents(paths: list[Path], fields: Fields) -> Iterator[tuple]:
    """Each record's fields as stored (the text; the prompt and the response; the
    messages), records missing one skipped in Parquet (a null), refused in JSON Lines."""
    for path in paths:
        yield from (_parquet if path.suffix == ".parquet" else _jsonl)(path, fields)


def end_of_text(tok: HFTokenizer, name: str | None) -> int | None:
    """The id that ends each document: --eos NAME, or the first of END_OF_TEXT the
    tokenizer knows (None for byte-level ids, which have no room for one)."""
    if isinstance(tok, Bytes):
        return None
    vocab = tok.tok.get_vocab(with_added_tokens=True)
    if name is not None:
        if name not in vocab:
            raise UserError(f"--eos '{name}' is not a token of {tok.name}")
        return vocab[name]
    for candidate in END_OF_TEXT:
        if candidate in vocab:
            return vocab[candidate]
    raise UserError(f"{tok.name} has none of the usual end-of-text tokens "
                    f"({', '.join(END_OF_TEXT)}); name one with --eos")


def is_held_out(index: int, fraction: float) -> bool:
    """Whether document `index` is held out: floor(n x fraction) of the first n, spread
    evenly (one in every 1 / fraction), the same for every run over the same inputs."""
    return fraction > 0 and int((index + 1) * fraction) > int(index * fraction)


def encode_corpus(paths: list[Path], source: str, out_path: str | Path, field: str, dtype: str,
                  tokenizer: str | Path | None, eos: str | None = None,
                  held_out: float = 0.0, prompt_field: str | None = None,
                  chat: str | None = None, chat_template: str | Path | None = None) -> dict:
    """Tokenize every document of `paths` (`expand`ed from the patterns `source` names)
    into OUT (a flat binary of ids); returns counts. The tokenizer is kept beside OUT,
    as for text files. With `held_out`, that fraction of the documents (`is_held_out`)
    goes to OUT.val.bin instead.

    With `prompt_field`, each record is a prompt and its response (`field`): the
    prompt encoded as a document starts (the tokenizer's begin-of-text token, if it
    adds one), the response run on after it without, then the end-of-text token; a
    loss mask beside OUT (data.tokens) keeps the response and its end, not the prompt,
    so fine-tuning learns to answer and not to ask. With `chat`, each record's `chat`
    field is a conversation, rendered by the model's chat template (data.chat) and
    masked to keep the assistant's turns."""
    from plait.data.writer import Status, TokenWriter, held_out_path

    if chat is not None and not tokenizer:
        raise UserError("--chat renders conversations with the model's chat template; pass "
                        "its tokenizer with --tokenizer (e.g. RUN/tokenizer.json after plait "
                        "import)")
    tok = HFTokenizer(tokenizer) if tokenizer else Bytes()
    if tok.vocab_size - 1 > np.iinfo(dtype).max:
        raise UserError(f"{tok.name} has {tok.vocab_size:,} ids, more than {dtype} holds; "
                        "use --dtype uint32")
    template = None
    if chat is not None:
        from plait.data import chat as chats

        template = chats.find(tokenizer, chat_template)
    # A chat template ends each turn itself; a plain document gets the end-of-text id.
    end = None if template is not None else end_of_text(tok, eos)
    tail = [] if end is None else [end]
    fields: Fields = ({chat: "--chat"} if chat is not None else {field: "--field"}
                      if prompt_field is None else {prompt_field: "--prompt-field",
                                                    field: "--field"})
    masked = chat is not None or prompt_field is not None
    # Written as they are made: OUT, and with held_out OUT.val.bin.
    train = TokenWriter(out_path, dtype, source, masked, indexed=True)
    held = (TokenWriter(held_out_path(out_path), dtype, source, masked, indexed=True)
            if held_out else None)
    docs = tokens = held_docs = 0

    def encode(texts: list[str], starts: bool) -> list[list[int]]:
        texts = [str(t) for t in texts]
        if isinstance(tok, Bytes):
            return [list(t.encode("utf-8")) for t in texts]
        return tok.encode_lines(texts, special=starts)

    def encoded(batch: list[tuple]) -> list[tuple[list[int], list[int]]]:
        """(ids, loss mask) of each record, the end-of-text id (if any) after it."""
        first = docs - len(batch)
        if template is not None:
            conversations = [chats.conversation(r[0], f"record {first + j + 1} of the inputs")
                             for j, r in enumerate(batch)]
            return chats.encode(conversations, template, tok)
        columns = [encode(list(c), starts=i == 0) for i, c in enumerate(zip(*batch, strict=True))]
        out = []
        for pieces in zip(*columns, strict=True):
            asked = len(pieces[0]) if len(pieces) == 2 else 0  # the prompt: not learned
            ids = [i for piece in pieces for i in piece] + tail
            out.append((ids, [0] * asked + [1] * (len(ids) - asked)))
        return out

    def flush(batch: list[tuple]) -> None:
        nonlocal tokens, held_docs
        first = docs - len(batch)
        # ids, loss mask and document starts, for OUT and for OUT.val.bin
        pieces: dict[bool, tuple[list[int], list[int], list[int]]] = {
            False: ([], [], []), True: ([], [], [])}
        for j, (ids, mask) in enumerate(encoded(batch)):
            out = is_held_out(first + j, held_out)
            if ids:  # (an empty document starts nowhere)
                pieces[out][2].append(len(pieces[out][0]))
            pieces[out][0].extend(ids)
            pieces[out][1].extend(mask)
            held_docs += out
            tokens += len(ids)
        for out, writer in ((False, train), (True, held)):
            ids, mask, starts = pieces[out]
            if ids:
                writer.append(np.asarray(ids, np.int64),
                              np.asarray(mask, np.uint8) if masked else None, starts)

    try:
        with Status() as status:
            batch: list[tuple] = []
            for record in documents(paths, fields):
                batch.append(record)
                docs += 1
                if len(batch) == BATCH:
                    flush(batch)
                    batch = []
                    status.show(docs, tokens, tok.name)
            if batch:
                flush(batch)
        if held_out and docs and not held_docs:  # (no documents at all: said below)
            raise UserError(f"--held-out {held_out} of {docs} document(s) holds none out; "
                            f"nothing was written; use at least {1 / max(docs, 1):.3g}")
        if held_out and docs and held_docs == docs:
            raise UserError(f"--held-out {held_out} holds out all {docs} document(s); "
                            "nothing was written; use a smaller fraction")
        for writer in (train, held):  # both complete before either replaces a file
            if writer is not None:
                writer.check_not_empty()
        if masked and not train.kept:  # every loss would be a mean over no tokens
            what = (f"no record's --chat '{chat}' holds an assistant turn"
                    if chat is not None else f"every record's --field '{field}' is empty")
            raise UserError(f"{what}: the loss mask would keep none of the {train.tokens:,} "
                            "tokens and training would learn nothing; nothing was written; "
                            f"check {source} and the field names")
        named = tok if isinstance(tok, HFTokenizer) else None
        written = [train.publish(named)] + ([held.publish(named)] if held else [])
    except BaseException:
        for writer in (train, held):
            if writer is not None:
                writer.discard()
        raise
    return {"documents": docs - held_docs, "tokens": written[0], "files": len(paths),
            "kept": train.kept if masked else None,
            "eos": end, "tokenizer": tok.name, "vocab": tok.vocab_size,
            "held_out": ({"path": str(held_out_path(out_path)), "documents": held_docs,
                          "tokens": written[1]} if held_out else None)}
