"""Every user mistake: one line naming the problem and the fix, exit 2, nothing lost."""

import hashlib
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import LINE_LOG, losses, plait_cmd, tiny, write_experiment

from plait.cli import main

CKPT = {"enabled": True, "every_steps": 4, "keep": 2, "async_save": False}


@pytest.fixture
def exp_file(tmp_path):
    return write_experiment(tmp_path / "tiny.toml", tiny())


def fails(capsys, *argv) -> str:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("plait: error: "), err
    assert "Traceback" not in err
    return lines[0]


def snapshot(run_dir: Path) -> dict:
    """Every file's hash, but the run's log (plait.log, which records the refusal)."""
    return {str(p.relative_to(run_dir)): hashlib.sha1(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file() and p.name != "plait.log"}


@pytest.mark.parametrize("args,message", [
    (["--set", "optimizer.lrr=1e-3"],
     r"unknown config key 'optimizer.lrr'.*did you mean 'optimizer.lr'"),
    (["--set", 'train.steps="ten"'], r"'train.steps'.*'ten' \(string\)"),
    (["--mesh", "date=8"], r"unknown mesh axis 'date'.*did you mean 'data'"),
    (["--mesh", "data=3", "--devices", "8"], r"needs 3 devices but 8 are in use"),
    (["--mesh", "data=16"], r"needs 16 devices but this process has 8"),
    (["--mesh", "pipeline=4", "--set", "model.layers=6"],
     r"model.layers = 6 does not split evenly over 4 pipeline stages"),
    (["--mesh", "data=4,pipeline=2", "--set", "pipeline.microbatches=8", "--set",
      "model.layers=2"],
     r"does not split into pipeline.microbatches = 8 of rows over data = 4"),
    (["--mesh", "pipeline=2", "--set", "train.microbatches=2"],
     r"with a pipeline, split the batch with pipeline.microbatches"),
    (["--mesh", "pipeline=2", "--set", 'pipeline.schedule="chimera"', "--set",
      "pipeline.microbatches=3"], r"Chimera needs .* microbatches a multiple of the stages"),
    (["--mesh", "pipeline=2", "--set", "pipeline.microbatches=1048576", "--set",
      "train.global_batch=1048576"],
     r"the 1f1b schedule of 2 stages x 1048576 microbatches is 4,194,304 actions to lay "
     r"out, more than plait takes \(2,097,152: about a minute\); use fewer microbatches"),
    (["--mesh", "tensor=8", "--set", "model.heads=4"],
     r"model.heads = 4 is not divisible by the tensor axis \(8\)"),
    (["--mesh", "fsdp=8", "--set", "model.d_model=36", "--set", "model.heads=4"],
     r"model.d_model = 36 is not divisible by the fsdp axis \(8\)"),
    (["--mesh", "tensor=8", "--set", "model.d_ff=100"],
     r"model.d_ff = 100 is not divisible by the tensor axis \(8\)"),
    (["--mesh", "tensor_row=2,tensor_col=4"],
     r"the 2-D tensor grid tensor_row=2 x tensor_col=4 is not square"),
    (["--mesh", "tensor_x=2,tensor_y=2,data=2"],
     r"tensor_x=2 x tensor_y=2 x tensor_z=1 is not a cube"),
    (["--mesh", "tensor_depth=2,data=4"], r"tensor_depth=2 stacks 2-D grids but the mesh has none"),
    (["--mesh", "tensor=2,tensor_row=2,tensor_col=2"], r"mixes tensor modes tensor \(1-D\) and"),
    (["--mesh", "tensor_row=2,tensor_col=2", "--set", "model.d_ff=99"],
     r"model.d_ff = 99 is not divisible by the tensor_col axis \(2\)"),
    (["--mesh", "tensor_x=2,tensor_y=2,tensor_z=2", "--set", "model.d_model=72",
      "--set", "model.heads=8"],
     r"the head size \(model.head_dim, or d_model / heads\) = 9 is not divisible by the "
     r"tensor_x axis"),
    (["--mesh", "tensor_x=2,tensor_y=2,tensor_z=2", "--set", "train.global_batch=6"],
     r"global_batch = 6 does not split over tensor_x x tensor_y = 4"),
    (["--set", "model.loss_chunks=5"],
     r"model.loss_chunks = 5 does not divide model.seq_len = 32; use a divisor of seq_len"),
    (["--mesh", "data=8", "--set", "train.global_batch=12"],
     r"global_batch = 12 does not split over data = 8"),
    (["--mesh", "data=2", "--set", "train.microbatches=3"],
     r"global_batch = 16 is not divisible by train.microbatches = 3"),
    (["--set", 'data.source="tokens"', "--set", 'data.path="nope.bin"'],
     r"data file 'nope.bin' not found"),
    (["--mesh", "meshes/nope.toml"], r"mesh file 'meshes/nope.toml' not found"),
])
def test_bad_input(args, message, exp_file, tmp_path, capsys):
    import re

    line = fails(capsys, "train", exp_file, "--run-dir", tmp_path / "run", *args)
    assert re.search(message, line), line
    assert not (tmp_path / "run").exists()


def test_missing_and_invalid_experiment(tmp_path, capsys):
    assert "experiment file" in fails(capsys, "train", tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("model = [")
    assert "is not valid TOML" in fails(capsys, "inspect", bad)


def test_other_model_in_run_dir_is_refused_and_kept(exp_file, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", str(exp_file), "--mesh", "data=2", "--run-dir", str(run_dir),
                 "--set", "checkpoint.enabled=true", "--set", "log.console='none'"]) == 0
    before = snapshot(run_dir)
    line = fails(capsys, "train", exp_file, "--mesh", "data=2", "--run-dir", run_dir,
                 "--set", "model.d_model=128", "--steps", "20")
    assert "holds checkpoints of a different model (model.d_model = 64 there, 128 now)" in line
    assert snapshot(run_dir) == before
    fails(capsys, "train", exp_file, "--mesh", "data=5", "--devices", "8", "--run-dir", run_dir)
    assert snapshot(run_dir) == before
    # another optimizer's state: orbax called every checkpoint unusable and the line
    # ended "move the directory away to start afresh"
    line = fails(capsys, "train", exp_file, "--mesh", "data=2", "--run-dir", run_dir,
                 "--set", 'optimizer.name="sgd"', "--steps", "20")
    assert line.endswith('checkpoints were trained with optimizer.name = "adamw" (its state '
                         'is kept with them), this run asks for "sgd"; use optimizer.name = '
                         '"adamw" or a new --run-dir'), line
    assert snapshot(run_dir) == before


@pytest.mark.parametrize("name,kind", [("checkpoints", "file"), ("metrics.jsonl", "directory"),
                                       ("summary.json", "directory")])
def test_a_run_directory_entry_of_the_wrong_kind_is_one_line(exp_file, tmp_path, capsys, name,
                                                              kind):
    """NotADirectoryError inside orbax, IsADirectoryError after the resume read the
    metrics or after the last step (summary.json)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    if kind == "file":
        (run_dir / name).write_text("x")
    else:
        (run_dir / name).mkdir()
    line = fails(capsys, "train", exp_file, "--mesh", "data=1", "--run-dir", run_dir)
    assert line.endswith(f"'{run_dir / name}' is a {kind}, where plait keeps its "
                         f"{'directory' if kind == 'file' else 'file'} {name}; move it away "
                         "or pass another --run-dir"), line


@pytest.mark.parametrize("address,needle", [
    ("localhost", "--coordinator 'localhost' is not HOST:PORT"),  # IndexError inside JAX
    ("localhost:abc", "--coordinator 'localhost:abc' is not HOST:PORT"),  # JAX: SIGSEGV
    ("localhost:70000", "--coordinator localhost:70000: port 70000 is not a TCP port"),
    ("nosuchhost.invalid:1234", "the host nosuchhost.invalid does not resolve"),  # a wait
])
def test_a_coordinator_address_that_cannot_be_is_one_line(exp_file, capsys, address, needle):
    line = fails(capsys, "train", exp_file, "--coordinator", address, "--num-processes", "1",
                 "--process-id", "0")
    assert needle in line, line


def test_a_launch_port_that_is_not_a_port_is_one_line(exp_file, capsys):
    line = fails(capsys, "launch", "--processes", "2", "--port", "70000", "--", "train",
                 exp_file)  # both processes started, and one took 70000 as some port
    assert "--port 70000 is not a TCP port; use one from 1 to 65535" in line, line


@pytest.mark.parametrize("argv,line", [
    # the top-level usage (3 lines) and no hint of --steps
    (["train", "x.toml", "--stepz", "3"], "plait train: error: unrecognized arguments: "
     "--stepz 3 (did you mean --steps?); see plait train --help"),
    (["eval", "RUN", "--maxbatches=2"], "plait eval: error: unrecognized arguments: "
     "--maxbatches=2 (did you mean --max-batches?); see plait eval --help"),
    # the subcommand's usage (5 lines) before the line
    (["train", "x.toml", "--steps", "abc"], "plait train: error: argument --steps: invalid "
     "int value: 'abc'; see plait train --help"),
    (["sweep", "x.toml"], "plait sweep: error: the following arguments are required: "
     "--devices; see plait sweep --help"),
    (["trian", "x.toml"], "plait: error: argument command: invalid choice: 'trian' (choose "
     "from 'train', 'inspect', 'sweep', 'plan', 'launch', 'schedule', 'data', 'sample', "
     "'eval', 'import', 'export') (did you mean 'train'?); see plait --help"),
])
def test_a_command_line_argparse_refuses_is_one_line(capsys, argv, line):
    from plait.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err == line + "\n"


@pytest.mark.parametrize("command,needle", [
    (["sweep"], "plait sweep runs in one process; run it without plait launch"),
    (["sample", "RUN"], "plait sample runs in one process"),
    (["plait", "train", "EXP"], "plait launch takes the command without 'plait': drop it"),
    (["trian"], "plait launch needs a command after --, one of train, inspect, plan, eval"),
])
def test_a_command_launch_does_not_start_is_one_line(capsys, command, needle):
    """Before any process starts: each of these read 'needs a command after --'."""
    line = fails(capsys, "launch", "--processes", "2", "--", *command)
    assert needle in line, line


def test_a_mistake_every_launched_process_makes_is_said_once(exp_file, capsys):
    """Not 'process 0 of 2 failed first': each process refused the same mesh."""
    line = fails(capsys, "launch", "--processes", "2", "--", "train", exp_file, "--mesh",
                 "data=3")
    assert line.startswith("plait: error: mesh data=3 needs 3 devices, which 2 processes "
                           "cannot share equally"), line


def test_metrics_that_are_not_utf8_are_trimmed_like_torn_lines(tmp_path):
    """A resume's trim of metrics.jsonl raised UnicodeDecodeError on a torn write's bytes."""
    from plait.train.metrics import trim_jsonl

    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1}\n\x00\xff garbage\n{"step": 2}\n{"step": 3}\n{"st')
    trim_jsonl(path, 2)
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'


def _checkpointed_run(tmp_path, exp_file):
    exp = tiny(checkpoint=CKPT, train={"steps": 12},
               log=LINE_LOG)
    path = write_experiment(exp_file, exp)
    run_dir = tmp_path / "run"
    assert main(["train", str(path), "--mesh", "data=2", "--run-dir", str(run_dir)]) == 0
    return path, run_dir


def _corrupt(step_dir: Path) -> None:
    for f in step_dir.rglob("*"):
        if f.is_file() and "state" in f.parts and f.stat().st_size > 0:
            f.write_bytes(b"\x00garbage" * 8)


def test_corrupt_checkpoint_falls_back_to_previous(exp_file, tmp_path, capsys, caplog):
    path, run_dir = _checkpointed_run(tmp_path, exp_file)
    capsys.readouterr()
    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir() if p.name.isdigit()) == ["12", "8"]
    _corrupt(ckpts / "12")
    ref_dir = tmp_path / "ref"
    assert main(["train", str(path), "--mesh", "data=2", "--run-dir", str(ref_dir),
                 "--steps", "16"]) == 0
    assert main(["train", str(path), "--mesh", "data=2", "--run-dir", str(run_dir),
                 "--steps", "16"]) == 0
    out = capsys.readouterr()
    assert "checkpoint at step 12" in caplog.text and "unusable" in caplog.text
    assert "resumed from the checkpoint at step 8" in out.out, (out.out, out.err)
    np.testing.assert_array_equal(losses(run_dir), losses(ref_dir))


def test_all_checkpoints_corrupt_is_an_error_and_keeps_them(exp_file, tmp_path, capsys):
    path, run_dir = _checkpointed_run(tmp_path, exp_file)
    for step in ("8", "12"):
        _corrupt(run_dir / "checkpoints" / step)
    before = snapshot(run_dir)
    line = fails(capsys, "train", path, "--mesh", "data=2", "--run-dir", run_dir, "--steps", "16")
    assert "no usable checkpoint" in line and "tried steps 12, 8; step 8: " in line
    assert line.endswith("move the directory away to start afresh")
    assert snapshot(run_dir) == before
    # a reader cannot start afresh: its line says what is left to do
    line = fails(capsys, "sample", run_dir, "--prompt", "a", "--tokens", "2")
    assert "tried steps 12, 8; step 8: " in line, line
    assert line.endswith("nothing can be read from this run; train it again into another "
                         "--run-dir"), line
    assert snapshot(run_dir) == before


def test_half_written_checkpoint_is_ignored(exp_file, tmp_path, capsys):
    path, run_dir = _checkpointed_run(tmp_path, exp_file)
    ckpts = run_dir / "checkpoints"
    # What a run killed mid-save leaves: orbax's temporary directory, never renamed.
    partial = ckpts / "16.orbax-checkpoint-tmp-1795000000"
    shutil.copytree(ckpts / "12", partial)
    (partial / "_CHECKPOINT_METADATA").unlink()
    _corrupt(partial)
    assert main(["train", str(path), "--mesh", "data=2", "--run-dir", str(run_dir),
                 "--steps", "14"]) == 0
    assert "resumed from the checkpoint at step 12" in capsys.readouterr().out


def test_real_process_exit_status_and_no_traceback(exp_file, tmp_path):
    proc = plait_cmd("train", str(exp_file), "--mesh", "tensor=3", "--devices", "3",
                     "--run-dir", str(tmp_path / "r"))
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    assert "model.heads = 8 is not divisible by the tensor axis (3)" in proc.stderr


def test_xla_flags_device_count_is_named(exp_file, tmp_path):
    proc = plait_cmd("train", str(exp_file), "--mesh", "data=8", "--run-dir", str(tmp_path / "r"),
                     env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    assert proc.returncode == 2, proc.stderr
    assert "XLA_FLAGS sets --xla_force_host_platform_device_count=2" in proc.stderr
