"""Two processes joined by jax.distributed (gloo on CPU) train exactly like one."""

import subprocess
import sys

import numpy as np
import pytest
from helpers import LINE_LOG, ROOT, losses, run, subprocess_env, tiny, write_experiment

from plait.launch import free_port

MESH = "data=2,fsdp=2,tensor=2"


@pytest.mark.slow
@pytest.mark.parametrize("sync,mesh", [("easgd", MESH),
                                       ("allreduce", "data=2@dcn,data=2,fsdp=2")])
def test_two_processes_equal_one(sync, mesh, tmp_path):
    """EASGD on data x fsdp x tensor: replicas on different processes, the center's
    shards exchanged between them (period 4, a checkpoint mid-period at step 6); and
    allreduce with the data axis across the two processes as hosts, its gradients
    reduced within each first. (Plain allreduce over both processes is the second case
    without its hierarchy; the lost-process tests below train it across processes.)"""
    exp = tiny(checkpoint={"enabled": True, "every_steps": 6, "keep": 2, "async_save": True},
               log=LINE_LOG, sync={"method": sync, "period": 4})
    path = write_experiment(tmp_path / "tiny.toml", exp)
    reference = losses(run(exp, mesh, tmp_path / "one"))
    port = free_port()
    run_dir = tmp_path / "two"
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "plait", "train", str(path), "--mesh", mesh,
             "--run-dir", str(run_dir), "--coordinator", f"127.0.0.1:{port}",
             "--num-processes", "2", "--process-id", str(i)],
            cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
        for i in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    assert "8 cpu devices, 2 hosts" in outs[0][0]
    np.testing.assert_allclose(losses(run_dir), reference, rtol=1e-5)
    assert (run_dir / "checkpoints" / "12").is_dir()


def _start(path, run_dir, port, i, **kw):
    return subprocess.Popen(
        [sys.executable, "-m", "plait", "train", str(path), "--mesh", MESH, "--run-dir",
         str(run_dir), "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
         "--process-id", str(i)],
        cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, **kw)


@pytest.mark.slow
# Losing process 1 is test_launch_reports_the_lost_process_in_one_line's case (through
# plait launch); here the coordinator's process is lost (suite time).
@pytest.mark.parametrize("lost", [0])
def test_a_lost_process_ends_the_others_in_one_line_and_the_rerun_resumes(lost, tmp_path):
    """kill -9 of one process (the worker, or the coordinator's): the other ends within
    60 s in one line, exit 1, no abort trace; rerunning both resumes from the newest
    checkpoint onto the uninterrupted run's curve."""
    import signal
    import time

    from test_resume import _wait_for_step

    ckpt = {"enabled": True, "every_steps": 2, "keep": 2, "async_save": True}
    exp = tiny(checkpoint=ckpt, log=LINE_LOG, train={"steps": 400})
    path = write_experiment(tmp_path / "tiny.toml", exp)
    run_dir = tmp_path / "two"
    port = free_port()
    procs = [_start(path, run_dir, port, i) for i in range(2)]
    try:
        _wait_for_step(run_dir, 5, procs[0])
        procs[lost].send_signal(signal.SIGKILL)  # the supervisor; its child dies with it
        t0 = time.monotonic()
        out, err = procs[1 - lost].communicate(timeout=90)
        assert time.monotonic() - t0 < 60
    finally:
        for p in procs:
            p.kill()
            p.wait()
    survivor = procs[1 - lost]
    assert survivor.returncode == 1, err[-3000:]
    lines = err.strip().splitlines()
    assert "Check failure" not in err and "Traceback" not in err, err[-3000:]
    assert lines[-1].startswith(f"plait: error: process {1 - lost} of ") and \
        "rerun the same command on every process" in lines[-1], lines
    assert all(x.startswith("plait: ") for x in lines), lines
    saved = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert saved, "no checkpoint survived"
    if lost == 1:
        return  # the rerun is the same in both cases: checked once (suite time)
    # Rerun both processes: they resume and land on the curve of one uninterrupted run.
    short = tiny(checkpoint=ckpt, log=LINE_LOG, train={"steps": saved[-1] + 4})
    path = write_experiment(tmp_path / "tiny.toml", short)
    port = free_port()
    procs = [_start(path, run_dir, port, i) for i in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, e) in zip(procs, outs, strict=True):
        assert p.returncode == 0, e[-3000:]
    assert f"resumed from the checkpoint at step {saved[-1]}" in outs[0][0]
    reference = losses(run(short, MESH, tmp_path / "one"))
    np.testing.assert_allclose(losses(run_dir), reference, rtol=1e-5)


@pytest.mark.slow
def test_launch_reports_the_lost_process_in_one_line(tmp_path):
    import signal
    import time

    from test_resume import _wait_for_step

    exp = tiny(log=LINE_LOG, train={"steps": 400})
    path = write_experiment(tmp_path / "tiny.toml", exp)
    run_dir = tmp_path / "two"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "plait", "launch", "--processes", "2", "--", "train", str(path),
         "--mesh", MESH, "--run-dir", str(run_dir)],
        cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    try:
        _wait_for_step(run_dir, 3, launcher)
        # Process 1's supervisor: the launcher's child whose command says --process-id 1.
        out = subprocess.run(["pgrep", "-P", str(launcher.pid), "-f", "process-id 1"],
                             capture_output=True, text=True).stdout.split()
        assert len(out) == 1, out
        import os

        os.kill(int(out[0]), signal.SIGKILL)
        t0 = time.monotonic()
        _, err = launcher.communicate(timeout=120)
        assert time.monotonic() - t0 < 90
    finally:
        launcher.kill()
        launcher.wait()
    assert launcher.returncode == 1, err[-3000:]
    lines = err.strip().splitlines()
    assert "Check failure" not in err and "Traceback" not in err, err[-3000:]
    errors = [x for x in lines if x.startswith("plait: error:")]
    assert len(errors) == 1 and "process 1 of 2 failed first" in errors[0] and \
        "killed (SIGKILL)" in errors[0] or "exit -9" in errors[0], lines


@pytest.mark.slow
def test_two_processes_score_a_checkpoint_like_one(tmp_path):
    """plait launch -- eval: each process makes only its windows, the loss is the same."""
    import json

    from plait.cli import main
    from plait.data.writer import write_tokens

    exp = tiny(train={"steps": 2}, checkpoint={"enabled": True, "every_steps": 2, "keep": 1,
                                               "async_save": False})
    run(exp, "data=2", tmp_path / "r")
    write_tokens(np.random.default_rng(5).integers(0, 256, 16 * 32 + 1), tmp_path / "v.bin",
                 "uint16")
    args = ["eval", str(tmp_path / "r"), "--data", str(tmp_path / "v.bin"), "--mesh",
            "data=4", "--batch", "8"]
    assert main([*args, "--json", str(tmp_path / "one.json")]) == 0
    out = subprocess.run([sys.executable, "-m", "plait", "launch", "--processes", "2", "--",
                          *args, "--json", str(tmp_path / "two.json")], cwd=ROOT,
                         env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    one, two = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    assert two["mesh"] == "data=2@dcn,data=2" and two["windows"] == one["windows"] == 16
    np.testing.assert_allclose(two["loss"], one["loss"], rtol=1e-6)
