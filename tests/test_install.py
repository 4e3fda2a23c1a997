"""A non-editable install works from any directory: the hardware descriptions ship as
package data, nothing is found through the source checkout."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import venv

import pytest
from helpers import ROOT, subprocess_env


@pytest.mark.slow
def test_non_editable_install_sweeps_and_trains_from_another_directory(tmp_path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], capture_output=True, text=True, check=True)
    # plait itself is installed (copied) into the fresh environment; its dependencies are
    # borrowed from this one (no network): a path entry, where .pth files are not run, so
    # this environment's editable plait stays out of sight.
    deps = sysconfig.get_paths()["purelib"]
    with open(f"{site.stdout.strip()}/deps.pth", "w") as f:
        f.write(deps + "\n")
    out = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                          "--no-deps", "--no-build-isolation", "-q", str(ROOT)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    where = subprocess.run([str(python), "-c", "import plait; print(plait.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path)
    assert where.stdout.startswith(str(env_dir)), where.stdout + where.stderr

    plait = str(env_dir / "bin" / "plait")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    exp = str(ROOT / "experiments" / "quickstart.toml")
    env = subprocess_env()
    # One layer: no pipeline shapes, so the sweep compiles only data / fsdp / tensor = 2.
    sweep = subprocess.run([plait, "sweep", exp, "--devices", "2", "--hardware", "h100-node",
                            "--workers", "1", "--set", "model.layers=1"], capture_output=True,
                           text=True, cwd=elsewhere, env=env, timeout=600)
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    rows = json.loads((elsewhere / "sweeps" / "quickstart-2" / "sweep.json").read_text())
    assert rows["hardware"] == "h100-sxm-node"
    assert {r["mesh"] for r in rows["rows"]} == {"data=2", "fsdp=2", "tensor=2"}
    run = subprocess.run([plait, "train", exp, "--mesh", "data=2", "--steps", "3",
                          "--run-dir", "r"], capture_output=True, text=True, cwd=elsewhere,
                         env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (elsewhere / "r" / "checkpoints" / "3").is_dir()
