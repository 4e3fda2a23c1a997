"""plait sample and tokenizer files: the KV-cache decode against the whole-sequence model,
sampling controls, a trained BPE tokenizer through plait data, train and sample."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import run, tiny, write_experiment

from plait.cli import main
from plait.data.tokenizer import HFTokenizer, sidecar
from plait.sample import generator, greedy_without_cache, load

TEXT = "".join(f"the cat sat on mat {i % 7}; a dog ran to the log {i % 5}.\n"
               for i in range(600))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny GPT trained on the synthetic streams, checkpointed at steps 8 and 16
    (layers scanned in memory: the checkpoint holds them one entry each)."""
    run_dir = tmp_path_factory.mktemp("sample") / "run"
    exp = tiny(train={"steps": 16}, model={"layers": 2, "scan_layers": True},
               checkpoint={"enabled": True, "every_steps": 8, "async_save": False})
    run(exp, "data=2", run_dir)
    return run_dir


def test_cached_decode_equals_the_whole_sequence_model(trained):
    exp, mdef, params, step = load(trained, None)
    assert step == 16
    model = mdef.module(params)
    tokens = jnp.asarray([[3, 17, 42, 7, 99, 5, 61, 200, 13, 8]], jnp.int32)
    full = model(tokens)
    S = exp.model.seq_len
    empty = jnp.zeros((1, S, exp.model.heads, exp.model.d_model // exp.model.heads))
    caches = [(empty, empty)] * exp.model.layers
    # The prompt's first 6 tokens at once, then one token at a time over the cache.
    got, caches = model.decode(tokens[:, :6], caches, jnp.int32(0))
    pieces = [got]
    for i in range(6, 10):
        got, caches = model.decode(tokens[:, i:i + 1], caches, jnp.int32(i))
        pieces.append(got)
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, rtol=2e-5, atol=2e-5)


def test_greedy_sampling_matches_a_decode_without_cache(trained):
    exp, mdef, params, _ = load(trained, None)
    prompt = [1, 2, 3, 4, 5]
    want = greedy_without_cache(mdef, params, prompt, 20)
    key = jax.random.key(0)
    greedy = generator(mdef, None, 20, 0.0, 0)
    got = [int(t) for t in greedy(params, jnp.asarray(prompt), key)]
    assert got == want
    # Temperature 0 ignores the seed; top-k 1 is greedy at any temperature.
    assert [int(t) for t in greedy(params, jnp.asarray(prompt), jax.random.key(9))] == want
    top1 = generator(mdef, None, 20, 1.0, 1)
    assert [int(t) for t in top1(params, jnp.asarray(prompt), key)] == want
    # Drawn samples: reproducible by seed, different across seeds.
    drawn = generator(mdef, None, 20, 1.5, 0)
    a = [int(t) for t in drawn(params, jnp.asarray(prompt), jax.random.key(1))]
    assert a == [int(t) for t in drawn(params, jnp.asarray(prompt), jax.random.key(1))]
    assert a != [int(t) for t in drawn(params, jnp.asarray(prompt), jax.random.key(2))]


def test_sample_from_a_chosen_step_leaves_the_run_untouched(trained, capsys):
    before = sorted(p.name for p in (trained / "checkpoints").iterdir())
    assert main(["sample", str(trained), "--prompt", "ab", "--tokens", "5",
                 "--temperature", "0", "--step", "8"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("ab")
    assert "5 tokens from the checkpoint at step 8 (tokenizer: bytes)" in captured.err
    assert sorted(p.name for p in (trained / "checkpoints").iterdir()) == before
    # Without --tokens: 100, or half a shorter context (this model's 32: the default of 100
    # had refused every prompt on a model of under 101 positions).
    assert main(["sample", str(trained), "--prompt", "ab", "--temperature", "0"]) == 0
    assert "16 tokens from the checkpoint at step 16" in capsys.readouterr().err
    assert main(["sample", str(trained), "--prompt", "a" * 20]) == 2
    assert ("the prompt (20 tokens) plus the default --tokens 16 is more than model.seq_len "
            "= 32; ask for at most 12 tokens") in capsys.readouterr().err


@pytest.mark.parametrize("args,needle", [
    (["--step", "5"], "--step 5: no checkpoint of step 5"),
    (["--tokens", "40"], "plus --tokens 40 is more than model.seq_len = 32"),
    (["--prompt", ""], "the prompt is empty"),
    # longer than the context alone: was "ask for at most 0 tokens"
    (["--prompt", "a" * 40], "the prompt is 40 tokens, model.seq_len = 32 with room for one "
                             "generated: shorten it to at most 31 tokens"),
    (["--temperature", "-1"], "--temperature must be a number >= 0"),
    (["--temperature", "nan"], "--temperature must be a number >= 0"),  # sampled before
    (["--seed", str(2**64)], "--seed must be between 0 and 2**63 - 1"),  # OverflowError
    # a command line's byte that is not UTF-8 (Python keeps it as a lone surrogate): the
    # byte-level codec's encode raised UnicodeEncodeError
    (["--prompt", "caf\udce9"], "--prompt is not UTF-8 text (a byte that is not UTF-8 at "
                                "character 3); pass it in UTF-8"),
])
def test_sample_mistakes_are_one_line(trained, capsys, args, needle):
    argv = ["sample", str(trained), "--prompt", "abc", *args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("args,needle", [
    ([], "give the text to continue with --prompt TEXT (or --chat alone to converse"),
    (["--chat"], "--chat needs the run's tokenizer and chat template"),
])
def test_sample_without_a_prompt_is_a_chat_or_a_one_line_refusal(trained, capsys, args,
                                                                 needle):
    assert main(["sample", str(trained), *args]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1, err


def test_sample_needs_a_gpt_run_with_checkpoints(tmp_path, capsys):
    assert main(["sample", str(tmp_path / "none"), "--prompt", "a"]) == 2
    assert "not found" in capsys.readouterr().err
    exp = tiny(train={"steps": 2})  # checkpoints disabled
    run(exp, "data=1", tmp_path / "r")
    assert main(["sample", str(tmp_path / "r"), "--prompt", "a"]) == 2
    assert "has no checkpoints yet" in capsys.readouterr().err


def _bpe(path, vocab: int):
    """A byte-level BPE tokenizer trained on TEXT (nothing downloaded)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(
        vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))
    return path


def test_bpe_tokenizer_through_data_train_and_sample(tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    tok_file = _bpe(tmp_path / "tokenizer.json", 300)
    out = tmp_path / "tok.bin"
    assert main(["data", str(text), str(out), "--tokenizer", str(tok_file)]) == 0
    size = HFTokenizer(tok_file).vocab_size
    assert f"model.vocab >= {size}" in capsys.readouterr().out
    ids = np.fromfile(out, np.uint16)
    assert ids.max() >= 256 and len(ids) < len(TEXT) / 2  # merges were used
    assert sidecar(out).read_text() == tok_file.read_text()
    assert HFTokenizer(tok_file).decode(ids.tolist()) == TEXT  # round trip

    data = {"source": "tokens", "path": str(out)}
    small = write_experiment(tmp_path / "small.toml", tiny(data=data))
    assert main(["train", str(small), "--mesh", "data=1", "--run-dir", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert f"tokenized with tok.bin.tokenizer.json ({size} ids)" in err
    assert f"model.vocab = 256; set model.vocab >= {size}" in err

    exp = write_experiment(tmp_path / "bpe.toml", tiny(
        data=data, model={"vocab": 320}, train={"steps": 40},
        checkpoint={"enabled": True, "every_steps": 40, "async_save": False}))
    run_dir = tmp_path / "run"
    assert main(["train", str(exp), "--mesh", "data=1", "--run-dir", str(run_dir)]) == 0
    assert (run_dir / "tokenizer.json").read_text() == tok_file.read_text()
    capsys.readouterr()
    assert main(["sample", str(run_dir), "--prompt", "the cat sat", "--tokens", "12",
                 "--temperature", "0"]) == 0
    captured = capsys.readouterr()
    assert "(tokenizer: tokenizer.json)" in captured.err
    _, mdef, params, _ = load(run_dir, None)
    prompt = HFTokenizer(tok_file).encode("the cat sat")
    want = greedy_without_cache(mdef, params, prompt, 12)
    assert captured.out == "the cat sat" + HFTokenizer(tok_file).decode(want) + "\n"


def test_bad_tokenizer_file_is_one_line(tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("hello\n")
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    assert main(["data", str(text), str(tmp_path / "o.bin"), "--tokenizer", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "could not be read" in err and len(err.strip().splitlines()) == 1
    assert main(["data", str(text), str(tmp_path / "o.bin"), "--tokenizer",
                 str(tmp_path / "missing.json")]) == 2
    assert "not found" in capsys.readouterr().err
