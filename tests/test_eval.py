"""Held-out evaluation of a GPT: the logged loss equals a hand computation on the same
held-out batches, on one device and on a 3-D mesh; `plait eval` scores every window of a
file the same on any mesh, an imported model as transformers does, and a local-SGD run
as its center."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import run, tiny

from plait.data.tokens import TokenFile
from plait.data.writer import write_tokens


def _softmax_xent(logits: np.ndarray, targets: np.ndarray) -> float:
    logits = logits.astype(np.float64)
    top = logits.max(-1, keepdims=True)
    lse = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
    picked = np.take_along_axis(logits, targets[..., None], -1)[..., 0]
    return float((lse - picked).mean())


@pytest.mark.parametrize("mesh", ["data=1", "data=2,fsdp=2,tensor=2"])
def test_held_out_loss_equals_a_hand_computation(mesh, tmp_path):
    import jax
    import orbax.checkpoint as ocp
    from helpers import make_mesh

    from plait.tasks import make_task

    rng = np.random.default_rng(7)
    held_out = tmp_path / "val.bin"
    write_tokens(rng.integers(0, 256, 5000), held_out, "uint16")
    exp = tiny(data={"eval_path": str(held_out), "eval_batches": 2, "eval_every_steps": 4},
               checkpoint={"enabled": True, "every_steps": 4, "keep": 5, "async_save": False},
               train={"steps": 8, "global_batch": 16, "microbatches": 2},
               log={"every_steps": 3})
    run_dir = tmp_path / "r"
    summary = run(exp, mesh, run_dir)
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evaluated = {r["step"]: r for r in records if "eval_loss" in r}
    # every 4 steps though the log is every 3 (the log steps that are multiples of 4 were
    # evaluated: step 8 alone); a log record where an evaluation falls
    assert sorted(evaluated) == [4, 8]
    assert [r["step"] for r in records] == [1, 3, 4, 6, 8]
    assert summary["records"][-1]["eval_perplexity"] == pytest.approx(
        np.exp(summary["records"][-1]["eval_loss"]))
    # By hand: the step-8 parameters, the model applied on one device, numpy's xent.
    with ocp.StandardCheckpointer() as reader:
        params = reader.restore(run_dir / "checkpoints" / "8" / "state")["params"]
    task = make_task(exp, make_mesh("data=1"))
    source = TokenFile(held_out, "uint16", exp.model.seq_len, exp.seed, exp.model.vocab)
    losses = []
    for k in range(2):
        tokens = source.rows(k, 0, exp.train.global_batch)
        logits = np.asarray(jax.jit(task.model.apply)(params, tokens[:, :-1]))
        losses.append(_softmax_xent(logits[..., : exp.model.vocab], tokens[:, 1:]))
    np.testing.assert_allclose(evaluated[8]["eval_loss"], np.mean(losses), rtol=2e-5)


def _windows_loss(task, params, tokens: np.ndarray, seq: int) -> float:
    """The mean loss over every target of the file's consecutive windows, by hand on one
    device: the whole windows together, a short last one (if any) alone at its length."""
    import jax

    vocab = task.exp.model.vocab
    full = (len(tokens) - 1) // seq
    rows = np.stack([tokens[w * seq: w * seq + seq + 1] for w in range(full)]).astype(np.int32)
    logits = np.asarray(jax.jit(task.model.apply)(params, rows[:, :-1]))[..., :vocab]
    losses = [(_softmax_xent(logits, rows[:, 1:]), rows[:, 1:].size)]
    tail = tokens[full * seq:].astype(np.int32)[None]
    if tail.shape[1] > 1:
        logits = np.asarray(task.model.apply(params, tail[:, :-1]))[..., :vocab]
        losses.append((_softmax_xent(logits, tail[:, 1:]), tail.shape[1] - 1))
    return sum(loss * n for loss, n in losses) / sum(n for _, n in losses)


SCORED_MODEL = {"layers": 2}  # the scored run's: a layer per stage of pipeline=2


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    """A tiny GPT trained 4 steps (checkpoints at 2 and 4) and a held-out file of 41
    windows of 32 targets and a 42nd of 13."""
    tmp = tmp_path_factory.mktemp("eval")
    held_out = tmp / "val.bin"
    write_tokens(np.random.default_rng(3).integers(0, 256, 41 * 32 + 13 + 1), held_out,
                 "uint16")
    exp = tiny(model=SCORED_MODEL, train={"steps": 4},
               checkpoint={"enabled": True, "every_steps": 2, "async_save": False})
    run(exp, "data=2", tmp / "r")
    return tmp / "r", held_out


@pytest.mark.parametrize("mesh", ["data=1", "data=2,fsdp=2,tensor=2", "pipeline=2,data=2"])
def test_plait_eval_scores_every_window_as_a_hand_computation(scored, mesh, tmp_path):
    import orbax.checkpoint as ocp
    from helpers import make_mesh

    from plait.cli import main
    from plait.tasks import make_task

    run_dir, held_out = scored
    out = tmp_path / "eval.json"
    assert main(["eval", str(run_dir), "--data", str(held_out), "--mesh", mesh,
                 "--batch", "8", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    # 42 windows, the last of 13 targets: 6 batches of 8, the last part-full; every
    # target scored (the two windows past the 5th batch had been left out).
    assert (got["step"], got["windows"], got["batches"], got["tokens"]) == (
        4, 42, 6, 41 * 32 + 13)
    with ocp.StandardCheckpointer() as reader:
        params = reader.restore(run_dir / "checkpoints" / "4" / "state")["params"]
    task = make_task(tiny(model=SCORED_MODEL), make_mesh("data=1"))
    tokens = np.fromfile(held_out, np.uint16)
    np.testing.assert_allclose(got["loss"], _windows_loss(task, params, tokens, 32),
                               rtol=2e-5)
    assert got["perplexity"] == pytest.approx(np.exp(got["loss"]))


def test_every_kept_checkpoint_scored_as_each_alone(scored, tmp_path, capsys):
    """--step all: one loss per kept checkpoint, each what --step N gives, the best named,
    and the curve drawn."""
    from plait.cli import main

    run_dir, held_out = scored
    common = ["eval", str(run_dir), "--data", str(held_out), "--mesh", "data=2", "--batch", "8"]
    assert main([*common, "--step", "all", "--png", str(tmp_path / "c.png"),
                 "--json", str(tmp_path / "all.json")]) == 0
    got = json.loads((tmp_path / "all.json").read_text())
    assert [c["step"] for c in got["curve"]] == [2, 4]
    for c in got["curve"]:
        assert main([*common, "--step", str(c["step"]), "--json", str(tmp_path / "one.json")]
                    ) == 0
        assert json.loads((tmp_path / "one.json").read_text())["loss"] == c["loss"]
    best = min(got["curve"], key=lambda c: c["loss"])
    assert (got["step"], got["loss"]) == (best["step"], best["loss"])
    assert f"best: step {best['step']} of" in capsys.readouterr().out
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


def test_plait_eval_of_an_imported_model_is_transformers_loss(tmp_path):
    """tests/data/hf/llama3's logits from transformers give the loss plait eval reports."""
    import shutil

    from plait.cli import main
    from plait.data.tokenizer import sidecar

    fixture = Path(__file__).parent / "data" / "hf" / "llama3"
    expected = np.load(fixture / "expected.npz")
    assert main(["import", str(fixture), "--run-dir", str(tmp_path / "ft"),
                 "--seq-len", "10"]) == 0
    for row in range(2):
        ids, logits = expected["ids"][row], expected["logits"][row]
        path = tmp_path / f"row{row}.bin"
        write_tokens(ids, path, "uint16")
        shutil.copyfile(fixture / "tokenizer.json", sidecar(path))
        out = tmp_path / f"row{row}.json"
        assert main(["eval", str(tmp_path / "ft"), "--data", str(path), "--batch", "1",
                     "--mesh", "data=1", "--max-batches", "1", "--json", str(out)]) == 0
        got = json.loads(out.read_text())  # the first window (the row's 11th target next)
        assert (got["step"], got["tokens"]) == (0, 10)
        np.testing.assert_allclose(got["loss"], _softmax_xent(logits[:10], ids[1:11]),
                                   rtol=1e-5)
    # A rotary model scored past the length it was imported for: the whole row.
    assert main(["eval", str(tmp_path / "ft"), "--data", str(tmp_path / "row1.bin"),
                 "--batch", "1", "--mesh", "data=1", "--seq-len", "11", "--json",
                 str(tmp_path / "long.json")]) == 0
    got = json.loads((tmp_path / "long.json").read_text())
    assert got["tokens"] == 11
    np.testing.assert_allclose(got["loss"], _softmax_xent(logits[:11], ids[1:12]), rtol=1e-5)


def test_a_local_sgd_run_is_read_as_its_center(tmp_path, capsys):
    """plait eval, sample and export read a DiLoCo run's center (they failed on its
    replicas before: the checkpoint was 'unusable'), and so does the held-out loss the
    run logs (it failed with a traceback before: the replicas' stacked parameters)."""
    import orbax.checkpoint as ocp
    from helpers import make_mesh

    from plait.cli import main
    from plait.tasks import make_task

    held_out = tmp_path / "val.bin"
    write_tokens(np.random.default_rng(4).integers(0, 256, 8 * 32 + 1), held_out, "uint16")
    exp = tiny(train={"steps": 4}, sync={"method": "diloco", "period": 2},
               checkpoint={"enabled": True, "every_steps": 4, "async_save": False},
               data={"eval_path": str(held_out), "eval_batches": 1, "eval_every_steps": 4})
    run_dir = tmp_path / "r"
    logged = run(exp, "data=2,fsdp=2", run_dir)["records"][-1]["eval_loss"]
    out = tmp_path / "eval.json"
    assert main(["eval", str(run_dir), "--data", str(held_out), "--mesh", "data=2",
                 "--batch", "8", "--json", str(out)]) == 0
    assert "the diloco center" in capsys.readouterr().err
    with ocp.StandardCheckpointer() as reader:
        center = reader.restore(run_dir / "checkpoints" / "4" / "state")["sync"]["center"]
    task = make_task(tiny(), make_mesh("data=1"))
    want = _windows_loss(task, center, np.fromfile(held_out, np.uint16), 32)
    np.testing.assert_allclose(json.loads(out.read_text())["loss"], want, rtol=2e-5)
    # The step-4 held-out loss: the center (met at step 4) on the first held-out batch.
    import jax

    rows = TokenFile(held_out, "uint16", 32, exp.seed, 256).rows(0, 0, 16)
    logits = np.asarray(jax.jit(task.model.apply)(center, rows[:, :-1]))
    np.testing.assert_allclose(logged, _softmax_xent(logits[..., :256], rows[:, 1:]),
                               rtol=2e-5)
    assert main(["sample", str(run_dir), "--prompt", "ab", "--tokens", "3"]) == 0
    assert main(["export", str(run_dir), "--out", str(tmp_path / "hf")]) == 0


@pytest.mark.parametrize("args, needle", [
    ([], "has no data.eval_path; pass --data"),
    (["--data", "{tmp}/none.bin"], "not found (--data)"),
    (["--data", "{tmp}/one.bin"], "holds fewer than 2 tokens: nothing to score"),
    (["--data", "{val}", "--step", "3"], "--step 3: no checkpoint of step 3"),
    (["--data", "{bpe}"], "was tokenized with val_bpe.bin.tokenizer.json, not as the run"),
    (["--data", "{val}", "--batch", "3", "--mesh", "data=2"],
     "--batch 3 does not split over data = 2"),
    # without --batch: was "train.global_batch = 16 ... make global_batch a multiple of 3"
    (["--data", "{val}", "--mesh", "data=3"],
     "--batch 16 (the run's train.global_batch) does not split over data = 3 in each of "
     "train.microbatches = 1; pass --batch a multiple of 3"),
    # a text file: its bytes read as ids past the vocabulary
    (["--data", "{tmp}/corpus.txt"], "'{tmp}/corpus.txt' (--data) is text, not a token file; "
                                     "make one with `plait data {tmp}/corpus.txt "
                                     "{tmp}/corpus.bin`"),
    (["--data", "{val}", "--seq-len", "64"], "learned position table holds model.seq_len = 32"),
    (["--data", "{val}", "--png", "{tmp}/c.png"], "--png draws the loss of every kept"),
    # matplotlib's ValueError, after every checkpoint was scored
    (["--data", "{val}", "--step", "all", "--png", "{tmp}/c.txt"],
     "a picture is written in the format its name ends in, and '.txt' is none"),
    (["--data", "{val}", "--step", "last"], "--step takes a checkpoint's step or 'all'"),
])
def test_plait_eval_mistakes_are_one_line(scored, tmp_path, capsys, args, needle):
    import shutil

    from plait.cli import main
    from plait.data.tokenizer import sidecar

    run_dir, held_out = scored
    bpe = tmp_path / "val_bpe.bin"
    shutil.copyfile(held_out, bpe)
    shutil.copyfile(Path(__file__).parent / "data" / "hf" / "llama3" / "tokenizer.json",
                    sidecar(bpe))
    write_tokens(np.array([7]), tmp_path / "one.bin", "uint16")
    (tmp_path / "corpus.txt").write_text("a text, not its tokens\n" * 20)
    subs = {"{tmp}": str(tmp_path), "{val}": str(held_out), "{bpe}": str(bpe)}
    args = [next((a.replace(k, v) for k, v in subs.items() if k in a), a) for a in args]
    assert main(["eval", str(run_dir), *args]) == 2
    err = capsys.readouterr().err.strip()
    needle = needle.replace("{tmp}", str(tmp_path))
    assert needle in err and "\n" not in err and "Traceback" not in err


def test_a_reader_restores_the_parameters_alone(scored):
    """plait eval, sample and export read the parameters without the optimizer's moments
    (a third of the state with AdamW), bit for bit what the whole checkpoint holds."""
    import jax
    import orbax.checkpoint as ocp
    from helpers import make_mesh

    from plait.checkpoint import Checkpoints
    from plait.tasks import make_task

    run_dir = scored[0]
    ckpts = Checkpoints(run_dir / "checkpoints", keep=1, async_save=False, read_only=True)
    task = make_task(tiny(model=SCORED_MODEL), make_mesh("data=1"))
    abstract, take, note = task.params_plan(ckpts.record(4))
    state, meta = ckpts.restore_step(abstract, 4, flag="--step")
    assert list(state) == ["params"] and note is None and meta["step"] == 4
    with ocp.StandardCheckpointer() as reader:
        whole = reader.restore(run_dir / "checkpoints" / "4" / "state")
    assert "opt_state" in whole
    same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), take(state), whole["params"])
    assert all(jax.tree.leaves(same))
