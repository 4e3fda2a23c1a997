"""Tiny experiments and in-process runs shared by the tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from plait import mesh as mesh_lib
from plait.config import Experiment

ROOT = Path(__file__).resolve().parent.parent
# Compiled programs are cached per test worker (pytest-xdist runs two). One directory
# for both needs JAX's cache lock (a size limit), and then every write scans the whole
# directory: the cold suite took 18:50 instead of 15:19 (2026-11-24, 2 cores). Without a
# size limit JAX takes no lock, but sharing gained nothing either (test_moe + test_loss,
# cold, alternated: 149 / 136 s per worker, 149 / 153 s shared; 2026-11-27); and two
# directories never share a program: JAX's cache key holds the compile options, which
# name XLA's GPU autotuning cache inside the cache directory.
CACHE_DIR = os.environ.get(
    "PLAIT_TEST_CACHE",
    f"/tmp/plait-test-jax-cache-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}")


# The tests' programs are compiled with XLA's backend (LLVM) optimisation off: the
# partitioned HLO the tests read (collectives, FLOPs, buffers) is fixed before LLVM
# runs, results stay within the tests' tolerances, and compiling, most of the suite's
# time, takes half as long (tests/test_llama.py + test_equivalence.py cold: 178 s ->
# 83 s on 2 cores). XLA:CPU's legacy emitters replace its MLIR fusion emitters, the
# largest compile cost in a profile of the suite (chimera pipeline=4 step: 5.2-6.3 s ->
# 2.8-3.8 s); they round transcendentals by loop shape, so a test claiming bit-equal
# values across two programs compiles those with the fusion emitters
# (AS_TRAINED). Training outside the tests keeps XLA's defaults. Set
# PLAIT_TEST_XLA_OPT=1 to test with them.
TEST_XLA_FLAGS = ("" if os.environ.get("PLAIT_TEST_XLA_OPT") == "1" else
                  "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
                  " --xla_cpu_use_fusion_emitters=false")
# Compiler options for a test that claims something of the compiled program users get
# (no while loop, no concatenate, bit-equal values across two programs): the legacy
# emitters fuse differently (a scatter becomes a while loop; a stack a concatenate).
AS_TRAINED = {"xla_cpu_use_fusion_emitters": True}


# Log every step to the console as plain lines (for tests that read stdout).
LINE_LOG = {"every_steps": 1, "tensorboard": False, "console": "line"}


class FakeGPU:
    """A GPU as plait's device checks read one (tasks.gpt_runtime's "auto" choices and
    refusals; the grouped kernels size their grids by its SMs): an H100 unless told."""

    platform = "gpu"

    def __init__(self, kind: str = "NVIDIA H100 80GB HBM3", capability: str = "9.0",
                 cores: int = 132):
        self.device_kind, self.compute_capability, self.core_count = kind, capability, cores


def tiny(**sections) -> Experiment:
    """A one-layer GPT that every test mesh divides (8 heads, d_model 64). One block
    shows every sharded op a deeper stack runs, at ~60% of two blocks' compile time
    (most of the suite's time is compiling); a test whose point is between layers
    (pipeline stages, stacking, layer order in a conversion) asks for more."""
    raw = {
        "name": "tiny",
        "seed": 0,
        "model": {"layers": 1, "d_model": 64, "heads": 8, "d_ff": 128, "vocab": 256,
                  "seq_len": 32},
        "train": {"steps": 12, "global_batch": 16, "microbatches": 1},
        # decay_steps fixed so runs of different lengths share one schedule.
        "optimizer": {"lr": 3e-3, "warmup_steps": 2, "decay_steps": 100},
        "checkpoint": {"enabled": False, "every_steps": 4, "keep": 3, "async_save": True},
        "log": {"every_steps": 1, "tensorboard": False, "console": "none"},
    }
    for name, values in sections.items():
        if isinstance(values, dict):
            raw.setdefault(name, {}).update(values)
        else:
            raw[name] = values
    return Experiment.model_validate(raw)


def make_mesh(spec: str):
    s = mesh_lib.load_spec(spec)
    n = mesh_lib.provision_devices(s)
    return mesh_lib.build_mesh(mesh_lib.resolve(s, n), n, s.dcn)


def step_in_process(exp: Experiment, spec: str, n: int):
    """n train steps of `exp` on mesh `spec` in this process, no run directory: (the
    losses [n], the parameters after them as NumPy arrays)."""
    import jax

    from plait.tasks import make_task

    task = make_task(exp, make_mesh(spec))
    state, src, out = task.init_state(), task.source(), []
    for s in range(n):
        state, m = task.step_fn(state, task.batch(src, s))
        out.append(float(m["loss"]))
    return np.array(out), jax.tree.map(np.asarray, state["params"])


def run(exp: Experiment, spec: str, run_dir: Path) -> dict:
    from plait.train.loop import train

    return train(exp, make_mesh(spec), run_dir)


def losses(summary_or_dir) -> np.ndarray:
    if isinstance(summary_or_dir, dict):
        recs = summary_or_dir["records"]
    else:
        import json

        recs = [json.loads(line) for line in (Path(summary_or_dir) / "metrics.jsonl")
                .read_text().splitlines()]
    return np.array([r["loss"] for r in recs])


def assert_refused_off_a_gpu(exp: Experiment, key: str, tmp_path: Path, capsys) -> None:
    """`plait train` of `exp`, which sets model.`key` = "pallas" (a Triton kernel), on
    this CPU: status 2 and one line naming the setting, the device and the fix, before
    any run directory is made."""
    from plait.cli import main

    path = write_experiment(tmp_path / f"{key}.toml", exp)
    assert main(["train", str(path), "--mesh", "data=2", "--run-dir",
                 str(tmp_path / "refused")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"model.{key}" in err, err
    assert "NVIDIA GPUs, not cpu" in err and f'use model.{key} = "auto"' in err, err
    assert not (tmp_path / "refused").exists()


def subprocess_env() -> dict:
    """Environment for a fresh plait process: no inherited device flags, the tests'
    compiler flags, shared compile cache."""
    e = dict(os.environ)
    e.pop("XLA_FLAGS", None)
    if TEST_XLA_FLAGS:
        e["XLA_FLAGS"] = TEST_XLA_FLAGS
    e["TF_CPP_MIN_LOG_LEVEL"] = "2"
    e["JAX_COMPILATION_CACHE_DIR"] = CACHE_DIR
    e["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    return e


def plait_cmd(*args: str, devices: int | None = None, env: dict | None = None, **kw):
    """Run the real console entry point in a fresh process."""
    e = subprocess_env()
    if env:
        e.update(env)
    cmd = [sys.executable, "-m", "plait", *args]
    if devices is not None:
        cmd += ["--devices", str(devices)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=kw.pop("cwd", ROOT), env=e,
                          timeout=kw.pop("timeout", 300), **kw)


def write_experiment(path: Path, exp: Experiment) -> Path:
    path.write_text(exp.to_toml())
    return path


def wrap_gpt_step(monkeypatch, wrap) -> None:
    """Make every compiled GPT step of this test call `wrap(n, step, state, batch)`
    instead, n counting calls from 1 (to poison or fail a chosen step)."""
    from plait.tasks.gpt import GPTTask

    real_compile = GPTTask.compile

    def compile_wrapped(self, *a, **kw):
        step = real_compile(self, *a, **kw)
        calls = []

        def wrapped(state, batch):
            calls.append(1)
            return wrap(len(calls), step, state, batch)
        wrapped.as_text = step.as_text  # what plait train reads of the compiled step
        return wrapped

    monkeypatch.setattr(GPTTask, "compile", compile_wrapped)


def ragged_dot_mlp(x, w, sizes, activation: str):
    """An expert MLP (SwiGLU: w13 [G, K, 2, F]; GELU: w1 [G, K, F]; then w2 [G, F, K])
    on rows x sorted by group, written with jax.lax.ragged_dot and differentiated by
    JAX: what plait's grouped MLPs (tiles, Pallas kernels) are checked against."""
    import jax

    from plait.models.activations import gelu, swiglu

    G, K = w["w2"].shape[0], x.shape[1]
    if activation == "swiglu":
        gu = jax.lax.ragged_dot(x, w["w13"].reshape(G, K, -1), sizes)
        gu = gu.reshape(x.shape[0], 2, -1)
        hidden = swiglu(gu[:, 0], gu[:, 1])
    else:
        hidden = gelu(jax.lax.ragged_dot(x, w["w1"], sizes))
    return jax.lax.ragged_dot(hidden, w["w2"], sizes)
