"""plait data on corpora of documents (JSON Lines, Parquet, globs; an end-of-text id after
every document) and the token files a user can get wrong: empty, or shorter than one
sequence, as data.path or data.eval_path."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import tiny, write_experiment

from plait.cli import main

DOCS = [f"document {i}: the cat sat on the mat {i % 7} times." for i in range(600)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("corpus")
    for part in range(2):
        with (root / f"part{part}.jsonl").open("w") as f:
            for d in DOCS[part * 200:(part + 1) * 200]:
                f.write(json.dumps({"text": d, "id": 0}) + "\n")
    pq.write_table(pa.table({"body": DOCS[400:]}), root / "rest.parquet", row_group_size=64)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(DOCS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<|endoftext|>"]))
    tok.save(str(root / "tok.json"))
    return root


def test_documents_each_end_with_the_end_of_text_id(corpus, tmp_path, capsys):
    from tokenizers import Tokenizer

    out = tmp_path / "docs.bin"
    assert main(["data", str(corpus / "part*.jsonl"), str(out),
                 "--tokenizer", str(corpus / "tok.json")]) == 0
    assert "400 documents from 2 file(s), each ended by id 1" in capsys.readouterr().out
    tok = Tokenizer.from_file(str(corpus / "tok.json"))
    want = [i for d in DOCS[:400] for i in (*tok.encode(d).ids, 1)]
    np.testing.assert_array_equal(np.fromfile(out, np.uint16), want)
    assert (tmp_path / "docs.bin.tokenizer.json").is_file()
    # Parquet (its column named), after JSON Lines: the same ids as one stream
    both = tmp_path / "both.bin"
    assert main(["data", str(corpus / "part0.jsonl"), str(corpus / "rest.parquet"), str(both),
                 "--field", "body", "--tokenizer", str(corpus / "tok.json")]) == 2
    assert "has no field 'body'" in capsys.readouterr().err
    assert main(["data", str(corpus / "rest.parquet"), str(both), "--field", "body",
                 "--tokenizer", str(corpus / "tok.json")]) == 0
    want = [i for d in DOCS[400:] for i in (*tok.encode(d).ids, 1)]
    np.testing.assert_array_equal(np.fromfile(both, np.uint16), want)


def test_held_out_documents_go_to_their_own_file(corpus, tmp_path, capsys):
    """--held-out 0.05: one document in every 20 (19, 39, ...) in OUT.val.bin, the rest in
    OUT.bin, each with the tokenizer beside it; together they are every document once."""
    from tokenizers import Tokenizer

    from plait.data.documents import is_held_out

    out = tmp_path / "docs.bin"
    assert main(["data", str(corpus / "part*.jsonl"), str(out), "--held-out", "0.05",
                 "--tokenizer", str(corpus / "tok.json")]) == 0
    said = capsys.readouterr().out
    assert "380 documents" in said and "held out" in said and "of 20 documents" in said
    held = [i for i in range(400) if is_held_out(i, 0.05)]
    assert held == list(range(19, 400, 20))
    tok = Tokenizer.from_file(str(corpus / "tok.json"))

    def ids(docs):
        return [i for d in docs for i in (*tok.encode(d).ids, 1)]

    val = tmp_path / "docs.val.bin"
    np.testing.assert_array_equal(np.fromfile(val, np.uint16), ids(DOCS[i] for i in held))
    np.testing.assert_array_equal(np.fromfile(out, np.uint16),
                                  ids(DOCS[i] for i in range(400) if i not in held))
    assert (tmp_path / "docs.val.bin.tokenizer.json").read_bytes() == (
        corpus / "tok.json").read_bytes()


def test_a_text_file_holds_out_its_last_part(tmp_path, capsys):
    text = tmp_path / "a.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    out = tmp_path / "a.bin"
    assert main(["data", str(text), str(out), "--held-out", "0.1"]) == 0
    assert "the text's last 180 tokens in" in capsys.readouterr().out
    whole = np.frombuffer(text.read_bytes(), np.uint8)
    np.testing.assert_array_equal(np.fromfile(out, np.uint16), whole[:-180])
    np.testing.assert_array_equal(np.fromfile(tmp_path / "a.val.bin", np.uint16),
                                  whole[-180:])


@pytest.mark.parametrize("fraction, message", [
    ("1.5", "between 0 and 1"), ("-0.1", "between 0 and 1"),
    ("0.001", "of 400 document(s) holds none out; nothing was written; use at least 0.0025"),
])
def test_held_out_mistakes_are_one_line(corpus, tmp_path, capsys, fraction, message):
    out = tmp_path / "x.bin"
    assert main(["data", str(corpus / "part*.jsonl"), str(out), "--held-out", fraction,
                 "--tokenizer", str(corpus / "tok.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not out.exists() and not (tmp_path / "x.val.bin").exists()


def test_a_glob_reads_its_files_in_natural_order(tmp_path, capsys):
    """shard2 before shard10, as criteo's days (a plain sort put shard10 first); a file
    whose name only looks like a glob is itself."""
    names = ["shard10.jsonl", "shard2.jsonl", "run[1].jsonl"]
    for name in names:
        (tmp_path / name).write_text(json.dumps({"text": name}) + "\n")
    out = tmp_path / "out.bin"
    assert main(["data", str(tmp_path / "shard*.jsonl"), str(tmp_path / "run[1].jsonl"),
                 str(out)]) == 0
    assert "3 documents from 3 file(s)" in capsys.readouterr().out
    ids = np.fromfile(out, np.uint16)
    assert bytes(ids[ids < 256].astype(np.uint8)).decode() == \
        "shard2.jsonlshard10.jsonlrun[1].jsonl"


def test_criteo_days_are_held_out_whole(tmp_path, capsys):
    assert main(["data", "criteo", str(tmp_path / "day.tsv"), "--out", str(tmp_path / "c"),
                 "--held-out", "0.1"]) == 2
    assert "hold a day out instead" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("args,message", [
    (["missing*.jsonl"], "matches no file"),
    (["rest.parquet"], "has no column 'text' (it has body)"),
    (["rest.parquet", "--field", "body", "--eos", "<nope>"], "--eos '<nope>' is not a token"),
])
def test_corpus_mistakes_are_one_line(corpus, tmp_path, capsys, args, message, monkeypatch):
    monkeypatch.chdir(corpus)
    out = tmp_path / "x.bin"
    assert main(["data", *args[:1], str(out), *args[1:], "--tokenizer", "tok.json"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not out.exists()


@pytest.mark.parametrize("args,message", [
    # OUT.bin or a file beside it is an input: `plait data t.txt t.txt` had replaced the
    # text with its own tokens
    (["notes", "notes"], "OUT.bin 'notes' is the input 'notes': writing would overwrite it"),
    # OUT.bin named as text (where a token file goes, a .txt is read as text)
    (["t.txt", "t.txt"], "OUT.bin 't.txt' is named as text (.txt), but a token file is "
                         "binary ids; name it e.g. 't.bin'"),
    (["d.jsonl", "d.jsonl"], "OUT.bin 'd.jsonl' is named as text (.jsonl)"),
    (["t.txt", "new/out.txt"], "OUT.bin 'new/out.txt' is named as text"),  # new/ not made
    (["d.jsonl", "out.bin", "--tokenizer", "out.bin.loss_mask"],
     "OUT.bin's out.bin.loss_mask 'out.bin.loss_mask' is the input"),
    # flags a text file does not read, and an end-of-text token without a tokenizer, had
    # been ignored
    (["t.txt", "out.bin", "--field", "body"], "--field reads JSON Lines or Parquet records"),
    (["t.txt", "out.bin", "--eos", "<|endoftext|>"], "--eos reads JSON Lines or Parquet"),
    (["t.txt", "out.bin", "--chat-template", "t.txt"], "--chat-template reads JSON Lines"),
    (["d.jsonl", "out.bin", "--eos", "5"],
     "--eos '5' names a token of --tokenizer; byte-level ids have no end-of-text token"),
    (["d.jsonl", "out.bin", "--prompt-field", "text"],  # --field's default
     "--prompt-field and --field both name 'text'"),
])
def test_data_refuses_what_it_would_overwrite_or_ignore(tmp_path, capsys, monkeypatch, args,
                                                        message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.txt").write_text("some text")
    (tmp_path / "notes").write_text("some text")
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "a doc"}) + "\n")
    (tmp_path / "out.bin.loss_mask").write_text("{}")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert main(["data", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_an_empty_corpus_is_refused_and_writes_nothing(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "empty.jsonl").write_text("")
    for src, extra in (("empty.txt", []), ("empty.jsonl", []),
                       ("empty.txt", ["--held-out", "0.5"]),
                       ("empty.jsonl", ["--held-out", "0.5"])):
        assert main(["data", str(tmp_path / src), str(tmp_path / "out.bin"), *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "gives no tokens (it is empty)" in err
        assert not (tmp_path / "out.bin").exists()


@pytest.mark.parametrize("key", ["data.path", "data.eval_path"])
@pytest.mark.parametrize("tokens", [0, 33])  # seq_len 32 needs 34
def test_token_files_too_short_for_a_sequence(tmp_path, capsys, key, tokens):
    good, short = tmp_path / "good.bin", tmp_path / "short.bin"
    np.arange(1000, dtype=np.uint16).astype(np.uint16).__mod__(200).tofile(good)
    np.zeros(tokens, np.uint16).tofile(short)
    paths = {"path": str(good), "eval_path": str(good)}
    paths[key.split(".")[1]] = str(short)
    exp = write_experiment(tmp_path / "e.toml", tiny(data={"source": "tokens", **paths}))
    assert main(["train", str(exp), "--mesh", "data=1", "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"({key}) holds {tokens} tokens, fewer than model.seq_len + 2 = 34" in err


def test_a_failed_run_leaves_the_old_files_as_they_were(corpus, tmp_path, capsys):
    """plait data writes as it reads; a mistake found after batches were written (a bad
    line past the first BATCH documents) leaves the earlier OUT, its tokenizer and its
    loss mask untouched and no temporary file behind."""
    from plait.data.documents import BATCH

    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"q": d, "a": d[::-1]}) + "\n" for d in DOCS[:50]))
    out = tmp_path / "out.bin"
    assert main(["data", str(good), str(out), "--prompt-field", "q", "--field", "a",
                 "--tokenizer", str(corpus / "tok.json"), "--held-out", "0.1"]) == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("out")}
    assert len(before) == 8  # OUT and OUT.val.bin, each with its tokenizer, mask, index
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps({"q": "x", "a": d}) + "\n" for d in DOCS * 4)
                   + "{not json\n")
    assert len(DOCS) * 4 > 2 * BATCH
    assert main(["data", str(bad), str(out), "--prompt-field", "q", "--field", "a",
                 "--held-out", "0.1"]) == 2
    assert "is not JSON" in capsys.readouterr().err
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("out")}
    assert after == before


@pytest.mark.parametrize("tokenizer", [False, True])
def test_a_text_file_is_read_and_written_a_piece_at_a_time(corpus, tmp_path, capsys,
                                                           monkeypatch, tokenizer):
    """With pieces far smaller than the text (7-byte chunks, 3-line batches), the ids are
    those of the whole text (byte-level) or of its lines (a tokenizer), the held-out tail
    moved whole; a byte that is not UTF-8 is named at its place in the file."""
    from tokenizers import Tokenizer

    from plait.data import writer

    monkeypatch.setattr(writer, "CHUNK_BYTES", 7)
    monkeypatch.setattr(writer, "LINES", 3)
    text = tmp_path / "a.txt"
    text.write_text("".join(f"{d}\n" for d in DOCS[:40]))
    out = tmp_path / "a.bin"
    extra = ["--tokenizer", str(corpus / "tok.json")] if tokenizer else []
    assert main(["data", str(text), str(out), "--held-out", "0.25", *extra]) == 0
    if tokenizer:
        tok = Tokenizer.from_file(str(corpus / "tok.json"))
        whole = [i for d in DOCS[:40] for i in tok.encode(f"{d}\n").ids]
    else:
        whole = list(text.read_bytes())
    cut = len(whole) - round(len(whole) * 0.25)
    np.testing.assert_array_equal(np.fromfile(out, np.uint16), whole[:cut])
    np.testing.assert_array_equal(np.fromfile(tmp_path / "a.val.bin", np.uint16), whole[cut:])
    if tokenizer:
        text.write_bytes(b"line one\nline two\nline three\nfour\xff\n")
        assert main(["data", str(text), str(out), *extra]) == 2
        assert "invalid start byte at byte 33); convert it first" in capsys.readouterr().err
        np.testing.assert_array_equal(np.fromfile(out, np.uint16), whole[:cut])
