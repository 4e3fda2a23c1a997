import re

import jax
import numpy as np
import pytest
from helpers import make_mesh, plait_cmd, tiny

from plait import data, sharding
from plait.data.synthetic import SyntheticTokens
from plait.data.tokens import TokenFile
from plait.data.writer import encode_text_file
from plait.errors import UserError


def test_rows_are_a_pure_function_of_seed_step_row():
    src = SyntheticTokens(vocab=256, seq_len=32, seed=7)
    whole = src.rows(3, 0, 16)
    np.testing.assert_array_equal(src.rows(3, 5, 9), whole[5:9])
    np.testing.assert_array_equal(SyntheticTokens(256, 32, 7).rows(3, 0, 16), whole)
    assert not np.array_equal(src.rows(4, 0, 16), whole)
    assert whole.min() >= 0 and whole.max() < 256


@pytest.mark.parametrize("spec", ["data=8", "data=2,fsdp=2,tensor=2", "fsdp=4"])
def test_global_batch_is_the_same_on_every_mesh(spec):
    exp = tiny(train={"microbatches": 2})
    from plait.data.synthetic import SyntheticTokens

    src = SyntheticTokens(exp.model.vocab, exp.model.seq_len, exp.seed, exp.data.successors)
    shape = (exp.train.microbatches, exp.train.global_batch // exp.train.microbatches,
             exp.model.seq_len + 1)
    ref = np.asarray(data.global_batch(src, 5, shape, sharding.replicated(make_mesh("data=1"))))
    mesh = make_mesh(spec)
    sh = sharding.batch_sharding(mesh, sharding.rules_for(mesh), 3, batch_dim=1)
    arr = data.global_batch(src, 5, shape, sh)
    np.testing.assert_array_equal(np.asarray(jax.device_get(arr)), ref)
    # Each device holds only its rows.
    n = mesh.shape["data"] * mesh.shape["fsdp"]
    assert arr.addressable_shards[0].data.shape == (2, shape[1] // n, shape[2])


def test_token_file_round_trip(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("hello plait " * 200)
    out = tmp_path / "t.bin"
    proc = plait_cmd("data", str(text), str(out))
    assert proc.returncode == 0, proc.stderr
    assert out.stat().st_size == 2 * len("hello plait " * 200)
    tf = TokenFile(out, "uint16", seq_len=16, seed=0, vocab=256)
    rows = tf.rows(0, 0, 4)
    assert rows.shape == (4, 17)
    assert bytes(rows[0].astype(np.uint8)).decode() in "hello plait " * 200
    np.testing.assert_array_equal(tf.rows(0, 2, 4), rows[2:4])


def test_token_file_errors(tmp_path):
    out = tmp_path / "t.bin"
    encode_text_file(_write(tmp_path / "a.txt", "ÿ" * 50), out)
    with pytest.raises(UserError, match=r"token id 195 >= model.vocab = 100"):
        TokenFile(out, "uint16", seq_len=8, seed=0, vocab=100)
    with pytest.raises(UserError, match=r"fewer than model.seq_len"):
        TokenFile(out, "uint16", seq_len=500, seed=0, vocab=256)
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(UserError, match=r"not a whole number of uint16 tokens; check "
                       r"data.dtype"):
        TokenFile(tmp_path / "odd.bin", "uint16", seq_len=1, seed=0, vocab=256)
    # read at the wrong width (plait eval's --dtype): the ids are the sign, so the line
    # names the width as well as the vocabulary
    with pytest.raises(UserError, match=r"token id \d+ >= model.vocab = 256 .*; raise "
                       r"model.vocab or re-tokenize, or check --dtype \(uint32: the file's "
                       r"id width\)"):
        TokenFile(out, "uint32", seq_len=8, seed=0, vocab=256, dtype_key="--dtype")


def test_training_on_a_token_file(tmp_path):
    from helpers import losses, run

    text = _write(tmp_path / "a.txt", "the quick brown fox jumps over the lazy dog. " * 400)
    encode_text_file(text, tmp_path / "a.bin")
    exp = tiny(data={"source": "tokens", "path": str(tmp_path / "a.bin")})
    got = losses(run(exp, "data=2,tensor=2", tmp_path / "run"))
    assert got[-1] < got[0] - 0.5


def _write(path, text):
    path.write_text(text)
    return path


def click_experiment(popularity: str = "powerlaw", fixed: bool = False):
    from plait.config import Experiment

    return Experiment.model_validate({
        "name": "clicks", "seed": 3,
        "model": {"kind": "dlrm", "embedding_rows": [1000, 50, 70000], "embedding_dim": 8,
                  "bottom_mlp": [16, 8], "top_mlp": [16, 1], "dense_features": 5},
        "data": {"source": "clicks", "ids_per_lookup": 6, "ids_fixed": fixed,
                 "popularity": popularity},
        "train": {"global_batch": 64}})


@pytest.mark.parametrize("popularity,fixed", [("powerlaw", False), ("uniform", True)])
def test_click_batches_are_the_same_on_every_mesh_and_made_on_the_devices(popularity, fixed):
    from plait.tasks.dlrm import DLRMTask

    exp = click_experiment(popularity, fixed)
    one = DLRMTask(exp, make_mesh("data=1"))
    ref = jax.tree.map(np.asarray, one.batch(one.source(), 7))
    for spec in ("data=8", "data=2,fsdp=4"):
        task = DLRMTask(exp, make_mesh(spec))
        got = task.batch(task.source(), 7)
        for name, arr in got.items():
            assert arr.sharding == task.batch_sharding[name]
            np.testing.assert_array_equal(np.asarray(arr), ref[name], err_msg=f"{spec} {name}")
    # Each device makes only its rows, with no communication.
    source = task.source()
    hlo = source._batch_fn(64, tuple(sorted(task.batch_sharding.items()))).lower(
        source._words(7)).compile().as_text()
    assert not re.search(r"(all-reduce|all-gather|all-to-all|collective-permute|"
                         r"reduce-scatter)[-(]", hlo)
    assert re.search(r"s32\[8,3,6\]", hlo) and not re.search(r"\[64,3,6\]", hlo)
    # The host path gives the same rows; another step gives others.
    rows = one.source().rows(7, 10, 20)
    for name in ref:
        np.testing.assert_array_equal(rows[name], ref[name][10:20])
    assert not np.array_equal(np.asarray(one.batch(one.source(), 8)["ids"]), ref["ids"])
    ids, R = ref["ids"], np.asarray(exp.model.embedding_rows)[None, :, None]
    assert ((ids >= 0) & (ids < R) | (ids == -1)).all()
    assert (ids[:, :, 0] >= 0).all() and (fixed == (ids >= 0).all())
    assert 0.3 < ref["labels"].mean() < 0.7
    assert ref["dense"].min() >= 0 and ref["dense"].max() < 1


def test_click_batches_are_the_same_across_two_processes(tmp_path):
    import subprocess
    import sys

    from helpers import ROOT, subprocess_env

    from plait.launch import free_port
    from plait.tasks.dlrm import DLRMTask

    port = free_port()
    env = subprocess_env()
    env["PYTHONPATH"] = str(ROOT / "tests")
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "clicks_worker.py"),
                               str(port), str(i), str(tmp_path / f"p{i}.npz")],
                              env=env, stderr=subprocess.PIPE, text=True) for i in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=180)
        assert p.returncode == 0, err[-2000:]
    one = DLRMTask(click_experiment(), make_mesh("data=1"))
    ref = jax.tree.map(np.asarray, one.batch(one.source(), 7))
    seen = 0
    for i in range(2):
        with np.load(tmp_path / f"p{i}.npz") as z:
            for key in z.files:
                name, start = key.split(":")
                part = z[key]
                np.testing.assert_array_equal(part, ref[name][int(start):int(start) + len(part)])
                seen += len(part) if name == "labels" else 0
    assert seen == 64  # the two processes together made every row once


def test_an_id_past_the_vocabulary_deep_in_the_file_stops_training_in_one_line(tmp_path,
                                                                               capsys):
    """The first million ids are checked at start; past them, each window as it is read
    (the embedding lookup would clamp such an id, and training would go on, wrong)."""
    from helpers import tiny, write_experiment

    from plait.cli import main

    path = tmp_path / "t.bin"
    ids = np.random.default_rng(0).integers(0, 256, 2 << 20).astype(np.uint16)
    ids[(1 << 20) + 5:] = 300  # the second half is out of model.vocab = 256
    ids.tofile(path)
    source = TokenFile(path, "uint16", seq_len=8, seed=0, vocab=256)  # the start is fine
    with pytest.raises(UserError, match=r"token id 300 >= model.vocab = 256 \(the first at "
                                        r"token 1,048,58[0-9]"):
        source.window((1 << 20) - 2, 40)
    cfg = write_experiment(tmp_path / "e.toml", tiny(data={"source": "tokens",
                                                           "path": str(path)}))
    assert main(["train", str(cfg), "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "token id 300 >= model.vocab = 256" in err[0], err


def test_a_token_file_of_another_tokenizer_than_the_runs_is_refused(tmp_path, capsys):
    """An imported run (its tokenizer.json beside the step-0 checkpoint) trained on a
    byte-level token file: the model learned byte ids as if they were its tokenizer's,
    and `plait sample` decoded them with the tokenizer. Refused before the run directory
    is touched; a run with checkpoints and no tokenizer is refused a tokenized file the
    same way (the file would have replaced nothing, but the ids mean other text); the
    run's own tokenizer, or a new run directory, is taken."""
    import hashlib
    import shutil

    from helpers import ROOT

    from plait.cli import main
    from plait.data.tokenizer import RUN_FILE
    from plait.tasks.gpt_data import run_files

    def snapshot_files(d):
        return {str(p): hashlib.sha1(p.read_bytes()).hexdigest()
                for p in sorted(d.rglob("*")) if p.is_file()}

    hf = ROOT / "tests" / "data" / "hf" / "llama3"
    run = tmp_path / "imported"
    assert main(["import", str(hf), "--run-dir", str(run), "--seq-len", "16"]) == 0
    (tmp_path / "a.txt").write_text("the mesh trains " * 100)
    encode_text_file(tmp_path / "a.txt", tmp_path / "bytes.bin")
    encode_text_file(tmp_path / "a.txt", tmp_path / "bpe.bin", tokenizer=run / RUN_FILE)
    capsys.readouterr()
    before = snapshot_files(run)
    assert main(["train", str(run / "config.toml"), "--run-dir", str(run), "--steps", "1",
                 "--mesh", "data=1", "--set", f'data.path="{tmp_path / "bytes.bin"}"']) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and (
        f"data file '{tmp_path / 'bytes.bin'}' (data.path) was tokenized byte-level (no "
        f"tokenizer), not as the run '{run}' was; make it again with `plait data ... "
        f"--tokenizer {run / RUN_FILE}`") in err[0], err
    assert snapshot_files(run) == before

    bpe = TokenFile(tmp_path / "bpe.bin", "uint16", seq_len=8, seed=0, vocab=512)
    assert run_files(bpe, run) == {RUN_FILE: bpe.tokenizer}
    assert run_files(bpe, tmp_path / "new") == {RUN_FILE: bpe.tokenizer}
    byte_run = tmp_path / "byte-run"
    (byte_run / "checkpoints").mkdir(parents=True)
    with pytest.raises(UserError, match=r"was tokenized with bpe.bin.tokenizer.json, not "
                       r"as the run .* was; make it again with `plait data without "
                       r"--tokenizer`"):
        run_files(bpe, byte_run)
    shutil.rmtree(byte_run / "checkpoints")  # a fresh directory takes the data's
    assert run_files(bpe, byte_run) == {RUN_FILE: bpe.tokenizer}
