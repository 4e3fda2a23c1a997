"""Faults end cleanly and lose nothing: a diverging run stops before saving a non-finite
state, keeps its last good checkpoint, and resumes from it; outputs stay strict JSON."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
from helpers import losses, run, tiny, wrap_gpt_step, write_experiment

from plait.cli import main


def _strict(path):
    """Every line parses as strict JSON (NaN / Infinity refused)."""
    def refuse(token):
        raise ValueError(f"non-strict JSON constant {token} in {path}")
    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def test_divergence_stops_in_one_line_and_keeps_the_last_good_checkpoint(tmp_path, capsys):
    ckpt = {"enabled": True, "every_steps": 1, "keep": 2, "async_save": True}
    exp = write_experiment(tmp_path / "t.toml", tiny(
        optimizer={"lr": 1e5, "warmup_steps": 0}, checkpoint=ckpt, log={"console": "line"}))
    run_dir = tmp_path / "r"
    assert main(["train", str(exp), "--mesh", "data=2", "--run-dir", str(run_dir)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "became non-finite (NaN or Inf) at step 3; stopped without saving that state" \
        in err[0] and "the checkpoint at step 2 is intact" in err[0]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["1", "2"]
    records = _strict(run_dir / "metrics.jsonl")
    assert records[-1]["step"] == 3 and "grad_norm" in records[-1]["nonfinite"]
    assert all(records[-1][k] is None for k in records[-1]["nonfinite"])  # named, not NaN
    # Rerunning resumes from step 2 and stops again at the same step, losing nothing
    # (the step-2 state is finite but already diverged: 1e5 is beyond rescue).
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
    ckpt = {"enabled": True, "every_steps": 4, "keep": 3, "async_save": True}
    full = losses(run(tiny(checkpoint=ckpt), "data=2", tmp_path / "full"))

    def poisoned(n, step, state, batch):
        state, metrics = step(state, batch)
        if n == 6:
            metrics = {**metrics, "loss": metrics["loss"] * jnp.nan}
        return state, metrics

    wrap_gpt_step(monkeypatch, poisoned)
    exp = write_experiment(tmp_path / "t.toml", tiny(checkpoint=ckpt))
    run_dir = tmp_path / "r"
    assert main(["train", str(exp), "--mesh", "data=2", "--run-dir", str(run_dir)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "at step 6" in err[0] and "checkpoint at step 4 is intact" in err[0]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["4"]
    monkeypatch.undo()
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


def _train_argv(exp, run_dir, *extra, max_file_bytes: int | None = None):
    """`plait train` in a fresh process; with `max_file_bytes` its files may not grow past
    that (RLIMIT_FSIZE), so its writes fail with EFBIG as they would with ENOSPC on a
    full disk (Python ignores SIGXFSZ). The limit is set in the child before plait
    starts, not by a preexec_fn (a fork of this multithreaded JAX process)."""
    import sys

    args = ["train", str(exp), "--mesh", "data=2", "--run-dir", str(run_dir), *extra]
    if max_file_bytes is None:
        return [sys.executable, "-m", "plait", *args]
    return [sys.executable, "-c",
            "import resource, runpy, sys; "
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({max_file_bytes}, {max_file_bytes})); "
            f"sys.argv = ['plait', *{args!r}]; runpy.run_module('plait', run_name='__main__')"]


def test_a_write_failure_during_a_save_is_one_line_and_keeps_the_checkpoints(tmp_path):
    """The save at step 12 cannot be written: one line naming the directory and the cause,
    exit 1, the unfinished checkpoint removed, 4 and 8 intact; the rerun equals an
    uninterrupted run."""
    import subprocess

    from helpers import ROOT, subprocess_env

    ckpt = {"enabled": True, "every_steps": 4, "keep": 3, "async_save": True}
    full = losses(run(tiny(checkpoint=ckpt), "data=2", tmp_path / "full"))
    run_dir = tmp_path / "r"
    run(tiny(checkpoint=ckpt, train={"steps": 8}), "data=2", run_dir)
    exp = write_experiment(tmp_path / "t.toml", tiny(checkpoint=ckpt))
    failed = subprocess.run(_train_argv(exp, run_dir, max_file_bytes=16_384),
                            env=subprocess_env(), cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert "Traceback" not in failed.stderr and "Traceback" not in failed.stdout
    err = failed.stderr.strip().splitlines()
    assert err[-1].startswith(
        f"plait: error: could not write to the run directory {run_dir} (writing the "
        "checkpoint at step 12): a file grew past the size limit (ulimit -f);"), err
    assert "the checkpoint at step 8 is intact" in err[-1] and "rerun the same command" \
        in err[-1]
    assert all(line.startswith("plait: ") for line in err), err
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["4", "8"]
    assert "absl ERROR" in (run_dir / "plait.log").read_text()  # orbax's trace, kept aside
    assert main(["train", str(exp), "--mesh", "data=2", "--run-dir", str(run_dir)]) == 0
    np.testing.assert_array_equal(losses(run_dir), full)


def test_a_run_directory_that_cannot_be_written_is_refused_before_any_work(tmp_path, capsys):
    import subprocess

    from helpers import ROOT, subprocess_env

    exp = write_experiment(tmp_path / "t.toml", tiny())
    run_dir = tmp_path / "r"
    refused = subprocess.run(_train_argv(exp, run_dir, max_file_bytes=1024),
                             env=subprocess_env(), cwd=ROOT, capture_output=True, text=True,
                             timeout=300)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert refused.stderr.strip().splitlines() == [
        f"plait: error: the run directory '{run_dir}' is not writable: a file grew past the "
        "size limit (ulimit -f); fix it or pass another --run-dir"]
    assert list(run_dir.iterdir()) == []
    afile = tmp_path / "afile"
    afile.write_text("kept")
    assert main(["train", str(exp), "--mesh", "data=2", "--run-dir", str(afile)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"plait: error: --run-dir '{afile}' is a file, not a directory; pass a directory (it "
        "is made if missing)"]
    assert afile.read_text() == "kept"
    assert main(["train", str(exp), "--mesh", "data=2", "--run-dir", str(afile / "x")]) == 2
    assert "a part of its path is a file" in capsys.readouterr().err


def test_no_room_for_one_checkpoint_is_refused(tmp_path, capsys, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 1000, 1000))
    exp = write_experiment(tmp_path / "t.toml", tiny(checkpoint={"enabled": True}))
    assert main(["train", str(exp), "--mesh", "data=2", "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has 0.0 MiB free but one checkpoint takes about 0.6 MiB" \
        in err[0] and "checkpoint.enabled = false" in err[0], err


def _signals(tmp_path, count: int):
    """SIGINT `count` times, 50 ms apart, once the run is at step 3."""
    import signal
    import subprocess
    import time

    from helpers import LINE_LOG, ROOT, subprocess_env
    from test_resume import _wait_for_step

    exp = write_experiment(tmp_path / "t.toml", tiny(
        train={"steps": 200}, log=LINE_LOG,
        checkpoint={"enabled": True, "every_steps": 1000, "keep": 2, "async_save": True}))
    run_dir = tmp_path / "r"
    proc = subprocess.Popen(_train_argv(exp, run_dir), env=subprocess_env(), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_step(run_dir, 3, proc)
    for _ in range(count):
        proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
    out, err = proc.communicate(timeout=120)
    return exp, run_dir, proc.returncode, out, err


def test_a_second_ctrl_c_waits_for_the_save_and_the_run_resumes(tmp_path):
    exp, run_dir, rc, out, err = _signals(tmp_path, 2)
    assert rc == 0, err[-3000:]
    lines = err.strip().splitlines()
    assert lines[0] == "plait: SIGINT: saving a checkpoint after this step, then stopping"
    assert "Traceback" not in err and all(x.startswith("plait: ") for x in lines), err
    assert "stopped by signal" in out
    names = [p.name for p in (run_dir / "checkpoints").iterdir()]
    assert len(names) == 1 and names[0].isdigit(), names
    full = losses(run(tiny(train={"steps": 200}), "data=2", tmp_path / "full"))
    assert main(["train", str(exp), "--mesh", "data=2", "--run-dir", str(run_dir)]) == 0
    np.testing.assert_array_equal(losses(run_dir), full)


def test_a_third_ctrl_c_stops_at_once_and_leaves_no_partial_checkpoint(tmp_path):
    exp, run_dir, rc, out, err = _signals(tmp_path, 3)
    lines = err.strip().splitlines()
    assert "Traceback" not in err and all(x.startswith("plait: ") for x in lines), err
    if rc == 130:  # stopped before the save finished (or as the process wound down after
        # it): nothing half-written is left
        assert lines[-1].startswith(("plait: SIGINT: stopped without saving",
                                     "plait: SIGINT: stopped while exiting")), lines
        assert not any(".orbax-checkpoint-tmp" in p.name
                       for p in (run_dir / "checkpoints").iterdir())
    else:  # the save was faster than the signals
        assert rc == 0, err[-3000:]
    # (that a rerun resumes bit-identically is checked after two signals, above)


def test_a_model_too_big_for_the_devices_is_refused_before_it_is_built(tmp_path, capsys):
    import time

    from helpers import make_mesh

    from plait.tasks import make_task, task_class

    exp = write_experiment(tmp_path / "t.toml", tiny())
    t0 = time.perf_counter()
    assert main(["train", str(exp), "--mesh", "data=2", "--run-dir", str(tmp_path / "r"),
                 "--set", "model.layers=1000000000"]) == 2
    assert time.perf_counter() - t0 < 30
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the model has 33,472,000,018,560 parameters" in err[0], err
    assert "more than the" in err[0] and "shrink the model" in err[0], err
    assert not (tmp_path / "r").exists()
    # The count it judges by is the model's own, exactly, for the GPT.
    for model in ({}, {"tie_embeddings": False, "vocab": 300}):
        e = tiny(model=model)
        assert task_class("gpt").param_count(e.model) == \
            make_task(e, make_mesh("data=1")).num_params()


def test_a_state_whose_shards_do_not_fit_each_device_is_refused_before_it_is_made(
        tmp_path, capsys, monkeypatch):
    """The whole state fits the devices together, but data=2 keeps a copy on each:
    refused before the state is made (gpt2-1.3b on data=2 of a 24 GiB host was made
    asynchronously while its step compiled, and the process was killed for memory); the
    same state sharded by fsdp=2 passes."""
    from helpers import make_mesh

    from plait.tasks import make_task
    from plait.train import memory

    exp = tiny(train={"steps": 1})
    whole = memory.state_bytes(make_task(exp, make_mesh("data=2")))
    assert memory.state_bytes(make_task(exp, make_mesh("fsdp=2"))) < 0.6 * whole
    monkeypatch.setattr(memory, "mesh_device_memory", lambda mesh: 0.75 * whole)
    path = write_experiment(tmp_path / "t.toml", exp)
    assert main(["train", str(path), "--mesh", "data=2", "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"plait: error: the train state (parameters and adamw state) takes "
        f"{whole / 2**30:,.1f} GiB per device as mesh data=2 lays it out"), err
    assert "shard it with fsdp (data keeps a whole copy on each device)" in err[0], err
    assert not (tmp_path / "r").exists()
    memory.check_state_fits(make_task(exp, make_mesh("fsdp=2")))  # half of it a device


def test_a_step_too_big_for_the_devices_is_refused_after_compiling_and_keeps_the_run(
        tmp_path, capsys, monkeypatch):
    """Parameters fit, activations do not: the compiled step's footprint (XLA's buffer
    assignment) against the devices' memory, before the first batch is made (a quickstart
    at global_batch 4194304 spent 3 minutes making one, then XLA said only
    'RESOURCE_EXHAUSTED: Out of memory allocating 951603954664 bytes')."""
    from helpers import make_mesh

    from plait.hardware import mesh_device_memory

    ckpt = {"enabled": True, "every_steps": 2, "keep": 3, "async_save": False}
    exp = write_experiment(tmp_path / "t.toml", tiny(train={"steps": 2}, checkpoint=ckpt))
    run = tmp_path / "r"
    assert main(["train", str(exp), "--mesh", "data=2", "--run-dir", str(run)]) == 0
    capsys.readouterr()
    # (2**22 rows' residual stream alone is more than the mesh has: refused before the
    # build, tasks.check_memory; 2**19 passes that and not the compiled footprint)
    huge = ["--set", f"train.global_batch={2**19}", "--set", "train.steps=4"]
    assert main(["train", str(exp), "--mesh", "data=2", "--run-dir", str(run), *huge]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    have = mesh_device_memory(make_mesh("data=2")) / 2**30
    assert f"more than the {have:,.1f} GiB of the host's memory per device of the mesh" in err[0]
    assert "the compiled train step needs" in err[0] and "of activations" in err[0], err
    assert "lower train.global_batch, or raise train.microbatches (now 1" in err[0], err
    assert 'set model.remat = "full"' in err[0] and "plait sweep" in err[0], err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2"]
    assert main(["train", str(exp), "--mesh", "data=2", "--run-dir", str(run),
                 "--set", "train.steps=4", "--set", 'log.console="line"']) == 0
    assert "resumed from the checkpoint at step 2" in capsys.readouterr().out
    # A fresh run's state is made only once its step fits: made before, while the step
    # compiled, it went on being made after the refusal (qwen2.5-0.5b on this host:
    # 30 s and 11 GB more before the process could end).
    from plait.tasks.gpt import GPTTask

    made, init = [], GPTTask.init_state
    monkeypatch.setattr(GPTTask, "init_state", lambda self, *a: made.append(1) or init(self, *a))
    assert main(["train", str(exp), "--mesh", "data=2", "--run-dir", str(tmp_path / "f"),
                 *huge]) == 2
    assert "the compiled train step needs" in capsys.readouterr().err and not made


def test_peak_device_memory_is_the_busiest_devices_high_water_mark():
    """On an accelerator plait train's summary and final line carry the allocator's peak
    (the busiest device of the mesh, this process's only); CPU keeps none: no figure."""
    from types import SimpleNamespace

    import numpy as np
    from helpers import make_mesh

    from plait.hardware import peak_memory_bytes
    from plait.train.loop import _final_line

    def device(peak, process=0):
        return SimpleNamespace(process_index=process, memory_stats=lambda: {
            "peak_bytes_in_use": peak, "bytes_limit": 80e9})

    gpus = SimpleNamespace(devices=np.array([device(1e9), device(3e9), device(9e9, 1)]))
    assert peak_memory_bytes(gpus) == 3e9
    assert peak_memory_bytes(make_mesh("data=2")) is None
    summary = {"preempted": False, "final_step": 4, "final_loss": 2.0, "tokens_per_s": 10.0,
               "wall_s": 1.0, "peak_device_memory_bytes": 3 * 2**30}
    run = SimpleNamespace(task=SimpleNamespace(unit="tokens"), last_saved=None)
    log = SimpleNamespace(history=[{"loss": 2.0}])
    line = _final_line(run, log, summary, 4)
    assert line.endswith("s wall, 3.0 GiB peak device memory"), line


def test_a_device_out_of_memory_at_run_time_says_what_to_change():
    """Where the footprint did not show it (another process on the GPU, a backend
    without buffer figures), XLA's RESOURCE_EXHAUSTED gets the same advice."""
    from types import SimpleNamespace

    import jax

    from plait.tasks.gpt import GPTTask
    from plait.train.failures import step_failed

    task = SimpleNamespace(attention="cudnn",
                           memory_fixes=lambda: GPTTask.memory_fixes(
                               SimpleNamespace(exp=tiny(model={"remat": "full"}),
                                               pipeline=None)))
    run = SimpleNamespace(task=task, last_saved=6)
    err = step_failed(run, 7, jax.errors.JaxRuntimeError(
        "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2147483648 bytes.\n..."))
    line = str(err)
    assert "\n" not in line and line.startswith(
        "the train step failed at step 8: RESOURCE_EXHAUSTED: Out of memory")
    assert "the device ran out of memory: lower train.global_batch" in line
    assert "model.remat" not in line  # already full
    assert "attention" not in line and line.endswith(
        "the checkpoint at step 6 is intact: rerun the same command to resume")


def test_skip_policy_leaves_the_state_as_it_was_and_stops_after_max_skipped(tmp_path, capsys):
    """train.on_nonfinite = "skip": from step 3 every step of a diverged run is non-finite;
    each leaves the state as it was after step 2 (the checkpoints of steps 3-5 hold step
    2's parameters, bit for bit), and the fourth in a row (> max_skipped = 3) stops the
    run in one line."""
    import orbax.checkpoint as ocp

    ckpt = {"enabled": True, "every_steps": 1, "keep": 10, "async_save": False}
    exp = write_experiment(tmp_path / "t.toml", tiny(
        optimizer={"lr": 1e5, "warmup_steps": 0}, checkpoint=ckpt, log={"console": "line"},
        train={"on_nonfinite": "skip", "max_skipped": 3}))
    run_dir = tmp_path / "r"
    assert main(["train", str(exp), "--mesh", "data=2", "--run-dir", str(run_dir)]) == 1
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "4 steps in a row (through step 6) had a non-finite loss" \
        in err[0] and "more than train.max_skipped = 3" in err[0], err
    assert "the checkpoint at step 5 is intact" in err[0], err
    assert "skipped" in captured.out  # the console status line counts them
    records = _strict(run_dir / "metrics.jsonl")
    assert [r["skipped_steps"] for r in records] == [0, 0, 1, 2, 3, 4]
    with ocp.StandardCheckpointer() as reader:
        params = [reader.restore(run_dir / "checkpoints" / str(s) / "state")["params"]
                  for s in (2, 3, 5)]
    for later in params[1:]:
        for a, b in zip(jax_leaves(params[0]), jax_leaves(later), strict=True):
            np.testing.assert_array_equal(a, b)
    assert all(np.isfinite(x).all() for x in jax_leaves(params[2]))


def jax_leaves(tree):
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_local_sgd_replicas_report_a_divergence_and_skip_like_one_model(tmp_path, capsys):
    """EASGD keeps the loss and gradient norm per replica (averaged on the host): a
    diverging run still stops in one line before saving, and "skip" still leaves the
    state as it was (every replica agrees on what is skipped)."""
    sync = {"method": "easgd", "period": 2}
    ckpt = {"enabled": True, "every_steps": 1, "keep": 10, "async_save": False}
    for policy in ("stop", "skip"):
        exp = write_experiment(tmp_path / f"{policy}.toml", tiny(
            optimizer={"lr": 1e6, "warmup_steps": 0}, checkpoint=ckpt, sync=sync,
            train={"on_nonfinite": policy, "max_skipped": 2}))
        run_dir = tmp_path / policy
        assert main(["train", str(exp), "--mesh", "data=2,tensor=2",
                     "--run-dir", str(run_dir)]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        records = _strict(run_dir / "metrics.jsonl")
        if policy == "stop":
            bad = records[-1]["step"]
            assert f"became non-finite (NaN or Inf) at step {bad}" in err[0]
            saved = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir())
            assert saved[-1] == bad - 1
        else:
            assert "3 steps in a row" in err[0] and "train.max_skipped = 2" in err[0]
            assert records[-1]["skipped_steps"] == 3
