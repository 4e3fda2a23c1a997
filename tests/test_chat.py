"""Conversations through a model's chat template (tests/data/hf/llama3's, in its
tokenizer_config.json): `plait data --chat` writes the rendered text and a loss mask
that keeps exactly the assistant's turns; import and export carry the template; `plait
sample --chat` answers a message as the model's greedy decode does; mistakes are one
line."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from helpers import ROOT

from plait.cli import main
from plait.data.tokens import loss_mask_path

FIXTURE = ROOT / "tests" / "data" / "hf" / "llama3"
EOS = "<|end_of_text|>"

CONVERSATIONS = [
    [{"role": "system", "content": "be brief"},
     {"role": "user", "content": f"what is the mesh {i}?"},
     {"role": "assistant", "content": "  the model layer " * (1 + i % 3)},
     {"role": "user", "content": "and the shard?"},
     {"role": "assistant", "content": f"the tensor axis {i}"}]
    for i in range(12)]


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("chat") / "run"
    assert main(["import", str(FIXTURE), "--run-dir", str(run_dir), "--seq-len", "64"]) == 0
    return run_dir


def _rendered(messages) -> str:
    """The fixture's template written out by hand."""
    return "".join(f"<{m['role']}>\n{m['content'].strip()}{EOS}\n" for m in messages)


def test_conversations_become_their_text_and_a_mask_of_the_assistant_turns(imported,
                                                                           tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer

    with (tmp_path / "a.jsonl").open("w") as f:
        f.writelines(json.dumps({"messages": c, "id": i}) + "\n"
                     for i, c in enumerate(CONVERSATIONS[:6]))
    pq.write_table(pa.table({"messages": CONVERSATIONS[6:]}), tmp_path / "b.parquet")
    out = tmp_path / "chat.bin"
    assert main(["data", str(tmp_path / "a.jsonl"), str(tmp_path / "b.parquet"), str(out),
                 "--chat", "messages", "--tokenizer", str(imported / "tokenizer.json")]) == 0
    said = capsys.readouterr().out
    assert "12 documents" in said and "each ended by its chat template" in said
    tok = Tokenizer.from_file(str(imported / "tokenizer.json"))
    ids = np.fromfile(out, np.uint16)
    mask = np.fromfile(loss_mask_path(out), np.uint8)
    want = [i for c in CONVERSATIONS
            for i in tok.encode(_rendered(c), add_special_tokens=False).ids]
    np.testing.assert_array_equal(ids, want)
    # What the mask keeps decodes to the assistant's turns, each with its end.
    kept = tok.decode([int(i) for i, k in zip(ids, mask, strict=True) if k],
                      skip_special_tokens=False)
    assert kept == "".join(f"{m['content'].strip()}{EOS}\n" for c in CONVERSATIONS
                           for m in c if m["role"] == "assistant")


def test_import_and_export_carry_the_chat_template(imported, tmp_path):
    config = (FIXTURE / "tokenizer_config.json").read_bytes()
    assert (imported / "tokenizer_config.json").read_bytes() == config
    assert main(["export", str(imported), "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "tokenizer_config.json").read_bytes() == config


def test_sample_chat_answers_as_the_greedy_decode_does(imported, capsys):
    """The system and user messages through the template with the assistant's turn
    opened, continued greedily (the reference decode without a cache), cut at the
    end-of-text token."""
    from tokenizers import Tokenizer

    from plait.sample import greedy_without_cache, load

    assert main(["sample", str(imported), "--chat", "--system", "be brief", "--prompt",
                 "what is the mesh?", "--tokens", "12", "--temperature", "0"]) == 0
    got = capsys.readouterr().out
    tok = Tokenizer.from_file(str(imported / "tokenizer.json"))
    prompt = tok.encode("<system>\nbe brief" + EOS + "\n<user>\nwhat is the mesh?" + EOS
                        + "\n<assistant>\n", add_special_tokens=False).ids
    _, mdef, params, _ = load(imported, None)
    new = greedy_without_cache(mdef, params, prompt, 12)
    end = tok.token_to_id(EOS)
    new = new[:new.index(end)] if end in new else new
    assert got == tok.decode(new, skip_special_tokens=False) + "\n"


def test_a_conversation_answers_each_turn_with_the_turns_before_it(imported, capsys,
                                                                  monkeypatch):
    """`plait sample RUN --chat` without --prompt: a message a line on standard input, each
    answered as the greedy decode of the whole conversation so far (the earlier answers
    included) does; once it no longer fits model.seq_len (64 here) the oldest exchange
    is left out, the system message kept, and the user told."""
    import io

    from tokenizers import Tokenizer

    from plait.sample import greedy_without_cache, load

    said = ["what is the mesh?", "", "and the shard?", "why?", "tell me more", "more"]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(said) + "\n"))
    assert main(["sample", str(imported), "--chat", "--system", "be brief", "--tokens", "8",
                 "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    answers = out.split("\n")[:-1]
    assert len(answers) == 5  # the blank line is no turn
    tok = Tokenizer.from_file(str(imported / "tokenizer.json"))
    _, mdef, params, _ = load(imported, None)
    end = tok.token_to_id(EOS)
    turns, left_out = [], 0
    for message, answer in zip([m for m in said if m], answers, strict=True):
        turns.append(("user", message))
        while True:
            text = _rendered([{"role": "system", "content": "be brief"},
                              *({"role": r, "content": c} for r, c in turns)])
            prompt = tok.encode(text + "<assistant>\n", add_special_tokens=False).ids
            if len(prompt) + 8 <= 64:
                break
            turns, left_out = turns[2:], left_out + 2
        new = greedy_without_cache(mdef, params, prompt, 8)
        new = new[:new.index(end)] if end in new else new
        assert answer == tok.decode(new, skip_special_tokens=False)
        turns.append(("assistant", answer))
    assert left_out > 0 and f"the oldest {left_out} messages no longer fit" in err


# A template that does not render a conversation as a continuation of its first turns.
COUNTING = "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.mark.parametrize("args,message", [
    (["c.jsonl", "o.bin", "--chat", "messages"], "--chat renders conversations with the "
     "model's chat template; pass its tokenizer with --tokenizer"),
    (["c.jsonl", "o.bin", "--chat", "messages", "--prompt-field", "p", "--tokenizer", "{t}"],
     "--chat and --prompt-field are two ways to read a record"),
    (["c.jsonl", "o.bin", "--chat-template", "x.jinja", "--tokenizer", "{t}"],
     "--chat-template renders conversations: pass --chat NAME"),
    (["c.jsonl", "o.bin", "--chat", "talk", "--tokenizer", "{t}"],
     "has no field 'talk'; pass the field's name with --chat"),
    (["c.jsonl", "o.bin", "--chat", "text", "--tokenizer", "{t}"],
     "record 1 of the inputs is not a conversation"),
    (["c.jsonl", "o.bin", "--chat", "messages", "--tokenizer", "{bare}"],
     "no chat template beside"),
    (["c.jsonl", "o.bin", "--chat", "asked", "--tokenizer", "{t}"],
     "no record's --chat 'asked' holds an assistant turn: the loss mask would keep none"),
    (["c.jsonl", "o.bin", "--chat", "messages", "--tokenizer", "{t}", "--chat-template",
      "counting.jinja"], "does not render a conversation as the continuation of its first"),
    (["c.jsonl", "o.bin", "--chat", "messages", "--tokenizer", "{t}", "--chat-template",
      "broken.jinja"], "is not valid Jinja"),
])
def test_chat_mistakes_are_one_line(imported, tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": CONVERSATIONS[0],
                                                  "asked": CONVERSATIONS[0][:2],
                                                  "text": "hello"}) + "\n")
    (tmp_path / "counting.jinja").write_text(COUNTING)
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}")
    (tmp_path / "bare").mkdir()
    shutil.copyfile(imported / "tokenizer.json", tmp_path / "bare" / "tokenizer.json")
    args = [a.format(t=imported / "tokenizer.json", bare=tmp_path / "bare" / "tokenizer.json")
            for a in args]
    assert main(["data", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o.bin").exists()
