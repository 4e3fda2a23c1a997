"""Two processes joined by jax.distributed (gloo on CPU) train exactly like one."""

import socket
import subprocess
import sys

import numpy as np
import pytest
from helpers import LINE_LOG, ROOT, losses, run, subprocess_env, tiny, write_experiment

MESH = "data=2,fsdp=2,tensor=2"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_equal_one(tmp_path):
    exp = tiny(checkpoint={"enabled": True, "every_steps": 6, "keep": 2, "async_save": True},
               log=LINE_LOG)
    path = write_experiment(tmp_path / "tiny.toml", exp)
    reference = losses(run(exp, MESH, tmp_path / "one"))
    port = _free_port()
    run_dir = tmp_path / "two"
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "plait", "train", str(path), "--mesh", MESH,
             "--run-dir", str(run_dir), "--coordinator", f"127.0.0.1:{port}",
             "--num-processes", "2", "--process-id", str(i)],
            cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
        for i in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    assert "8 cpu devices" in outs[0][0]
    np.testing.assert_allclose(losses(run_dir), reference, rtol=1e-5)
    assert (run_dir / "checkpoints" / "12").is_dir()
