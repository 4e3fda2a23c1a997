"""A file or directory a command writes after its work (a plot, a JSON file, a token
file, an exported model, a sweep's outputs) is checked before that work: a path under a
file, or a directory where a file goes, ends in one line, status 2, nothing written --
not in a traceback after minutes of scoring, tokenizing or compiling."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import ROOT

QUICK = str(ROOT / "experiments" / "quickstart.toml")
HF = str(ROOT / "tests" / "data" / "hf" / "llama3")


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _fake_run(root: Path, experiment: str) -> Path:
    """A run directory as a reader sees it before reading a checkpoint."""
    run = root / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copy(ROOT / "experiments" / experiment, run / "config.toml")
    return run


@pytest.mark.parametrize("argv,needle", [
    (["schedule", "1f1b", "--stages", "2", "--microbatches", "4", "--png", "{file}/x.png"],
     "cannot make the directory of --png '{file}/x.png': a part of its path is a file; "
     "pass another --png"),
    (["schedule", "1f1b", "--stages", "2", "--microbatches", "4", "--png", "{dir}"],
     "--png '{dir}' is a directory; pass a file's name (e.g. '{dir}/out.png')"),
    # the data file does not exist: the output is checked before anything is read
    (["eval", "{run}", "--data", "{tmp}/none.bin", "--json", "{file}/got.json"],
     "cannot make the directory of --json '{file}/got.json'"),
    (["eval", "{run}", "--data", "{tmp}/none.bin", "--step", "all", "--png", "{dir}"],
     "--png '{dir}' is a directory"),
    (["data", "{text}", "{dir}"], "OUT.bin '{dir}' is a directory"),
    (["data", "{text}", "{file}/t.bin"], "cannot make the directory of OUT.bin"),
    # before the run directory is read (it does not exist)
    (["export", "{tmp}/no-run", "--out", "{file}/hf"],
     "cannot make the directory of --out '{file}/hf'"),
    (["import", HF, "--run-dir", "{file}/run"],
     "cannot make the directory of --run-dir '{file}/run'"),
    (["sweep", QUICK, "--devices", "2", "--out", "{file}"],
     "--out '{file}' is a file, not a directory"),
    (["sweep", QUICK, "--devices", "2", "--out", "{file}/sweep"],
     "cannot make --out '{file}/sweep': a part of its path is a file"),
])
def test_a_bad_output_path_is_refused_before_the_work(argv, needle, tmp_path, capsys):
    from plait.cli import main

    (tmp_path / "a-file").write_text("x")
    (tmp_path / "a-dir").mkdir()
    (tmp_path / "text.txt").write_text("hello plait " * 100)
    names = {"file": tmp_path / "a-file", "dir": tmp_path / "a-dir", "tmp": tmp_path,
             "text": tmp_path / "text.txt"}
    if any("{run}" in a for a in argv):
        names["run"] = _fake_run(tmp_path, "quickstart.toml")
    before = _files(tmp_path)
    assert main([a.format(**names) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle.format(**names) in err[0], err
    assert _files(tmp_path) == before


def test_a_plot_in_a_new_directory_is_written(tmp_path, capsys):
    from plait.cli import main

    png = tmp_path / "new" / "dir" / "1f1b.png"
    assert main(["schedule", "1f1b", "--stages", "2", "--microbatches", "4",
                 "--png", str(png)]) == 0
    assert png.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("argv,needle", [
    (["export", "{run}", "--out", "{tmp}/hf"],
     "plait export converts language-model runs (gpt, llama); '{run}' trained a dlrm model"),
    (["inspect", str(ROOT / "experiments" / "dlrm-tiny.toml"), "--compare-tensor-modes"],
     "--compare-tensor-modes compares how a decoder's layers split over the tensor modes; "
     "dlrm-tiny is a dlrm model"),
])
def test_a_dlrm_where_a_decoder_is_needed_names_the_command(argv, needle, tmp_path, capsys):
    """export said "plait sample generates text from ..."; the comparison compiled a DLRM
    four times to print a table of four refusals."""
    from plait.cli import main

    names = {"run": _fake_run(tmp_path, "dlrm-tiny.toml"), "tmp": tmp_path}
    assert main([a.format(**names) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle.format(**names) in err[0], err
    assert not (tmp_path / "hf").exists()
