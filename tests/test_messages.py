"""Messages a new user meets first: each one line that names the problem, where it came
from (the file or --set) and the fix."""

from __future__ import annotations

import pytest
from helpers import ROOT

QUICK = str(ROOT / "experiments" / "quickstart.toml")


def _one_line(capsys, argv) -> str:
    from plait.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("sets,needle", [
    (["optimizer.learning_rate=1e-3"],
     "unknown config key 'optimizer.learning_rate' in --set optimizer.learning_rate; did you "
     "mean 'optimizer.lr'?"),
    (["train.batch_size=8"], "did you mean 'train.global_batch'?"),
    (["model.n_layer=4"], "did you mean 'model.layers'?"),
    (["train.steps=ten"],
     "config key 'train.steps' in --set train.steps: input should be a valid integer"),
    (['data.source="tokens"'], 'data.source = "tokens" needs data.path, a token file'),
    # a check of the [model] table that the file passed: named as the --set's, without
    # the whole table printed after it
    (["model.heads=3"], "config key 'model' in --set model.heads: model.d_model = 64 is not "
                        "divisible by model.heads = 3; pick d_model a multiple of heads, or "
                        "set model.head_dim"),
    # each of these trained into NaN, aborted XLA or raised a traceback, most steps later
    (["optimizer.lr=inf"], "config key 'optimizer.lr' in --set optimizer.lr: input should be "
                           "a finite number, got inf (float)"),
    (["sync.alpha=inf"], "input should be a finite number"),  # XLA aborted (status -6)
    (["model.norm_eps=inf"], "input should be a finite number"),  # pydantic's traceback
    (["optimizer.b2=1.0"], "config key 'optimizer.b2' in --set optimizer.b2: input should be "
                           "less than 1, got 1.0"),
    (["optimizer.min_lr_ratio=2.0"], "input should be less than or equal to 1"),
    (["seed=-1"], "config key 'seed' in --set seed: input should be greater than or equal to 0"),
    (["optimizer.warmup_steps=100000000000"], "input should be less than or equal to "
                                              "2147483647"),  # OverflowError in the schedule
    # a union's member in the key, and the experiment file blamed for the --set
    (['model.scan_layers="yes"'], "config key 'model.scan_layers' in --set "
                                  "model.scan_layers: input should be a valid boolean or "
                                  "'auto', got 'yes' (string)"),
    (["data.successors=1000"], "data.successors = 1,000 is more than the model.vocab = 256 "
                               "tokens a synthetic stream can go on to"),  # MemoryError
    # XLA: "UNIMPLEMENTED: Scatter operations with more than 2147483647 scatter indices"
    (["train.global_batch=100000000000"], "train.global_batch = 100,000,000,000 in "
                                          "train.microbatches = 1: one microbatch's "
                                          "residual stream takes at least"),
])
def test_set_mistakes_name_set_and_the_right_key(sets, needle, capsys, tmp_path):
    args = ["train", QUICK, "--mesh", "data=1", "--run-dir", str(tmp_path / "r")]
    for s in sets:
        args += ["--set", s]
    line = _one_line(capsys, args)
    assert needle in line, line
    assert "quickstart.toml" not in line or "tokens" in needle or "data." in needle
    assert "(table)" not in line, line
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("experiment,sets,needle", [
    ("dlrm-tiny", ["model.embedding_rows=[]"], "config key 'model.embedding_rows' in --set "
                                               "model.embedding_rows: list should have at "
                                               "least 1 item"),  # IndexError
    ("dlrm-tiny", ["model.embedding_rows=[0, 10]"], "config key 'model.embedding_rows.0' in "
                                                    "--set model.embedding_rows: input should "
                                                    "be greater than 0"),  # the file blamed
    ("dlrm-tiny", ["data.ids_per_lookup=100000000"],  # OverflowError in the step's trace
     "data.ids_per_lookup = 100,000,000 ids: the batch takes at least"),
    ("llama-tiny", ["model.rope_scaling.low_freq_factor=8.0"],  # XLA aborted (status -6)
     "model.rope_scaling.high_freq_factor = 4.0 must be above low_freq_factor = 8.0"),
    ("llama-tiny", ['model.attention="cudnn"'],  # "cuDNN is not detected" in the trace
     "model.attention = \"cudnn\" runs cuDNN's fused attention on NVIDIA GPUs, not cpu"),
])
def test_model_kinds_mistakes_are_one_line(experiment, sets, needle, capsys, tmp_path):
    args = ["train", str(ROOT / "experiments" / f"{experiment}.toml"), "--mesh", "data=1",
            "--run-dir", str(tmp_path / "r")]
    for s in sets:
        args += ["--set", s]
    assert needle in _one_line(capsys, args)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("steps,needle", [
    ("0", "input should be greater than 0, got 0"),
    ("3000000000", "input should be less than or equal to 2147483647"),  # int32 step count
])
def test_a_wrong_steps_flag_is_named_as_given(steps, needle, capsys, tmp_path):
    line = _one_line(capsys, ["train", QUICK, "--steps", steps, "--mesh", "data=1",
                              "--run-dir", str(tmp_path / "r")])
    assert line.startswith("plait: error: config key 'train.steps' in --steps: ") and \
        needle in line, line


def test_sets_that_pass_a_tables_check_together_are_taken():
    from plait.config_files import load_experiment

    exp = load_experiment(QUICK, ["model.heads=3", "model.d_model=96"])
    assert (exp.model.heads, exp.model.d_model) == (3, 96)


def test_indivisible_sizes_suggest_the_right_direction(capsys):
    line = _one_line(capsys, ["inspect", QUICK, "--mesh", "tensor=8"])
    assert "model.heads = 4 is not divisible by the tensor axis (8); make it a multiple of 8" \
        in line, line


@pytest.mark.parametrize("content,needle", [
    (b"", "is empty; start from experiments/quickstart.toml"),
    (b"\x89PNG\r\n\x1a\n\x00\xff\xfe", "is not a text file"),
    (b'name = "../../escape"\n[train]\nsteps = 2\n', "must be a plain directory name"),
    (b'name = "/tmp/abs"\n', "must be a plain directory name"),
    # every key of [model] was "unknown (a 3 model)", each suggesting itself
    (b'[model]\nkind = 3\nlayers = 2\n', "config key 'model.kind' in {path}: input should be "
                                         "the name of a model kind (gpt, llama, dlrm), got 3"),
    (b'[mesh]\ndata = 8\n[mesh.dcn]\ndata = 2\n', "an experiment's [mesh] holds axis sizes "
                                                "only; give the parts across hosts with --mesh"),
])
def test_bad_experiment_files_are_one_line(content, needle, capsys, tmp_path):
    path = tmp_path / "exp.toml"
    path.write_bytes(content)
    line = _one_line(capsys, ["train", str(path), "--mesh", "data=1"])
    assert needle.format(path=path) in line, line
    assert not (tmp_path / "runs").exists()


def test_an_experiment_with_a_byte_order_mark_reads(tmp_path):
    """Windows editors start UTF-8 files with one; tomllib said "Invalid statement (at
    line 1, column 1)"."""
    from plait.config_files import load_experiment

    path = tmp_path / "exp.toml"
    path.write_bytes(b"\xef\xbb\xbf" + (ROOT / "experiments" / "quickstart.toml").read_bytes())
    assert load_experiment(path).model.d_model == 64


def test_a_directory_as_the_experiment_says_so(capsys, tmp_path):
    line = _one_line(capsys, ["train", str(tmp_path), "--mesh", "data=1"])
    assert "is a directory; pass a .toml file in it" in line, line


def test_version(capsys):
    from plait.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("plait 0.")
