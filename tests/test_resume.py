"""Checkpoint and resume: bit-identical on the same mesh, the same curve on another."""

import json
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import LINE_LOG, ROOT, losses, run, subprocess_env, tiny, write_experiment

CKPT = {"enabled": True, "every_steps": 4, "keep": 2, "async_save": True}


def test_resume_is_bit_identical(tmp_path):
    full = losses(run(tiny(checkpoint=CKPT), "data=2,fsdp=2,tensor=2", tmp_path / "full"))
    part = tmp_path / "part"
    run(tiny(checkpoint=CKPT, train={"steps": 6}), "data=2,fsdp=2,tensor=2", part)
    # steps 5-6 ran after the step-4 checkpoint: the resume redoes them.
    resumed = run(tiny(checkpoint=CKPT), "data=2,fsdp=2,tensor=2", part)
    assert resumed["records"][0]["step"] == 7
    got = losses(part)
    assert [json.loads(x)["step"] for x in (part / "metrics.jsonl").read_text().splitlines()] == \
        list(range(1, 13))
    np.testing.assert_array_equal(got, full)


@pytest.mark.parametrize("saved_on,resumed_on", [
    ("data=8", "data=2,fsdp=2,tensor=2"),
    ("data=2,fsdp=2,tensor=2", "fsdp=2"),
])
def test_resume_onto_another_mesh_continues_the_curve(saved_on, resumed_on, tmp_path):
    full = losses(run(tiny(checkpoint=CKPT), saved_on, tmp_path / "full"))
    part = tmp_path / "part"
    run(tiny(checkpoint=CKPT, train={"steps": 4}), saved_on, part)
    run(tiny(checkpoint=CKPT), resumed_on, part)
    np.testing.assert_allclose(losses(part), full, rtol=1e-4)


def _train_cmd(exp_path, run_dir, mesh="data=2,fsdp=2,tensor=2"):
    return [sys.executable, "-m", "plait", "train", str(exp_path), "--mesh", mesh,
            "--run-dir", str(run_dir)]


def _wait_for_step(run_dir, step, proc, timeout=120):
    path = run_dir / "metrics.jsonl"
    t0 = time.time()
    while time.time() - t0 < timeout:
        if path.exists():
            lines = [x for x in path.read_text().splitlines() if x.strip()]
            if lines and json.loads(lines[-1])["step"] >= step:
                return
        if proc.poll() is not None:
            raise AssertionError(f"training exited early: {proc.stderr.read()}")
        time.sleep(0.05)
    raise AssertionError("timed out waiting for training")


@pytest.mark.slow
def test_kill_9_then_resume_is_bit_identical(tmp_path):
    """SIGKILL at several moments (mid-step, mid-save); every resume lands on the same curve.
    The uninterrupted reference runs in this process (same program, same compile cache)."""
    exp = tiny(checkpoint={"enabled": True, "every_steps": 2, "keep": 2, "async_save": True},
               train={"steps": 12}, log=LINE_LOG)
    path = write_experiment(tmp_path / "exp.toml", exp)
    ref = run(exp, "data=2,fsdp=2,tensor=2", tmp_path / "ref")
    run_dir = tmp_path / "killed"
    rng = np.random.default_rng(0)
    for kill_after in (3, 6, 9):
        proc = subprocess.Popen(_train_cmd(path, run_dir), env=subprocess_env(), cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        _wait_for_step(run_dir, kill_after, proc)
        time.sleep(float(rng.uniform(0, 0.05)))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    done = subprocess.run(_train_cmd(path, run_dir), env=subprocess_env(), cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "resumed from the checkpoint at step" in done.stdout
    np.testing.assert_array_equal(losses(run_dir), losses(ref))


@pytest.mark.slow
def test_sigterm_checkpoints_and_exits_zero(tmp_path):
    exp = tiny(checkpoint={"enabled": True, "every_steps": 1000, "keep": 2}, train={"steps": 400},
               log=LINE_LOG)
    path = write_experiment(tmp_path / "exp.toml", exp)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(_train_cmd(path, run_dir), env=subprocess_env(), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_step(run_dir, 5, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "stopped by signal" in out
    saved = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    last_logged = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    assert saved and 5 <= saved[-1] < 400 and saved[-1] >= last_logged


def test_from_step_resumes_bit_identically_from_a_kept_checkpoint(tmp_path, capsys):
    from plait.cli import main

    ckpt = {"enabled": True, "every_steps": 4, "keep": 3, "async_save": True}
    exp = write_experiment(tmp_path / "t.toml", tiny(checkpoint=ckpt, log={"console": "line"}))
    run_dir = tmp_path / "r"
    args = ["train", str(exp), "--mesh", "data=2", "--run-dir", str(run_dir)]
    assert main(args) == 0
    full = losses(run_dir)
    capsys.readouterr()
    assert main(args + ["--from-step", "5"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"plait: error: --from-step 5: no checkpoint of step 5 in '{run_dir / 'checkpoints'}'"
        "; the kept ones are: 4, 8, 12")
    assert main(args + ["--from-step", "4"]) == 0
    assert "resumed from the checkpoint at step 4" in capsys.readouterr().out
    assert [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text()
            .splitlines()] == list(range(1, 13))
    np.testing.assert_array_equal(losses(run_dir), full)
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == ["12", "12.superseded", "4", "8", "8.superseded"]


def test_extending_a_finished_run_keeps_its_learning_rate_schedule(tmp_path, capsys):
    """--steps past the end: the cosine keeps the run's decay_steps (lr continues from
    where it was, no jump back up) unless optimizer.decay_steps is set."""
    from plait.cli import main

    raw = tiny(checkpoint=CKPT, train={"steps": 8}, log={"console": "line"})
    raw = raw.model_copy(update={"optimizer": raw.optimizer.model_copy(
        update={"decay_steps": None, "min_lr_ratio": 0.1})})
    exp = write_experiment(tmp_path / "t.toml", raw)
    run_dir = tmp_path / "r"
    args = ["train", str(exp), "--mesh", "data=2", "--run-dir", str(run_dir)]
    assert main(args) == 0
    assert main(args + ["--steps", "12"]) == 0
    assert "keeps decay_steps = 8, the run's" in capsys.readouterr().out
    lrs = [json.loads(x)["lr"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(lrs) == 12 and all(b <= a + 1e-12 for a, b in zip(lrs[2:], lrs[3:], strict=False))
    assert lrs[-1] == pytest.approx(lrs[8]) == pytest.approx(raw.optimizer.lr * 0.1)


def test_a_resume_with_another_seed_says_so(tmp_path, capsys):
    """The batches after a resume follow this run's seed; one that differs from the
    checkpoint's had been taken silently."""
    from plait.cli import main

    exp = write_experiment(tmp_path / "t.toml", tiny(checkpoint=CKPT, train={"steps": 2},
                                                     log={"console": "line"}))
    args = ["train", str(exp), "--mesh", "data=2", "--run-dir", str(tmp_path / "r")]
    assert main(args) == 0
    capsys.readouterr()
    assert main(args + ["--steps", "3", "--set", "seed=9"]) == 0
    assert ("the checkpoint's batches were drawn with seed = 0; from step 3 on this run "
            "draws them with seed = 9") in capsys.readouterr().out
