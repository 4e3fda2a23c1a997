"""What the loop does on real accelerators, checked on CPU: the attention kernel "auto"
picks, a profile of chosen steps, and an XLA runtime error in the step ending in one line
with the last checkpoint intact."""

from __future__ import annotations

import gzip

import jax
import pytest
from helpers import tiny, wrap_gpt_step, write_experiment

from plait.tasks.gpt_runtime import UNROLL_MAX_LAYERS, attention_for, scan_for


@pytest.mark.parametrize("platform,kind,compute,heads,want", [
    ("gpu", "NVIDIA H100 80GB HBM3", "bfloat16", 12, "cudnn"),
    ("gpu", "NVIDIA A100-SXM4-80GB", "bfloat16", 16, "cudnn"),
    ("gpu", "NVIDIA H100 80GB HBM3", "float32", 12, "xla"),  # cuDNN flash needs bf16
    ("gpu", "NVIDIA H100 80GB HBM3", "bfloat16", 3, "xla"),  # head size 256 > 128
    ("gpu", "AMD Instinct MI300X", "bfloat16", 12, "xla"),
    ("cpu", "cpu", "bfloat16", 12, "xla"),
    ("tpu", "TPU v5p", "bfloat16", 12, "xla"),
])
def test_auto_attention_per_platform(platform, kind, compute, heads, want):
    cfg = tiny(model={"d_model": 768, "heads": heads}).model
    assert attention_for(cfg, compute, platform, kind)[0] == want
    forced = cfg.model_copy(update={"attention": "xla"})
    assert attention_for(forced, compute, platform, kind) == ("xla", "model.attention")
    # a run trained on cuDNN's is read with XLA's off an NVIDIA GPU (eval, sample; plait
    # train refuses it there: tasks.gpt_runtime.check_attention); it raised "cuDNN is
    # not detected" from inside the trace
    cudnn = cfg.model_copy(update={"attention": "cudnn"})
    nvidia = platform == "gpu" and "NVIDIA" in kind
    assert attention_for(cudnn, compute, platform, kind)[0] == ("cudnn" if nvidia else "xla")


@pytest.mark.parametrize("kind,compute,heads,needle", [
    ("cpu", "float32", 8, "runs cuDNN's fused attention on NVIDIA GPUs, not cpu; use "
                          "model.attention = \"auto\""),
    ("NVIDIA H100 80GB HBM3", "float32", 8, "runs in bfloat16, not precision.compute = "
                                            "\"float32\""),
    ("NVIDIA H100 80GB HBM3", "bfloat16", 3, "a head size that is a multiple of 8 up to 128, "
                                             "not 256"),
])
def test_cudnn_attention_where_it_cannot_run_is_refused(kind, compute, heads, needle):
    from helpers import FakeGPU

    from plait.errors import UserError
    from plait.tasks.gpt_runtime import check_attention

    cfg = tiny(model={"d_model": 768, "heads": heads, "attention": "cudnn"}).model
    device = jax.devices()[0] if kind == "cpu" else FakeGPU(kind)
    with pytest.raises(UserError, match=needle):
        check_attention(cfg, compute, device)
    check_attention(cfg.model_copy(update={"attention": "auto"}), compute, device)


@pytest.mark.parametrize("platform,layers,want", [
    ("gpu", 12, False), ("gpu", UNROLL_MAX_LAYERS, False), ("gpu", UNROLL_MAX_LAYERS + 1, True),
    ("cpu", 12, True), ("tpu", 12, True),
])
def test_auto_scan_per_platform_and_depth(platform, layers, want):
    cfg = tiny(model={"layers": layers, "scan_layers": "auto"}).model
    assert scan_for(cfg, platform)[0] is want
    for forced in (True, False):
        assert scan_for(cfg.model_copy(update={"scan_layers": forced}), platform) == \
            (forced, "model.scan_layers")


def test_startup_says_which_attention_and_layout_run(tmp_path, capsys):
    from plait.cli import main

    exp = write_experiment(tmp_path / "t.toml", tiny(train={"steps": 2}, model={
        "scan_layers": "auto"}, log={"console": "line"}))
    assert main(["train", str(exp), "--mesh", "data=1", "--run-dir", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "attention xla (auto: no fused kernel on cpu); layers scanned (auto: scanned on cpu)" \
        in out


def test_profile_writes_a_trace_of_the_chosen_steps(tmp_path, capsys):
    from plait.cli import main

    exp = write_experiment(tmp_path / "t.toml", tiny(
        train={"steps": 5}, log={"console": "line"},
        checkpoint={"enabled": True, "every_steps": 5, "keep": 1, "async_save": False}))
    run = tmp_path / "r"
    assert main(["train", str(exp), "--mesh", "data=2", "--run-dir", str(run),
                 "--profile", "2:4"]) == 0
    assert "profile of steps 3-4 written to" in capsys.readouterr().out
    traces = list((run / "profile").rglob("*.xplane.pb"))
    assert traces and traces[0].stat().st_size > 0
    perfetto = list((run / "profile").rglob("perfetto_trace.json.gz"))
    assert perfetto and gzip.decompress(perfetto[0].read_bytes()).startswith(b"{")
    assert main(["train", str(exp), "--profile", "4:2"]) == 2
    assert "need 0 <= START < STOP" in capsys.readouterr().err
    # The part of a window a resumed run reaches is traced, and said: a rerun of a
    # preempted run's command goes on (it had traced nothing, silently, as for a window
    # the run has passed); a window the run never reaches is refused before the step
    # compiles.
    assert main(["train", str(exp), "--mesh", "data=2", "--run-dir", str(run), "--steps", "7",
                 "--profile", "3:9"]) == 0
    out = capsys.readouterr().out
    assert "--profile 3:9 traces steps 6-7: the run resumes at step 5; it ends at step 7" in out
    assert "profile of steps 6-7 written to" in out
    assert len(list((run / "profile").rglob("*.xplane.pb"))) == 2
    assert main(["train", str(exp), "--run-dir", str(tmp_path / "u"), "--profile", "5:7"]) == 2
    assert "but the run ends at step 5; pick a window before it" in capsys.readouterr().err


def test_xla_runtime_error_is_one_line_and_keeps_the_last_checkpoint(tmp_path, capsys,
                                                                      monkeypatch):
    from plait.cli import main

    def failing(n, step, state, batch):
        if n == 4:  # the 4th step fails on the device
            raise jax.errors.JaxRuntimeError("INTERNAL: cuda_graph_end_capture failed\n"
                                             "  ... 40 lines of C++ context ...")
        return step(state, batch)

    wrap_gpt_step(monkeypatch, failing)
    ckpt = {"enabled": True, "every_steps": 2, "keep": 3, "async_save": True}
    exp = write_experiment(tmp_path / "t.toml", tiny(train={"steps": 8}, checkpoint=ckpt,
                                                     log={"console": "line"}))
    run = tmp_path / "r"
    assert main(["train", str(exp), "--mesh", "data=2", "--run-dir", str(run)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "the train step failed at step 4: INTERNAL: cuda_graph_end_capture failed" in err[0]
    assert "the checkpoint at step 2 is intact" in err[0]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2"]
    monkeypatch.undo()
    assert main(["train", str(exp), "--mesh", "data=2", "--run-dir", str(run)]) == 0
    assert "resumed from the checkpoint at step 2" in capsys.readouterr().out


def test_xla_defaults_yield_to_the_users_flags():
    from plait import xla_flags
    from plait.errors import UserError

    env = {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=true --xla_dump_to=/tmp/x"}
    added = xla_flags.apply_defaults(env)
    assert "--xla_gpu_enable_triton_gemm=false" not in env["XLA_FLAGS"]
    assert env["XLA_FLAGS"].startswith("--xla_gpu_enable_triton_gemm=true --xla_dump_to=/tmp/x ")
    assert len(added) == len(xla_flags.DEFAULTS) - 1
    assert all(a in env["XLA_FLAGS"] for a in added)
    assert xla_flags.apply_defaults(env) == []  # idempotent
    off = {"PLAIT_XLA_DEFAULTS": "0"}
    assert xla_flags.apply_defaults(off) == [] and "XLA_FLAGS" not in off
    # a value that is neither (a letter O for a zero) was taken as on, silently
    with pytest.raises(UserError, match="PLAIT_XLA_DEFAULTS='O' is neither on nor off"):
        xla_flags.apply_defaults({"PLAIT_XLA_DEFAULTS": "O"})


def test_a_steps_time_runs_from_the_previous_steps_end_to_its_own(tmp_path, monkeypatch):
    """A dispatch that holds the host after the device work is queued (on a GPU, the
    next step's, while the step before runs) must not make the last step look fast:
    each step's time is read from when its outputs were ready (train.metrics.StepEnds),
    not from when the loop got round to them. Read at the loop's sync, the last of
    gpt2-1.3b's 16 steps on an H100 took 242 ms against a median of 316."""
    import statistics
    import time

    from helpers import run

    def held(n, step, state, batch):
        out = step(state, batch)
        if n > 1:
            time.sleep(0.25)
        return out

    wrap_gpt_step(monkeypatch, held)
    records = run(tiny(train={"steps": 6}), "data=1", tmp_path)["records"]
    times = {r["step"]: r["step_time_s"] for r in records if r["step"] >= 3}
    assert times[6] >= 0.8 * statistics.median(times.values()) >= 0.2, times


def test_the_step_watcher_is_done_before_the_loop_returns():
    """StepEnds' daemon thread waits on each step's outputs; one still inside XLA when
    Python finalises is stopped by a forced unwind that XLA's C++ catches, and the
    process aborts ("FATAL: exception not rethrown", status -6) after a run that
    succeeded. `close` therefore waits for the steps it watches."""
    import jax.numpy as jnp

    from plait.train.metrics import StepEnds

    product = jax.jit(lambda a: (a @ a) @ a)
    x = jnp.ones((1024, 1024))
    ends = StepEnds()
    futures = [ends.submit(product(x)) for _ in range(4)]
    ends.close()
    assert all(f.done() for f in futures)


@pytest.mark.parametrize("window,start,total,traced,note", [
    ((2, 4), 0, 10, (2, 4), None),
    ((2, 40), 0, 10, (2, 10), "traces steps 3-10: it ends at step 10"),
    ((2, 6), 4, 10, (4, 6), "traces steps 5-6: the run resumes at step 4"),
    ((2, 4), 4, 10, None, "traces nothing: this run resumes at step 4, after the window"),
])
def test_a_profile_window_is_cut_to_the_steps_the_run_takes(window, start, total, traced,
                                                            note):
    from plait.train.profiler import check_window

    got, said = check_window(window, start, total)
    assert got == traced and (said is None if note is None else note in said), said
