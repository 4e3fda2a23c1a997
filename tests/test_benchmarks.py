"""The benchmark scripts a lent GPU runs (benchmarks/gpu_figures.sh) run on CPU as
written, on tiny experiments: their arguments, their JSON, their refusals. A GPU comes
for about 30 minutes in some sessions only; none of them should be spent finding that a
script rotted while no GPU was there to run it."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from helpers import ROOT, subprocess_env

# The shipped experiments' two layers cut to one where a test runs a script end to end:
# what it checks is the script's figures, not the depth (half the compile).
ONE_LAYER = ("--set", "model.layers=1")


def _script(name: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    e = subprocess_env()
    e.update(env or {})
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / name), *args],
                          capture_output=True, text=True, cwd=ROOT, env=e, timeout=300)


def _here(monkeypatch, capsys, name: str, *args: str) -> tuple[int, str, str]:
    """(status, stdout, stderr) of `python benchmarks/NAME ARGS` run in this process (its
    directory first on the path, its path as argv[0]): for the runs that end before any
    work, where a process of its own would spend seconds importing JAX to say one line."""
    import runpy

    path = ROOT / "benchmarks" / name
    monkeypatch.setattr(sys, "argv", [str(path), *args])
    monkeypatch.syspath_prepend(str(path.parent))
    monkeypatch.chdir(ROOT)
    capsys.readouterr()
    with pytest.raises(SystemExit) as end:
        runpy.run_path(str(path), run_name="__main__")
    out = capsys.readouterr()
    return end.value.code, out.out, out.err


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_throughput_reports_the_loop_users_run(tmp_path):
    """gpu_figures.sh's llama1b / gpt124 / gpt1p3b stages: a Llama with the loss in
    pieces, the timed steps after the warm-up, tokens/s from the median step."""
    out = tmp_path / "t.json"
    proc = _script("throughput.py", "experiments/llama-tiny.toml", "--steps", "5", "--warmup",
                   "2", "--set", "model.loss_chunks=4", *ONE_LAYER, "--json", str(out))
    _ok(proc)
    got = json.loads(out.read_text())
    assert json.loads(proc.stdout[proc.stdout.index("{"):]) == got
    assert (got["experiment"], got["device"], got["mesh"]) == ("llama-tiny", "cpu", "data=1")
    assert got["steps_timed"] == 3  # steps 3-5 of 5: the first two are warm-up
    tokens = got["global_batch"] * got["seq_len"]
    assert got["tokens_per_s"] == pytest.approx(tokens / got["median_step_s"])
    assert got["compile_s"] > 0 and got["model_tflops_per_s_per_device"] > 0
    # no peak FLOP/s or allocator figures for a CPU: null, not a made-up number
    assert got["mfu"] is None and got["peak_device_memory_gib"] is None
    assert got["log_every"] == 1 and got["sets"] == ["model.loss_chunks=4", *ONE_LAYER[1::2]]

    # logged as the experiments log (every N-th step): a record's time is its N steps'
    # mean; records at steps 1 (the compiling one, dropped), 2, 4, 6 and the last, 7
    _ok(_script("throughput.py", "experiments/llama-tiny.toml", "--steps", "7", "--warmup",
                "1", "--log-every", "2", *ONE_LAYER, "--json", str(out)))
    got = json.loads(out.read_text())
    assert (got["log_every"], got["steps_timed"]) == (2, 4)


def test_moe_against_its_dense_twin(tmp_path):
    """gpu_figures.sh's moe stage: the MoE and a dense model of the same active matmul
    weights, trained by the same loop, each in a process of its own, their tokens/s side
    by side."""
    out = tmp_path / "m.json"
    _ok(_script("moe_vs_dense.py", "experiments/moe-tiny.toml", "--rounds", "1", "--steps",
                "4", "--warmup", "1", "--variant", "cap1:model.moe.capacity_factor=1.0",
                *ONE_LAYER, "--json", str(out)))
    got = json.loads(out.read_text())
    (r,) = got["rounds"]
    assert r["ratio"] == pytest.approx(r["moe"]["tokens_per_s"] / r["dense"]["tokens_per_s"])
    assert got["median_ratio"] == r["ratio"]
    # a variant of the MoE, timed in the same round against the same twin
    assert r["ratio_cap1"] == pytest.approx(r["cap1"]["tokens_per_s"]
                                            / r["dense"]["tokens_per_s"])
    assert got["variants"]["cap1"]["sets"] == "model.moe.capacity_factor=1.0"
    assert len({r[name]["pid"] for name in ("moe", "cap1", "dense")}) == 3
    active = got["active_matmul_params"]
    assert active["dense"] == pytest.approx(active["moe"], rel=0.02)  # the router's weights
    assert got["params"]["moe"] > 2 * got["params"]["dense"]


@pytest.mark.parametrize("script,says", [
    ("pallas_blocks.py", "run on a Hopper GPU, not cpu"),
    ("loss_kernel.py", "runs on an NVIDIA GPU, not cpu"),
    ("norm_kernel.py", "run on an NVIDIA GPU, not cpu"),
    ("fp8_kernel.py", "the kernel runs on an NVIDIA GPU, not cpu")])
def test_the_kernel_benchmarks_refuse_a_cpu_in_one_line(script, says, monkeypatch, capsys):
    """gpu_figures.sh's pallas, losskernel, normkernel and fp8kernelcheck stages time GPU
    kernels: on this CPU each script ends in one line, status 2."""
    code, _, err = _here(monkeypatch, capsys, script)
    err = err.strip()
    assert code == 2 and says in err and err.count("\n") == 0, err


@pytest.mark.parametrize("script,args,runs", [
    ("loss_kernel.py", ["--rows", "40", "--vocab", "100", "--padded", "128"],
     ("kernel", "kernel_gradient")),
    ("norm_kernel.py", ["--rows", "40", "--width", "48"], ("kernel",))])
def test_the_kernel_benchmarks_time_and_check_their_settings(script, args, runs, monkeypatch,
                                                             tmp_path):
    """The losskernel and normkernel stages' scripts as the GPU would run them, here with
    every Pallas call in its interpreter and on tiny arrays (two launch settings of each
    list): each setting timed and its values equal to XLA's, the best one recorded, so a
    GPU's first minutes on them are not spent finding the script broken."""
    import importlib.util
    import types

    from jax.experimental import pallas as pl

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import report

    pallas_call = pl.pallas_call
    monkeypatch.setattr(pl, "pallas_call",
                        lambda *a, **k: pallas_call(*a, **{**k, "interpret": True}))
    monkeypatch.setattr(report, "nvidia_gpu",
                        lambda what: types.SimpleNamespace(device_kind="interpreter"))
    spec = importlib.util.spec_from_file_location(script[:-3], ROOT / "benchmarks" / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name in ("SETTINGS", "GRAD_SETTINGS"):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, getattr(module, name)[:2])
    out = tmp_path / "kernel.json"
    monkeypatch.setattr(sys, "argv", [script, *args, "--repeat", "1", "--json", str(out)])
    assert module.main() == 0
    got = json.loads(out.read_text())
    for key in runs:
        assert len(got[key]) == 2 and all("error" not in r for r in got[key]), got[key]
        assert got["best" + key[len("kernel"):]] in got[key]


@pytest.mark.parametrize("mlp", [[], ["--mlp"]], ids=["product", "mlp"])
def test_grouped_matmul_variants_agree_and_are_timed(tmp_path, mlp):
    """gpu_figures.sh's grouped stage: every tiles variant computes what ragged_dot's
    grouped matmuls compute (one product, or a SwiGLU MLP; float32 here), on skewed
    routing whose largest group overflows a balanced share, and each has a time."""
    out = tmp_path / "g.json"
    _ok(_script("grouped_matmul.py", "--rows", "512", "--k", "16", "--n", "24", "--skew",
                "0.5", "--dtype", "float32", "--repeat", "1", "--rounds", "1", "--json",
                str(out), *mlp))
    got = json.loads(out.read_text())
    assert sum(got["sizes"]) == 512 and got["largest_over_mean"] > 1.25
    assert set(got["relative_error_vs_ragged_dot"]) == {
        "tiles-b0-s0", "tiles-b1-s0", "tiles-b1-s0.25", "tiles-b1-s1.25", "tiles-b0-s1.25"}
    assert max(got["relative_error_vs_ragged_dot"].values()) < 1e-5
    assert set(got["median_ms"]) == {"dense", "batched", "ragged_dot",
                                     *got["relative_error_vs_ragged_dot"]}


def test_fp8_against_bf16_emulated_and_refused(tmp_path, monkeypatch, capsys):
    """gpu_figures.sh's fp8 stage on XLA:CPU's FP8 emulation: both runs, each in a process
    of its own, the speed-up and the loss curves' gap; without emulation, a CPU is
    refused in one line before the bf16 run is spent."""
    out = tmp_path / "f.json"
    _ok(_script("fp8_vs_bf16.py", "experiments/quickstart.toml", "--steps", "6", "--warmup",
                "1", "--from-step", "3", "--window", "2", *ONE_LAYER, "--json", str(out),
                env={"PLAIT_FP8_EMULATE": "1"}))
    got = json.loads(out.read_text())
    assert len(got["default"]["losses"]) == len(got["fp8"]["losses"]) == 6
    assert got["fp8_speedup"] == pytest.approx(
        got["fp8"]["tokens_per_s"] / got["default"]["tokens_per_s"])
    assert 0 < got["max_rel_loss_gap_from_step"]["gap"] < 0.01

    monkeypatch.delenv("PLAIT_FP8_EMULATE", raising=False)
    code, said, err = _here(monkeypatch, capsys, "fp8_vs_bf16.py",
                            "experiments/quickstart.toml", "--steps", "6")
    assert code == 2 and err.strip().splitlines() == [err.strip()]
    assert err.startswith("fp8_vs_bf16.py: error: precision.matmul = \"fp8\" needs")
    assert "step " not in said  # nothing trained first


def test_a_benchmark_refuses_an_unknown_key_in_one_line(monkeypatch, capsys):
    """A mistyped --set key: one line naming the key and the fix, status 2."""
    code, _, err = _here(monkeypatch, capsys, "throughput.py", "experiments/quickstart.toml",
                         "--set", "model.layerz=2")
    assert code == 2 and "Traceback" not in err
    assert err.strip() == ("throughput.py: error: unknown config key 'model.layerz' "
                                  "(a gpt model) in --set model.layerz; did you mean "
                                  "'model.layers'?")


def test_plait_against_nanogpt_with_a_stand_in_bench(tmp_path):
    """gpu_figures.sh's nanogpt stage (issue 29's headline ratio) with a stand-in for
    nanoGPT's bench.py, which needs CUDA: the arguments it is given, the line it prints
    read back, plait's side at the same batch and sequence (a small GPT-2 through
    --set) as shipped and without biases (bench.py's architecture), bench.py again
    with GPT-2's biases (--bias=True), the ratios. Without bench.py: one line, status
    2."""
    ref = tmp_path / "nanoGPT"
    ref.mkdir()
    (ref / "bench.py").write_text(
        "import sys\n"
        "args, biases = sys.argv[1:5], sys.argv[5:]\n"
        "assert args == ['--batch_size=2', '--block_size=32', '--real_data=False',"
        " '--profile=False'] and biases in ([], ['--bias=True']), sys.argv\n"
        "for i in range(3):\n"
        "    print(f'{i}/20 loss: 10.9, time per iteration: {80 + 10 * len(biases) + i}.0ms')\n")
    out = tmp_path / "n.json"
    small = ["--set", "model.layers=1", "--set", "model.d_model=64", "--set", "model.heads=2",
             "--set", "model.d_ff=128", "--set", "precision.compute='float32'"]
    _ok(_script("gpt_vs_nanogpt.py", "--reference", str(ref), "--batch", "2", "--seq", "32",
                "--rounds", "1", "--steps", "3", *small, "--json", str(out)))
    got = json.loads(out.read_text())
    [r] = got["rounds"]
    assert r["nanogpt_tokens_per_s"] == got["nanogpt_median"] == 2 * 32 / 0.082
    assert r["ratio"] == pytest.approx(r["plait_tokens_per_s"] / r["nanogpt_tokens_per_s"])
    assert r["ratio_nobias"] == got["ratio_nobias_median"] == pytest.approx(
        r["plait_nobias_tokens_per_s"] / r["nanogpt_tokens_per_s"])
    assert r["nanogpt_biases_tokens_per_s"] == got["nanogpt_biases_median"] == 2 * 32 / 0.092
    assert r["ratio_biases"] == got["ratio_biases_median"] == pytest.approx(
        r["plait_tokens_per_s"] / r["nanogpt_biases_tokens_per_s"])
    assert r["plait_mfu"] is None and r["plait_peak_device_memory_gib"] is None
    assert got["plait_nobias_sets"] == [*small[1::2], "model.bias=false"]
    assert (got["batch"], got["seq"], got["device"]) == (2, 32, "cpu")


def test_plait_against_nanogpt_needs_bench_py(tmp_path, monkeypatch, capsys):
    """Without nanoGPT's bench.py under --reference: one line, status 2."""
    code, _, err = _here(monkeypatch, capsys, "gpt_vs_nanogpt.py", "--reference", str(tmp_path))
    assert code == 2
    assert err.strip() == (f"gpt_vs_nanogpt.py: error: {tmp_path} has no bench.py; "
                           "pass a nanoGPT checkout with --reference")


# Two profiled steps of a GPU: cuBLAS and cuDNN kernels, a copy, fusions, the host
# reading a loop's condition (device-to-host copies), and a derived "XLA Ops" line that
# repeats the stream's time and must not be counted twice, another of the program's runs;
# the GPU idles 1 us before the copy (which overlaps the reduction after it) and 100 us
# before the last fusion.
_XSPACE = '''
planes {
  id: 1 name: "/device:GPU:0"
  lines { id: 1 name: "Stream #14(MemcpyD2H,Compute,Memset)" timestamp_ns: 0
    events { metadata_id: 1 offset_ps: 0 duration_ps: 3000000000
      stats { metadata_id: 20 str_value: "custom-call.1" } }
    events { metadata_id: 1 offset_ps: 3000000000 duration_ps: 3000000000
      stats { metadata_id: 20 str_value: "custom-call.1" } }
    events { metadata_id: 2 offset_ps: 6000000000 duration_ps: 1000000000 }
    events { metadata_id: 2 offset_ps: 7000000000 duration_ps: 1000000000 }
    events { metadata_id: 3 offset_ps: 8001000000 duration_ps: 500000000 }
    events { metadata_id: 4 offset_ps: 8500000000 duration_ps: 300000000 }
    events { metadata_id: 5 offset_ps: 8800000000 duration_ps: 100000000 }
    events { metadata_id: 6 offset_ps: 9000000000 duration_ps: 200000000
      stats { metadata_id: 20 str_value: "loop_add_fusion.48" } }
    events { metadata_id: 7 offset_ps: 9100000000 duration_ps: 10000000 }
    events { metadata_id: 7 offset_ps: 9200000000 duration_ps: 10000000 }
  }
  lines { id: 2 name: "XLA Ops" timestamp_ns: 0
    events { metadata_id: 8 offset_ps: 0 duration_ps: 9000000000 }
  }
  lines { id: 3 name: "XLA Modules" timestamp_ns: 0
    events { metadata_id: 9 offset_ps: 4800000000 duration_ps: 4400000000 }
    events { metadata_id: 9 offset_ps: 0 duration_ps: 4600000000 }
  }
  event_metadata { key: 1 value { id: 1 name: "nvjet_sm90_tst_320x128_64x3_1x2_h_TNT" } }
  event_metadata { key: 2 value { id: 2 name: "cudnn_generated_fort_native_sdpa_sm90_bprop" } }
  event_metadata { key: 3 value { id: 3 name: "memcpy128" } }
  event_metadata { key: 4 value { id: 4 name: "input_add_reduce_fusion" } }
  event_metadata { key: 5 value { id: 5 name: "input_scatter_fusion_31" } }
  event_metadata { key: 6 value { id: 6 name: "loop_add_fusion_48" } }
  event_metadata { key: 7 value { id: 7 name: "MemcpyD2H" } }
  event_metadata { key: 8 value { id: 8 name: "fusion.1" } }
  event_metadata { key: 9 value { id: 9 name: "jit_step(1)" } }
  stat_metadata { key: 20 value { id: 20 name: "hlo_op" } }
}
'''


def test_kernel_profile_sums_a_gpu_trace_by_kind_and_refuses_a_cpu_one(tmp_path, monkeypatch):
    """kernel_profile.py (gpu_figures.sh's profiles stage): a GPU trace's kernels per
    step by kind and by name, the host round trips counted apart, and the step time of
    the untraced steps before the window (metrics.jsonl beside the profile) less the
    kernels' as the time the GPU waited; a CPU run's trace (no GPU plane) is refused
    in one line."""
    from jax.profiler import ProfileData

    trace = tmp_path / "profile" / "plugins" / "profile" / "run"
    trace.mkdir(parents=True)
    (trace / "host.xplane.pb").write_bytes(
        ProfileData.text_proto_to_serialized_xspace(_XSPACE))
    # the step's program as XLA dumped it beside the trace: its instructions' JAX ops
    (tmp_path / "hlo").mkdir()
    (tmp_path / "hlo" / "module_0001.jit_step.sm_9.0_gpu_after_optimizations.txt").write_text(
        '%custom-call.1 = (bf16[4,4]{1,0}, s8[16]{0}) custom-call(%a, %b), '
        'custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(step)/jvp(x)/dot_'
        'general"}\n  ROOT %loop_add_fusion.48 = f32[4]{0} fusion(%c), kind=kLoop, calls=%f, '
        'metadata={op_name="jit(step)/add" scheduling_name="loop_add_fusion.48"}\n')
    (tmp_path / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "step_time_s": t}) + "\n"
        for s, t in [(1, 9.0), (2, 0.0051), (3, 0.0049), (4, 0.0050), (5, 0.0080)]))
    out = tmp_path / "k.json"
    _ok(_script("kernel_profile.py", "--trace", str(tmp_path / "profile"), "--window", "4:6",
                "--json", str(out)))
    got = json.loads(out.read_text())
    assert got["device"] == "/device:GPU:0" and got["steps"] == 2
    # steps 2-4: after the compiling step, before the traced ones
    assert got["step_ms"] == pytest.approx(5.0)
    assert got["gpu_waited_ms_per_step"] == pytest.approx(5.0 - 4.55)
    assert got["busy_ms_per_step"] == pytest.approx(4.55)  # 9.1 ms over 2 steps
    assert got["host_round_trips_per_step"] == 1
    assert got["kinds_ms_per_step"] == pytest.approx({
        "matmul": 3.0, "attention": 1.0, "copy": 0.25, "reduction": 0.15,
        "other fusion": 0.1, "gather/scatter": 0.05})
    assert got["top"][0] == {"kernel": "nvjet_sm90_tst_320x128_64x3_1x2_h_TNT",
                             "kind": "matmul", "ms_per_step": 3.0, "calls_per_step": 1.0}
    assert got["kernels_per_step"] == 4
    assert got["span_ms_per_step"] == pytest.approx(9.2 / 2)
    assert got["idle_ms_per_step"] == pytest.approx(0.101 / 2)
    assert got["idle_by_gap"]["0-2 us"] == {"gaps_per_step": 0.5, "ms_per_step": 0.0005}
    assert got["idle_by_gap"]["100-1000 us"] == {"gaps_per_step": 0.5, "ms_per_step": 0.05}
    assert got["idle_by_gap"][">=1000 us"]["gaps_per_step"] == 0
    assert got["largest_gaps"] == [
        {"us": 100.0, "after": "input_scatter_fusion_31", "before": "loop_add_fusion_48"},
        {"us": 1.0, "after": "cudnn_generated_fort_native_sdpa_sm90_bprop",
         "before": "memcpy128"}]
    assert got["kernels_under_5us_per_step"] == {"count": 0, "ms": 0}
    # kernel time by the JAX operation whose HLO instruction launched it (the dump's
    # op_name); the kernels with no instruction named are left out
    assert got["ops"] == [{"op": "jvp(x)/dot_general", "ms_per_step": 3.0},
                          {"op": "add", "ms_per_step": 0.1}]
    # kernels without their instruction: the derived "XLA Ops" line's names instead
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import kernel_profile

    bare = re.sub(r"\n\s*stats \{[^}]*\} \}", " }", _XSPACE)
    summary = kernel_profile.summarize(ProfileData.from_serialized_xspace(
        ProfileData.text_proto_to_serialized_xspace(bare)), 2,
        hlo_text='ROOT %fusion.1 = f32[4]{0} fusion(%c), metadata={op_name="jit(step)/mul"}')
    assert summary["ops"] == [{"op": "mul", "ms_per_step": 4.5}]
    # the derived line of program runs: one per step, the second 0.2 ms after the first
    assert got["module_runs"] == [
        {"module": "jit_step(1)", "ms": 4.6, "after_gap_ms": None},
        {"module": "jit_step(1)", "ms": 4.4, "after_gap_ms": 0.2}]

    proc = _script("kernel_profile.py", "experiments/quickstart.toml", "--steps", "2",
                   "--window", "1:2")
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert "no GPU plane" in line


# A scanned step in miniature, as XLA:GPU writes it: a loop of 8 whose body runs a
# cuBLAS product and stacks its result in place, then one slice of the stack read back
# and a reduction (its adder applied, never launched).
_GPU_HLO = (ROOT / "tests" / "data" / "gpu_loop.hlo").read_text()


def test_hlo_census_counts_a_gpu_programs_kernels_bytes_and_flops(monkeypatch):
    """gpu_census.py's accounting (benchmarks/hlo_census.py) on a loop in miniature: the
    loop body's kernels count its trip count, a product's FLOPs come from cuBLAS's
    contracting dimensions, a stack updated in place counts the update (not the stack),
    a slice read back counts the slice; fused and applied computations launch nothing;
    each kernel's time is the larger of its FLOPs and its bytes at their rates."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import hlo_census

    found = {k.name: k for k in hlo_census.kernels(_GPU_HLO)}
    assert set(found) == {"custom-call.1", "loop_dynamic_update_slice_fusion",
                          "loop_dynamic_slice_fusion", "reduce.1"}
    mm, stack, read = (found[n] for n in ("custom-call.1", "loop_dynamic_update_slice_fusion",
                                          "loop_dynamic_slice_fusion"))
    assert (mm.kind, mm.launches, mm.flops) == ("matmul", 8, 2 * 64 * 32 * 128)
    assert mm.bytes == 2 * (64 * 128 + 128 * 32 + 64 * 32)  # the workspace not counted
    assert (stack.kind, stack.launches) == ("gather/scatter", 8)
    assert stack.bytes == 2 * 64 * 32 + 4 + 2 * 64 * 32  # product + index in, update out
    assert (read.launches, read.bytes) == (1, 2 * 64 * 32 + 4 + 2 * 64 * 32)
    assert (found["reduce.1"].kind, found["reduce.1"].bytes) == ("reduction", 4096 + 4 + 4)
    total = hlo_census.estimate(list(found.values()), peak_flops=1e9, bandwidth=1e9,
                                matmul_efficiency=0.5, memory_efficiency=1.0, launch_s=0.0)
    assert mm.seconds == pytest.approx(8 * max(mm.flops / 0.5e9, mm.bytes / 1e9))
    assert mm.seconds == pytest.approx(8 * mm.flops / 0.5e9)  # compute-bound at 1 GFLOP/s
    assert stack.seconds == pytest.approx(8 * stack.bytes / 1e9)
    assert total == pytest.approx(sum(k.seconds for k in found.values()))
    # each launch costs a fixed time besides its roofline
    with_launches = hlo_census.estimate(list(found.values()), peak_flops=1e9,
                                        bandwidth=1e9, matmul_efficiency=0.5,
                                        memory_efficiency=1.0, launch_s=1e-3)
    assert with_launches == pytest.approx(total + 1e-3 * (8 + 8 + 1 + 1))
    assert mm.seconds == pytest.approx(8 * (mm.flops / 0.5e9 + 1e-3))
    # cuDNN's flash attention has its own rate (a quarter of the peak on an H100)
    att = hlo_census.Kernel(name="custom-call.2", kind="attention", launches=2, bytes=1.0,
                            flops=1e9)
    hlo_census.estimate([att], peak_flops=1e9, bandwidth=1e9)
    assert att.seconds == pytest.approx(2 * (1 / hlo_census.ATTENTION_EFFICIENCY
                                             + hlo_census.LAUNCH_S))
    groups = {g["group"]: g for g in hlo_census.by_group(list(found.values()), top=10)}
    assert groups["loop_dynamic_update_slice_fusion"]["launches"] == 8
    assert hlo_census.by_kind(list(found.values()))["matmul"]["launches"] == 8
    # tiny: under a megabyte and no product -- all but the matmul here, by their op
    tiny = hlo_census.tiny_by_op(list(found.values()), top=10)
    assert sum(t["launches"] for t in tiny) == hlo_census.tiny_launches(
        list(found.values())) == 8 + 1 + 1
    # (this miniature's kernels carry no op_name: grouped by kind under "(none)")
    assert [(t["kind"], t["launches"]) for t in tiny] == [("gather/scatter", 9),
                                                          ("reduction", 1)]


_PALLAS_HLO = (ROOT / "tests" / "data" / "gpu_pallas.hlo").read_text()


def test_hlo_census_prices_the_pallas_grouped_products_by_their_flops(monkeypatch):
    """The Mosaic GPU calls of model.moe.grouped = "pallas" are products: 2 x rows x
    contracted x output columns, whichever of the two kernels (by their bytes alone the
    roofline put them at a tenth of their time)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import hlo_census

    found = {k.name: k for k in hlo_census.kernels(_PALLAS_HLO)}
    assert set(found) == {"mpmd_map.1", "mpmd_map.2"}
    for k in found.values():
        assert (k.kind, k.launches, k.flops) == ("matmul", 1, 2 * 256 * 64 * 128)


_FIRST_COLUMN_HLO = """HloModule first, is_scheduled=true

%fused_first (param_0: bf16[64,32]) -> f32[64,1] {
  %param_0 = bf16[64,32]{1,0} parameter(0)
  %bitcast.1 = bf16[2,32,32]{2,1,0} bitcast(%param_0)
  %convert.1 = f32[2,32,32]{2,1,0} convert(%bitcast.1)
  %slice.1 = f32[2,32,1]{2,1,0} slice(%convert.1), slice={[0:2], [0:32], [0:1]}
  ROOT %bitcast.2 = f32[64,1]{1,0} bitcast(%slice.1)
}

ENTRY %main (x: bf16[64,32]) -> f32[64,1] {
  %x = bf16[64,32]{1,0} parameter(0)
  ROOT %loop_slice_fusion = f32[64,1]{1,0} fusion(%x), kind=kLoop, calls=%fused_first
}
""".replace("calls=%fused_first\n",
            'calls=%fused_first, metadata={op_name="jit(step)/jvp()/slice"}\n')


def test_hlo_census_counts_a_slice_read_through_a_cast_as_the_slice(monkeypatch):
    """A fusion that reads its operand only through a slice after a bitcast and a cast
    (LayerNorm's shift: each row's first value in float32) reads the slice's elements
    at the operand's width, not the operand."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import hlo_census

    (k,) = hlo_census.kernels(_FIRST_COLUMN_HLO)
    assert k.bytes == 64 * 2 + 64 * 4  # 64 bf16 values read, 64 float32 written
    # grouped by the JAX operation that made it; tiny: no product, under a megabyte
    hlo_census.estimate([k], peak_flops=1e9, bandwidth=1e9)
    assert hlo_census.by_op([k], top=5) == [{
        "op": "jvp()/slice", "kind": k.kind, "launches": 1, "gb": 0.0,
        "ms": round(k.seconds * 1e3, 3)}]
    assert hlo_census.tiny_launches([k]) == 1


def test_gpu_census_needs_jax_cuda_plugin_without_a_gpu(monkeypatch, capsys):
    """Without JAX's CUDA plugin, gpu_census.py says how to get it in one line."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_census

    if gpu_census.cuda_plugin():
        pytest.skip("the CUDA plugin is installed here")
    code, _, err = _here(monkeypatch, capsys, "gpu_census.py", "experiments/quickstart.toml")
    assert code == 2
    assert err.strip() == ('gpu_census.py: error: JAX\'s CUDA plugin is not '
                                   'installed: pip install "jax[cuda13]" (no GPU needed) to '
                                   'compile for a GPU here')


def test_hlo_census_prices_a_data_sized_switch_at_the_size_asked(monkeypatch):
    """A switch among sizes the data chooses (dropless experts' spill, under
    hlo.SIZED_BY_DATA) counts one branch: the first (0 tiles) by default, or the one
    `sized_branch` names (the last past the end) -- gpu_census.py --sized-branch."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import hlo_census

    text = (ROOT / "tests" / "data" / "gpu_sized.hlo").read_text()
    launched = {b: sorted(k.name for k in hlo_census.kernels(text, b)) for b in (0, 1, 2, 9)}
    assert launched == {0: ["c0"], 1: ["n1"], 2: ["e2", "n2"], 9: ["e2", "n2"]}


def test_ops_compare_puts_the_census_beside_a_profile(tmp_path, monkeypatch, capsys):
    """ops_compare.py: the census's estimated and a profile's measured ms a step per JAX
    operation, the largest measured first, an operation one side lacks at 0 there;
    a JSON without ops is refused in one line."""
    census, profile, out = (tmp_path / n for n in ("c.json", "p.json", "o.json"))
    census.write_text(json.dumps({"ops": [{"op": "dot", "ms": 2.0}, {"op": "add", "ms": 1.0},
                                          {"op": "reduce_sum", "ms": 0.5}]}))
    profile.write_text(json.dumps({"ops": [{"op": "add", "ms_per_step": 3.0},
                                           {"op": "dot", "ms_per_step": 2.2},
                                           {"op": "(no op_name)", "ms_per_step": 0.1}]}))
    code, _, err = _here(monkeypatch, capsys, "ops_compare.py", str(census), str(profile),
                         "--json", str(out))
    assert code == 0, err
    got = json.loads(out.read_text())
    assert (got["estimated_ms"], got["measured_ms"]) == (3.5, 5.3)
    assert got["rows"] == [
        {"op": "add", "estimated_ms": 1.0, "measured_ms": 3.0, "ratio": 3.0},
        {"op": "dot", "estimated_ms": 2.0, "measured_ms": 2.2, "ratio": 1.1},
        {"op": "(no op_name)", "estimated_ms": 0.0, "measured_ms": 0.1, "ratio": None},
        {"op": "reduce_sum", "estimated_ms": 0.5, "measured_ms": 0.0, "ratio": None}]
    census.write_text("{}")
    code, _, err = _here(monkeypatch, capsys, "ops_compare.py", str(census), str(profile))
    assert code == 2
    (line,) = err.strip().splitlines()
    assert "has no ops" in line


def test_a_timed_sample_issues_its_calls_back_to_back(monkeypatch):
    """report.median_seconds: a sample is `calls` calls waited for once (the wait's round
    trip spread over them), after one warm-up sample; inputs made fresh for each call (a
    donating f) are one call a sample."""
    import jax.numpy as jnp

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from report import median_seconds

    made, waits = [], []
    monkeypatch.setattr("jax.block_until_ready", lambda x: waits.append(x) or x)
    assert median_seconds(lambda: made.append(1) or jnp.ones(2), repeat=3, calls=4) >= 0
    assert (len(made), len(waits)) == (4 + 3 * 4, 1 + 3)
    with pytest.raises(ValueError, match="one call a sample"):
        median_seconds(lambda x: x, 3, fresh=lambda: jnp.ones(2), calls=2)


def test_suite_times_sums_what_each_test_spent_compiling(tmp_path):
    """`pytest --compile-times DIR` records a test's wall time and the seconds JAX traced,
    lowered and compiled its jitted functions; suite_times.py sums them, and refuses a
    directory without them in one line."""
    test = "tests/test_residuals.py::test_norms_keep_only_per_token_statistics_and_match_autodiff"
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test,
                          "--compile-times", str(tmp_path / "t")], cwd=ROOT,
                         env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:]
    subprocess.run([sys.executable, "benchmarks/suite_times.py", str(tmp_path / "t"), "--json",
                    str(tmp_path / "s.json")], cwd=ROOT, capture_output=True, check=True)
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["tests"] == 1 and list(summary["tests_longest"]) == [test]
    row = summary["tests_longest"][test]
    assert 0 < row["jax_compile_s"] < row["wall_s"]
    assert summary["total"] == row and set(summary["by_stage_s"]) == {"trace", "lower", "compile"}
    assert any(k.startswith("compile jit(") for k in summary["functions"])
    refused = subprocess.run([sys.executable, "benchmarks/suite_times.py", str(tmp_path / "no")],
                             cwd=ROOT, capture_output=True, text=True)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert "--compile-times" in refused.stderr
