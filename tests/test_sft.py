"""Supervised fine-tuning on prompt/response records: `plait data --prompt-field` writes
a loss mask that keeps each response and its end, not its prompt; training's loss is
the mean over the kept targets of the whole batch (not microbatch by microbatch) and
equal on every mesh; held-out figures and `plait eval` count the same targets."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import losses, run, tiny

from plait.cli import main
from plait.data.documents import is_held_out
from plait.data.tokens import TokenFile, loss_mask_path

# Prompts of very different lengths, so the batches' microbatches keep unequal numbers
# of targets and a loss normalized microbatch by microbatch would differ.
RECORDS = [{"prompt": f"Q{i}: " + "why " * (i % 9) + "is the sky blue?\nA: ",
            "response": "because of scattering. " * (1 + i % 3)} for i in range(120)]


def _xent(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Each token's cross-entropy, in float64."""
    logits = logits.astype(np.float64)
    top = logits.max(-1, keepdims=True)
    lse = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
    return lse - np.take_along_axis(logits, targets[..., None], -1)[..., 0]


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    """A byte-level token file of the records with its loss mask, and a held-out one."""
    root = tmp_path_factory.mktemp("sft")
    with (root / "sft.jsonl").open("w") as f:
        f.writelines(json.dumps(r) + "\n" for r in RECORDS)
    assert main(["data", str(root / "sft.jsonl"), str(root / "sft.bin"), "--prompt-field",
                 "prompt", "--field", "response", "--held-out", "0.1"]) == 0
    return root


def test_records_become_tokens_and_a_mask_that_keeps_the_responses(tmp_path, capsys):
    """With a tokenizer that starts a text with <s>: each record is <s> prompt, response
    (run on, no <s>), end-of-text; the mask is 0 on the prompt, 1 on the rest; Parquet
    gives the same as JSON Lines (a null response skips its row); held-out records take
    their masks with them; a file written again without --prompt-field loses its mask."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    texts = [r[k] for r in RECORDS for k in ("prompt", "response")]
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "<|endoftext|>"]))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[
        ("<s>", tok.token_to_id("<s>"))])
    tok.save(str(tmp_path / "tok.json"))
    with (tmp_path / "a.jsonl").open("w") as f:
        f.writelines(json.dumps(r) + "\n" for r in RECORDS[:60])
    pq.write_table(pa.table({"prompt": [r["prompt"] for r in RECORDS[60:]] + ["lost?"],
                             "response": [r["response"] for r in RECORDS[60:]] + [None]}),
                   tmp_path / "b.parquet", row_group_size=16)
    out = tmp_path / "out.bin"
    assert main(["data", str(tmp_path / "a.jsonl"), str(tmp_path / "b.parquet"), str(out),
                 "--prompt-field", "prompt", "--field", "response", "--tokenizer",
                 str(tmp_path / "tok.json"), "--held-out", "0.25"]) == 0
    said = capsys.readouterr().out
    assert "90 documents" in said and "training learns the" in said

    start, end = tok.token_to_id("<s>"), tok.token_to_id("<|endoftext|>")
    want = {False: ([], []), True: ([], [])}
    for i, r in enumerate(RECORDS):
        asked = tok.encode(r["prompt"]).ids
        answer = tok.encode(r["response"], add_special_tokens=False).ids
        assert asked[0] == start and start not in answer
        ids, mask = want[is_held_out(i, 0.25)]
        ids += [*asked, *answer, end]
        mask += [0] * len(asked) + [1] * (len(answer) + 1)
    for path, held in ((out, False), (tmp_path / "out.val.bin", True)):
        np.testing.assert_array_equal(np.fromfile(path, np.uint16), want[held][0])
        np.testing.assert_array_equal(np.fromfile(loss_mask_path(path), np.uint8),
                                      want[held][1])
    assert f"{sum(want[False][1]):,} tokens of the responses" in said
    # The batch carries the tokens the loss leaves out as ~id.
    source = TokenFile(out, "uint16", 32, 0, 300)
    np.testing.assert_array_equal(source.window(5, 40), np.where(
        np.array(want[False][1][5:45]) == 1, want[False][0][5:45],
        ~np.array(want[False][0][5:45])))
    # Written again as plain documents: no mask left behind to train on the wrong tokens.
    assert main(["data", str(tmp_path / "a.jsonl"), str(out), "--field", "response"]) == 0
    assert not loss_mask_path(out).exists() and TokenFile(out, "uint16", 32, 0, 256).mask is None


@pytest.mark.parametrize("args,message", [
    (["text.txt", "out.bin", "--prompt-field", "prompt"],
     "--prompt-field reads JSON Lines or Parquet records"),
    (["sft.jsonl", "out.bin", "--prompt-field", "response", "--field", "response"],
     "--prompt-field and --field both name 'response'"),
    (["sft.jsonl", "out.bin", "--prompt-field", "question", "--field", "response"],
     "has no field 'question'; pass the field's name with --prompt-field"),
])
def test_record_mistakes_are_one_line(sft, tmp_path, capsys, args, message, monkeypatch):
    (tmp_path / "text.txt").write_text("some text\n")
    (tmp_path / "sft.jsonl").write_text((sft / "sft.jsonl").read_text())
    monkeypatch.chdir(tmp_path)
    assert main(["data", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and not (tmp_path / "out.bin").exists()


def test_records_are_indexed_and_fine_tuning_rows_start_at_them(sft, tmp_path):
    """plait data writes where each record starts (OUT.bin.documents, and the held-out
    file's own); with a loss mask, rows start at those starts by default
    (data.row_start = "auto"), at random offsets with "anywhere" as before; a text
    file has no index, and "document" on it is one line."""
    from plait.data.tokens import index_path
    from plait.errors import UserError

    lengths = {False: [], True: []}
    for i, r in enumerate(RECORDS):
        lengths[is_held_out(i, 0.1)].append(len((r["prompt"] + r["response"]).encode()))
    for path, held in ((sft / "sft.bin", False), (sft / "sft.val.bin", True)):
        np.testing.assert_array_equal(np.fromfile(index_path(path), "<i8"),
                                      np.cumsum([0, *lengths[held][:-1]]))
    starts = np.fromfile(index_path(sft / "sft.bin"), "<i8")
    rows_of = {mode: TokenFile(sft / "sft.bin", "uint16", 32, 0, 256, row_start=mode)
               for mode in ("auto", "anywhere", "document")}
    assert rows_of["auto"].row_start == "document"
    auto = rows_of["auto"].rows(5, 0, 16)
    np.testing.assert_array_equal(auto, rows_of["document"].rows(5, 0, 16))
    windows = {s: rows_of["auto"].window(s, 33).tobytes() for s in starts}
    assert all(row.tobytes() in windows.values() for row in auto)
    # anywhere: the offset drawn from (seed, step, row) over the whole file, as before
    hi = len(rows_of["anywhere"].tokens) - 33
    for r, row in enumerate(rows_of["anywhere"].rows(5, 0, 16)):
        offset = int(np.random.default_rng([0, 5, r]).integers(0, hi + 1))
        np.testing.assert_array_equal(row, rows_of["anywhere"].window(offset, 33))
    text = tmp_path / "t.txt"
    text.write_text("plain text, one document " * 20)
    assert main(["data", str(text), str(tmp_path / "t.bin")]) == 0
    assert not index_path(tmp_path / "t.bin").exists()
    assert TokenFile(tmp_path / "t.bin", "uint16", 32, 0, 256).row_start == "anywhere"
    with pytest.raises(UserError, match="data.row_start = \"document\" needs the document "
                                        "index beside"):
        TokenFile(tmp_path / "t.bin", "uint16", 32, 0, 256, row_start="document")


def _sft(root, **sections):
    train = {"steps": 6, "global_batch": 16, "microbatches": 2, **sections.pop("train", {})}
    # two layers: the ZB-H1 case gives each stage one, against the same reference
    model = {"layers": 2, **sections.pop("model", {})}
    return tiny(model=model, data={"source": "tokens", "path": str(root / "sft.bin")},
                train=train, **sections)


@pytest.fixture(scope="module")
def reference(sft, tmp_path_factory):
    """The one-device run (two microbatches), checkpointed every third step."""
    run_dir = tmp_path_factory.mktemp("sft-ref") / "r"
    run(_sft(sft, checkpoint={"enabled": True, "every_steps": 3, "async_save": False}),
        "data=1", run_dir)
    return run_dir


def test_the_loss_is_the_mean_over_the_kept_targets_of_the_whole_batch(sft, reference):
    """Step 4's loss (the parameters of the step-3 checkpoint) equals numpy's mean over
    the kept targets of its batch; and on a batch whose first microbatch keeps one target
    a row and whose second keeps them all, the step's loss is that mean over the whole
    batch, not the mean of the microbatches' means."""
    import jax
    import orbax.checkpoint as ocp
    from helpers import make_mesh

    from plait.tasks import make_task

    exp = _sft(sft)
    task = make_task(exp, make_mesh("data=1"))
    with ocp.StandardCheckpointer() as reader:
        params = reader.restore(reference / "checkpoints" / "3" / "state")["params"]
    source = TokenFile(sft / "sft.bin", "uint16", 32, exp.seed, 256)

    def per_token(rows):
        ids = np.where(rows < 0, ~rows, rows)
        logits = np.asarray(jax.jit(task.model.apply)(params, ids[:, :-1]))[..., :256]
        return _xent(logits, ids[:, 1:]), rows[:, 1:] >= 0

    losses_, kept = per_token(source.rows(3, 0, 16))
    assert 0 < kept.mean() < 0.9  # the prompts are left out
    np.testing.assert_allclose(losses(reference)[3], losses_[kept].mean(), rtol=2e-5)

    ids = np.where(source.rows(4, 0, 16) < 0, ~source.rows(4, 0, 16), source.rows(4, 0, 16))
    crafted = ids.copy()
    crafted[:8, 2:] = ~crafted[:8, 2:]  # rows 0-7 keep their first target alone
    losses_, kept = per_token(crafted)
    whole = losses_[kept].mean()
    halves = np.mean([losses_[h][kept[h]].mean() for h in (slice(0, 8), slice(8, 16))])
    assert abs(halves - whole) > 0.01, (halves, whole)  # far past the tolerance below
    _, metrics = task.step_fn(task.init_state(params), crafted.reshape(2, 8, 33))
    np.testing.assert_allclose(float(metrics["loss"]), whole, rtol=2e-5)


@pytest.mark.parametrize("spec,sections", [
    ("data=2,fsdp=2,tensor=2", {"model": {"loss_chunks": 2}, "train": {"microbatches": 1}}),
    ("pipeline=2,data=2", {"pipeline": {"schedule": "zb-h1", "microbatches": 4},
                           "train": {"microbatches": 1}}),
    ("data=2,context=2", {}),
    ("data=2@dcn,data=2,tensor=2", {}),  # replicas reduced within each host first
], ids=["3d-one-microbatch-loss-chunks", "zb-h1", "context-ring", "dcn-hierarchical"])
def test_masked_losses_equal_the_one_device_run(sft, reference, tmp_path, spec, sections):
    got = losses(run(_sft(sft, **sections), spec, tmp_path))
    np.testing.assert_allclose(got, losses(reference), rtol=1e-4)


def test_held_out_and_plait_eval_count_the_kept_targets(sft, reference, tmp_path):
    """plait eval on the held-out file (its mask beside it) equals numpy's mean over the
    kept targets of its windows, with the trained parameters."""
    import jax
    import orbax.checkpoint as ocp
    from helpers import make_mesh

    from plait.tasks import make_task

    out = tmp_path / "eval.json"
    val = sft / "sft.val.bin"
    assert main(["eval", str(reference), "--data", str(val), "--mesh", "data=2,tensor=2",
                 "--batch", "4", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    with ocp.StandardCheckpointer() as reader:
        params = reader.restore(reference / "checkpoints" / "6" / "state")["params"]
    task = make_task(_sft(sft), make_mesh("data=1"))
    file = TokenFile(val, "uint16", 32, 0, 256, spare=0)
    # The whole windows together, a short last one (if any) alone at its length; the
    # kept targets' losses.
    full = (len(file.tokens) - 1) // 32
    pieces = [np.stack([file.window(w * 32, 33) for w in range(full)])]
    if full < got["windows"]:
        pieces.append(file.window(full * 32, len(file.tokens) - full * 32)[None])
    losses = []
    for rows in pieces:
        ids = np.where(rows < 0, ~rows, rows)
        logits = np.asarray(jax.jit(task.model.apply)(params, ids[:, :-1]))[..., :256]
        losses.append(_xent(logits, ids[:, 1:])[rows[:, 1:] >= 0])
    losses = np.concatenate(losses)
    np.testing.assert_allclose(got["loss"], losses.mean(), rtol=2e-5)
    assert got["kept_targets"] == losses.size < got["tokens"] == len(file.tokens) - 1


def test_a_mask_that_keeps_every_target_trains_as_no_mask(sft, tmp_path):
    """The kept-target normalization is exact: a mask of ones changes no loss."""
    ids = np.fromfile(sft / "sft.bin", np.uint16)
    plain, ones = tmp_path / "plain.bin", tmp_path / "ones.bin"
    ids.tofile(plain)
    ids.tofile(ones)
    np.ones(ids.size, np.uint8).tofile(loss_mask_path(ones))
    exp = tiny(train={"steps": 3, "microbatches": 2}, data={"source": "tokens"})
    a = losses(run(exp.model_copy(update={"data": exp.data.model_copy(update={
        "path": str(plain)})}), "data=2", tmp_path / "a"))
    b = losses(run(exp.model_copy(update={"data": exp.data.model_copy(update={
        "path": str(ones)})}), "data=2", tmp_path / "b"))
    np.testing.assert_allclose(a, b, rtol=1e-6)


def test_a_mask_that_does_not_match_its_tokens_is_one_line(sft, tmp_path, capsys):
    from helpers import write_experiment

    ids = np.fromfile(sft / "sft.bin", np.uint16)
    path = tmp_path / "t.bin"
    ids.tofile(path)
    np.ones(ids.size - 3, np.uint8).tofile(loss_mask_path(path))
    cfg = write_experiment(tmp_path / "e.toml", tiny(data={"source": "tokens",
                                                           "path": str(path)}))
    assert main(["train", str(cfg), "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"holds {ids.size - 3} entries but '{path}' (data.path) {ids.size} tokens" in err
