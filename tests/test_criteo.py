"""Criteo converted once into column files (`plait data criteo`) and read by memory map."""

from __future__ import annotations

import gzip
import json
import shutil

import numpy as np
import pytest
from helpers import losses, make_mesh, plait_cmd, run

from plait.config import Experiment
from plait.data.criteo import CriteoTSV
from plait.data.criteo_bin import CriteoBinary, convert
from plait.errors import UserError
from plait.tasks.dlrm import DLRMTask

ROWS = [7, 100, 3, 50000, 11] + [13] * 21


def _day(rng: np.random.Generator, n: int) -> list[str]:
    """n Criteo TSV lines: label, 13 integers (some empty or negative), 26 hex values."""
    lines = []
    for _ in range(n):
        label = str(int(rng.random() < 0.3))
        dense = ["" if rng.random() < 0.1 else str(int(rng.integers(-2, 5000)))
                 for _ in range(13)]
        cats = ["" if rng.random() < 0.05 else format(int(rng.integers(0, 2**32)), "08x")
                for _ in range(26)]
        lines.append("\t".join([label, *dense, *cats]))
    return lines


@pytest.fixture
def days(tmp_path):
    rng = np.random.default_rng(0)
    one, two = _day(rng, 37), _day(rng, 29)
    (tmp_path / "day_0.tsv").write_text("\n".join(one) + "\n")
    with gzip.open(tmp_path / "day_1.tsv.gz", "wt") as f:
        f.write("\n".join(two) + "\n")
    (tmp_path / "both.tsv").write_text("\n".join(one + two) + "\n")
    return tmp_path


def test_converted_days_read_back_equal_to_parsing_the_tsv(days):
    manifest = convert([str(days / "day_0.tsv"), str(days / "day_1.tsv.gz")],
                       str(days / "bin"), report=lambda _: None)
    assert [p["rows"] for p in manifest["parts"]] == [37, 29]
    binary = CriteoBinary(str(days / "bin"), ROWS, batch=8)
    tsv = CriteoTSV(str(days / "both.tsv"), ROWS, batch=8, malformed="stop")
    for step in range(10):  # 80 samples: across the two parts and around the end
        for start, stop in ((0, 8), (3, 6)):
            got, want = binary.rows(step, start, stop), tsv.rows(step, start, stop)
            for name in want:
                np.testing.assert_array_equal(got[name], want[name], err_msg=f"{step} {name}")
    assert got["ids"].dtype == np.int32 and (got["ids"] < np.asarray(ROWS)[:, None]).all()


def test_malformed_lines_are_skipped_and_counted_or_stop_in_one_line(days, tmp_path):
    bad = tmp_path / "bad.tsv"
    good = (days / "day_0.tsv").read_text().splitlines()
    bad.write_text("\n".join([good[0], "1\t2\t3", good[1], "2" + good[2][1:], good[3]]) + "\n")
    notes: list[str] = []
    manifest = convert([str(bad)], str(tmp_path / "skip"), report=notes.append)
    assert manifest["parts"][0]["rows"] == 3 and manifest["parts"][0]["skipped"] == 2
    assert "2 malformed lines skipped" in notes[-1] and "rows/s" in notes[-1]
    out = plait_cmd("data", "criteo", str(bad), "--out", str(tmp_path / "stop"),
                    "--malformed", "stop")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"plait: error: {bad}: line 2 is malformed (3 fields, expected 40); fix it or convert "
        "with --malformed skip"]
    assert not (tmp_path / "stop" / "bad").exists()


def test_rerun_converts_only_what_is_missing_and_an_interruption_leaves_no_part(days):
    out = days / "bin"
    convert([str(days / "day_0.tsv")], str(out), report=lambda _: None)
    first = (out / "day_0" / "sparse.u32").stat().st_mtime_ns
    (out / ".partial-day_1").mkdir()  # what an interrupted conversion of day_1 leaves
    (out / ".partial-day_1" / "labels.u8").write_bytes(b"\x01" * 5)
    notes: list[str] = []
    manifest = convert([str(days / "day_0.tsv"), str(days / "day_1.tsv.gz")], str(out),
                       report=notes.append)
    assert "already converted (37 rows), skipped" in notes[0]
    assert (out / "day_0" / "sparse.u32").stat().st_mtime_ns == first
    assert [p["name"] for p in manifest["parts"]] == ["day_0", "day_1"]
    assert not (out / ".partial-day_1").exists()
    assert json.loads((out / "manifest.json").read_text()) == manifest
    # A truncated column file is refused in one line naming it.
    with open(out / "day_1" / "dense.f32", "r+b") as f:
        f.truncate(100)
    with pytest.raises(UserError, match="dense.f32 is missing or truncated"):
        CriteoBinary(str(out), ROWS, batch=8)


def _criteo_exp(path, steps: int, **data) -> Experiment:
    return Experiment.model_validate({
        "name": "criteo", "seed": 1,
        "model": {"kind": "dlrm", "embedding_rows": ROWS, "embedding_dim": 4,
                  "bottom_mlp": [8, 4], "top_mlp": [8, 1], "dense_features": 13},
        "data": {"source": "criteo_bin", "path": str(path), "eval_batches": 0, **data},
        "train": {"steps": steps, "global_batch": 8},
        "optimizer": {"name": "sgd", "lr": 0.1, "grad_clip": 0.0, "decay_steps": 100},
        "checkpoint": {"enabled": True, "every_steps": 3, "keep": 3, "async_save": False},
        "log": {"every_steps": 1, "tensorboard": False, "console": "none"}})


def test_resume_in_the_middle_of_a_binary_dataset_is_bit_exact(days, tmp_path):
    convert([str(days / "day_0.tsv"), str(days / "day_1.tsv.gz")], str(days / "bin"),
            report=lambda _: None)
    full = losses(run(_criteo_exp(days / "bin", 10), "data=2", tmp_path / "full"))
    part = tmp_path / "part"
    run(_criteo_exp(days / "bin", 5), "data=2", part)  # steps 4-5 redone after step 3's save
    resumed = run(_criteo_exp(days / "bin", 10), "data=2", part)
    assert resumed["records"][0]["step"] == 6
    np.testing.assert_array_equal(losses(part), full)


def test_held_out_auc_reads_only_the_eval_day(days):
    convert([str(days / "day_0.tsv")], str(days / "train"), report=lambda _: None)
    convert([str(days / "day_1.tsv.gz")], str(days / "eval"), report=lambda _: None)
    exp = _criteo_exp(days / "train", 4, eval_path=str(days / "eval"), eval_batches=2)
    task = DLRMTask(exp, make_mesh("data=2"))
    evaluator = task.evaluator(task.source())
    eval_day = CriteoBinary(str(days / "eval"), ROWS, batch=8)
    want = np.concatenate([eval_day.rows(k, 0, 8)["labels"] for k in range(2)])
    np.testing.assert_array_equal(evaluator.labels, want)
    train_day = CriteoBinary(str(days / "train"), ROWS, batch=8)
    assert not np.array_equal(want, np.concatenate(
        [train_day.rows(k, 0, 8)["labels"] for k in range(2)]))
    assert 0.0 <= evaluator(task.init_state())["auc"] <= 1.0


def test_missing_or_foreign_directories_are_one_line(days, tmp_path):
    with pytest.raises(UserError, match="not a converted Criteo directory"):
        CriteoBinary(str(tmp_path / "nothing"), ROWS, batch=8)
    shutil.copy(days / "day_0.tsv", tmp_path / "x.tsv")
    out = plait_cmd("data", "criteo", str(tmp_path / "x.tsv"))
    assert out.returncode == 2 and "needs --out DIR" in out.stderr
    out = plait_cmd("train", "experiments/dlrm-tiny.toml", "--set", 'data.source="criteo_bin"',
                    "--run-dir", str(tmp_path / "r"))
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        'plait: error: data.source = "criteo_bin" needs data.path; set it to a directory '
        "made by plait data criteo"]


def test_quoted_globs_convert_in_day_order_and_mistakes_are_one_line(days, tmp_path, capsys):
    """A quoted glob is expanded day_2 before day_10 (the parts' order); a directory, a
    glob that matches nothing and the token files' flags are one line each (the flags
    had been ignored), and --malformed is refused off criteo."""
    from plait.cli import main

    for n in (10, 2):
        shutil.copy(days / "day_0.tsv", tmp_path / f"day_{n}.tsv")
    assert main(["data", "criteo", str(tmp_path / "day_*.tsv"), "--out",
                 str(tmp_path / "bin")]) == 0
    manifest = json.loads((tmp_path / "bin" / "manifest.json").read_text())
    assert [p["name"] for p in manifest["parts"]] == ["day_0", "day_2", "day_10"]
    assert capsys.readouterr().err == ""  # no bar off a terminal, and no blank line
    (tmp_path / "t.txt").write_text("text")
    for args, said in [
            ([str(tmp_path)], f"'{tmp_path}' is a directory; pass its Criteo TSV day files"),
            ([str(tmp_path / "nope_*")], "matches no file"),
            ([str(tmp_path / "day_2.tsv"), "--tokenizer", "t.json"],
             "--tokenizer is for token files"),
            ([str(tmp_path / "day_2.tsv"), "--dtype", "uint32"], "--dtype is for token files")]:
        assert main(["data", "criteo", *args, "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err.strip()
        assert said in err and len(err.splitlines()) == 1, err
    assert main(["data", str(tmp_path / "t.txt"), str(tmp_path / "t.bin"), "--malformed",
                 "stop"]) == 2
    assert "--malformed is for Criteo TSV lines" in capsys.readouterr().err
    assert not (tmp_path / "o").exists() and not (tmp_path / "t.bin").exists()
