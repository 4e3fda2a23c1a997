"""`plait data`: text, documents (JSON Lines, Parquet) or Criteo days into the files
training reads, with the next step said in one line (the handler; plait.data does the
work)."""

from __future__ import annotations

from pathlib import Path

from plait import output_paths
from plait.errors import UserError


def _record_flags(args) -> list[tuple[str, str | None]]:
    """The flags only JSON Lines / Parquet records read (None where not given)."""
    return [("--prompt-field", args.prompt_field), ("--chat", args.chat),
            ("--field", args.field), ("--eos", args.eos),
            ("--chat-template", args.chat_template)]


def _token_flags(args) -> list[tuple[str, str | None]]:
    """The flags only token files read: records' and any text's."""
    return [*_record_flags(args), ("--tokenizer", args.tokenizer), ("--dtype", args.dtype)]


def cmd_data(args) -> int:
    if args.inputs[0] == "criteo":
        from plait.data.criteo_bin import convert

        if not args.out:
            raise UserError("plait data criteo needs --out DIR (the directory to write)")
        if args.held_out:
            raise UserError("plait data criteo converts whole days: hold a day out instead "
                            "and give it as data.eval_path")
        if len(args.inputs) < 2:
            raise UserError("plait data criteo needs at least one Criteo TSV day file")
        for flag, value in _token_flags(args):
            if value is not None:
                raise UserError(f"{flag} is for token files; plait data criteo writes "
                                "labels, dense and categorical columns: drop it")
        manifest = convert(args.inputs[1:], args.out, args.malformed or "skip")
        rows = sum(p["rows"] for p in manifest["parts"])
        print(f"plait: {args.out} holds {rows:,} rows in {len(manifest['parts'])} part(s); use "
              f"data.source = \"criteo_bin\", data.path = \"{args.out}\"")
        return 0
    from plait.data.documents import encode_corpus, expand, is_corpus
    from plait.data.tokens import loss_mask_path
    from plait.data.writer import encode_text_file

    if args.malformed is not None:
        raise UserError("--malformed is for Criteo TSV lines (plait data criteo DAY ... --out "
                        "DIR); drop it")
    args.dtype = args.dtype or "uint16"
    held = args.held_out or 0.0
    if not 0.0 <= held < 1.0:
        raise UserError(f"--held-out is the fraction held out for evaluation, between 0 and "
                        f"1 (e.g. 0.05); got {held}")
    if len(args.inputs) >= 2 and is_corpus(args.inputs[:-1]) and not args.out:
        *inputs, out = args.inputs
        field = args.field or "text"
        if args.prompt_field is not None and args.prompt_field == field:
            raise UserError(f"--prompt-field and --field both name '{field}'; the "
                            "prompt and the response are two fields of each record")
        if args.chat is not None and args.prompt_field is not None:
            raise UserError("--chat and --prompt-field are two ways to read a record; pass "
                            "one (--chat for a list of messages, --prompt-field for a prompt "
                            "and a response)")
        if args.chat_template is not None and args.chat is None:
            raise UserError("--chat-template renders conversations: pass --chat NAME, the "
                            "field that holds them")
        if args.eos is not None and args.tokenizer is None:
            raise UserError(f"--eos {args.eos!r} names a token of --tokenizer; byte-level ids "
                            "have no end-of-text token: pass the tokenizer, or drop --eos")
        _token_file_out(out)
        paths = expand(inputs)
        _keep_inputs(out, [*paths, args.chat_template], args.tokenizer)
        got = encode_corpus(paths, ", ".join(inputs), out, field, args.dtype, args.tokenizer,
                            args.eos, held, args.prompt_field, args.chat, args.chat_template)
        end = (f", each ended by id {got['eos']}" if got["eos"] is not None
               else ", each ended by its chat template" if args.chat is not None
               else " (byte-level: no end-of-text id)")
        what = "the assistant's turns" if args.chat is not None else "the responses"
        learned = ("" if got["kept"] is None else
                   f"; training learns the {got['kept']:,} tokens of {what} "
                   f"({got['kept'] / got['tokens']:.0%}, the loss mask "
                   f"{loss_mask_path(out)})")
        print(f"plait: wrote {got['tokens']:,} tokens of {got['documents']:,} documents from "
              f"{got['files']} file(s){end} ({args.dtype}) to {out}{learned}; use data.source "
              f"= \"tokens\", data.path = \"{out}\", model.vocab >= {got['vocab']}")
        if got["held_out"]:
            h = got["held_out"]
            _print_held_out(h["path"], f"{h['tokens']:,} tokens of {h['documents']:,} "
                            f"documents (one in every {1 / held:.3g})")
        return 0
    if len(args.inputs) != 2 or args.out:
        raise UserError("plait data takes TEXT_FILE OUT.bin (a token file), documents "
                        "(*.jsonl / *.parquet ...) OUT.bin, or criteo DAY.tsv ... --out DIR")
    text, out = args.inputs
    for flag, value in _record_flags(args):
        if value is not None:
            raise UserError(f"{flag} reads JSON Lines or Parquet records (*.jsonl, *.parquet); "
                            f"a text file is one document: drop {flag}, or pass the records")
    _token_file_out(out)
    _keep_inputs(out, [text], args.tokenizer)
    written = encode_text_file(text, out, args.dtype, args.tokenizer, held)
    if args.tokenizer:
        from plait.data.tokenizer import HFTokenizer

        size, what = HFTokenizer(args.tokenizer).vocab_size, f"{Path(args.tokenizer).name} ids"
    else:
        size, what = 256, "byte-level tokens"
    print(f"plait: wrote {written[0]:,} {what} ({args.dtype}) to {out}; use data.source = "
          f"\"tokens\", data.path = \"{out}\", model.vocab >= {size}")
    if held:
        from plait.data.writer import held_out_path

        _print_held_out(held_out_path(out), f"the text's last {written[1]:,} tokens")
    return 0


def _print_held_out(path, what: str) -> None:
    print(f"plait: held out {what} in {path}; use data.eval_path = \"{path}\", or "
          f"plait eval RUN_DIR --data {path}")


def _keep_inputs(out: str, inputs: list, tokenizer: str | None) -> None:
    """Refuse an OUT.bin whose files (itself, its held-out twin and what goes beside each:
    loss mask, document index, tokenizer copy) would overwrite an input: `plait data
    t.txt t.txt` replaced the text with its own tokens. The tokenizer may be the copy an
    earlier run kept beside OUT.bin (it is copied onto itself)."""
    from plait.data.tokenizer import SIDECAR
    from plait.data.tokens import INDEX_SUFFIX, MASK_SUFFIX
    from plait.data.writer import held_out_path

    written = [Path(str(base) + suffix) for base in (out, held_out_path(out))
               for suffix in ("", MASK_SUFFIX, INDEX_SUFFIX, SIDECAR)]
    given = [(x, written) for x in inputs] + [
        (tokenizer, [w for w in written if not w.name.endswith(SIDECAR)])]
    for path_in, outputs in given:
        if path_in is None or not Path(path_in).is_file():
            continue
        for path in outputs:
            if path.is_file() and path.samefile(path_in):
                what = "OUT.bin" if path == Path(out) else f"OUT.bin's {path.name}"
                raise UserError(f"{what} '{path}' is the input '{path_in}': writing would "
                                "overwrite it; pass another OUT.bin")


def _token_file_out(out: str) -> None:
    """OUT.bin, checked before the work: a file of ids, never named as text (where a
    token file goes, plait reads a .txt or .jsonl as text and says so: data.tokens)."""
    from plait.data.inputs import TEXT_SUFFIXES

    path = Path(out)
    if path.suffix.lower() in TEXT_SUFFIXES:
        raise UserError(f"OUT.bin '{out}' is named as text ({path.suffix}), but a token file "
                        f"is binary ids; name it e.g. '{path.with_suffix('.bin')}'")
    output_paths.file(out, "OUT.bin", ".bin")
