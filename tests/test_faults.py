"""Faults end cleanly and lose nothing: a diverging run stops before saving a non-finite
state, keeps its last good checkpoint, and resumes from it; outputs stay strict JSON."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
from helpers import losses, run, tiny, write_experiment

from plait.cli import main


def _strict(path):
    """Every line parses as strict JSON (NaN / Infinity refused)."""
    def refuse(token):
        raise ValueError(f"non-strict JSON constant {token} in {path}")
    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def test_divergence_stops_in_one_line_and_keeps_the_last_good_checkpoint(tmp_path, capsys):
    ckpt = {"enabled": True, "every_steps": 1, "keep": 2, "async_save": True}
    exp = write_experiment(tmp_path / "t.toml", tiny(
        optimizer={"lr": 1e6, "warmup_steps": 0}, checkpoint=ckpt, log={"console": "line"}))
    run_dir = tmp_path / "r"
    assert main(["train", str(exp), "--mesh", "data=2", "--run-dir", str(run_dir)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "became non-finite (NaN or Inf) at step 3; stopped without saving that state" \
        in err[0] and "the checkpoint at step 2 is intact" in err[0]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["1", "2"]
    records = _strict(run_dir / "metrics.jsonl")
    assert records[-1]["step"] == 3 and records[-1]["nonfinite"] == ["grad_norm"]
    assert records[-1]["grad_norm"] is None
    # Rerunning resumes from step 2 and stops again at the same step, losing nothing
    # (the step-2 state is finite but already diverged: 1e6 is beyond rescue).
    assert main(["train", str(exp), "--mesh", "data=2", "--run-dir", str(run_dir)]) == 1
    captured = capsys.readouterr()
    assert "resumed from the checkpoint at step 2" in captured.out
    assert "at step 3" in captured.err
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["1", "2"]
    assert [r["step"] for r in _strict(run_dir / "metrics.jsonl")] == [1, 2, 3]


def test_a_fault_after_the_last_checkpoint_resumes_bit_identical(tmp_path, capsys,
                                                                 monkeypatch):
    """A step that turns the loss to NaN at step 6 (checkpoints every 4): the run stops,
    step 4 stays the newest checkpoint, and the rerun equals the uninterrupted run."""
    from plait.tasks.gpt import GPTTask

    ckpt = {"enabled": True, "every_steps": 4, "keep": 3, "async_save": True}
    full = losses(run(tiny(checkpoint=ckpt), "data=2", tmp_path / "full"))
    real_compile = GPTTask.compile

    def poisoned_compile(self, *a, **kw):
        step = real_compile(self, *a, **kw)
        calls = []

        def poisoned(state, batch):
            calls.append(1)
            state, metrics = step(state, batch)
            if len(calls) == 6:
                metrics = {**metrics, "loss": metrics["loss"] * jnp.nan}
            return state, metrics
        return poisoned

    monkeypatch.setattr(GPTTask, "compile", poisoned_compile)
    exp = write_experiment(tmp_path / "t.toml", tiny(checkpoint=ckpt))
    run_dir = tmp_path / "r"
    assert main(["train", str(exp), "--mesh", "data=2", "--run-dir", str(run_dir)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "at step 6" in err[0] and "checkpoint at step 4 is intact" in err[0]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["4"]
    monkeypatch.setattr(GPTTask, "compile", real_compile)
    assert main(["train", str(exp), "--mesh", "data=2", "--run-dir", str(run_dir)]) == 0
    np.testing.assert_array_equal(losses(run_dir), full)


def test_a_second_train_on_a_run_directory_in_use_is_refused(tmp_path):
    """One writer per run directory: a second `plait train` refuses in one line; the lock
    dies with its holder, so a run killed with -9 leaves no stale lock."""
    import signal
    import subprocess
    import sys

    from helpers import LINE_LOG, ROOT, subprocess_env
    from test_resume import _wait_for_step

    exp = write_experiment(tmp_path / "t.toml", tiny(
        train={"steps": 400}, log=LINE_LOG,
        checkpoint={"enabled": True, "every_steps": 2, "keep": 2, "async_save": True}))
    run_dir = tmp_path / "r"

    def train(*sets):
        args = [sys.executable, "-m", "plait", "train", str(exp), "--mesh", "data=2",
                "--run-dir", str(run_dir)] + [x for s in sets for x in ("--set", s)]
        return args

    first = subprocess.Popen(train(), env=subprocess_env(), cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_step(run_dir, 3, first)
        second = subprocess.run(train(), env=subprocess_env(), cwd=ROOT, capture_output=True,
                                text=True, timeout=120)
        assert second.returncode == 2, second.stderr[-2000:]
        err = second.stderr.strip().splitlines()
        assert len(err) == 1 and f"run directory '{run_dir}' is in use by another plait " \
            f"train (pid {first.pid} on " in err[0] and "pick another --run-dir" in err[0]
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    again = subprocess.run(train("train.steps=8"), env=subprocess_env(), cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
