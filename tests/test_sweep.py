"""plait sweep: the enumeration is exact, extrapolated bytes equal a full compile,
--mesh auto trains the top row, outputs are written, errors are one line."""

import csv
import json
import re
from pathlib import Path

import pytest
from helpers import AS_TRAINED, make_mesh, write_experiment
from helpers import tiny as _tiny

from plait import analysis, hlo, sweep
from plait.errors import UserError
from plait.hardware import load_hardware
from plait.tasks.gpt import GPTTask as Job


def tiny(**sections):
    """helpers.tiny with two layers, as these tests' pipeline shapes (a layer per stage)
    and worked counts expect; a test that needs no pipeline asks for one."""
    return _tiny(**{**sections, "model": {"layers": 2, **sections.get("model", {})}})


def _expected_shapes_for_tiny_on_8() -> set[tuple]:
    """Worked out by hand for tiny(): 2 layers, d_model 64, 8 heads, d_ff 128, batch 16.
    Every data x fsdp x tensor split divides it; 2-D (q=2) leaves 2 devices to data or
    fsdp; 2.5-D and 3-D use all 8; a pipeline of 2 (2 layers) leaves 4 to data x fsdp x
    tensor, with gpipe / 1f1b / zb-h1 / chimera and N in {2, 4, 8} where the 16 rows
    split into N microbatches over data x fsdp (interleaved needs 4 layers; 4 or 8
    stages need more layers)."""
    out = set()
    for d, f, t in [(8, 1, 1), (4, 2, 1), (4, 1, 2), (2, 4, 1), (2, 2, 2), (2, 1, 4),
                    (1, 8, 1), (1, 4, 2), (1, 2, 4), (1, 1, 8)]:
        out.add((f"data={d},fsdp={f},tensor={t}", None, None))
    out |= {("data=2,tensor_row=2,tensor_col=2", None, None),
            ("fsdp=2,tensor_row=2,tensor_col=2", None, None),
            ("tensor_depth=2,tensor_row=2,tensor_col=2", None, None),
            ("tensor_x=2,tensor_y=2,tensor_z=2", None, None)}
    for d, f, t in [(4, 1, 1), (2, 2, 1), (2, 1, 2), (1, 4, 1), (1, 2, 2), (1, 1, 4)]:
        for s in ("gpipe", "1f1b", "zb-h1", "chimera"):
            for n in (2, 4, 8):
                if 16 % (n * d * f) == 0:
                    out.add((f"data={d},pipeline=2,fsdp={f},tensor={t}", s, n))
    for s in ("gpipe", "1f1b", "zb-h1", "chimera"):  # the pipeline nests a 2-D grid too
        for n in (2, 4, 8):
            out.add(("pipeline=2,tensor_row=2,tensor_col=2", s, n))
    return out


def _normal(mesh: str) -> str:
    from plait import mesh as M

    return M.inline(M.resolve(M.load_spec(mesh), 8))


def test_enumeration_is_complete_and_exact():
    cands, _ = sweep.enumerate_shapes(tiny(), 8)
    got = [(c.mesh, c.pipeline.get("schedule"), c.pipeline.get("microbatches")) for c in cands]
    assert len(got) == len(set(got))  # every shape once
    want = {(_normal(m), s, n) for m, s, n in _expected_shapes_for_tiny_on_8()}
    assert set(got) == want


def test_no_valid_shape_says_why():
    """The model's reasons; not those of sizes that are no mesh at all (a 3-D tensor
    'cube' of 1 x 1 x 3 filled two of the three reasons given)."""
    with pytest.raises(UserError, match=r"no mesh shape of 3 devices fits .*heads = 8") as e:
        sweep.run_sweep(tiny(model={"layers": 2}), 3, load_hardware("cpu-2core"),
                        progress=False)
    assert "cube" not in str(e.value) and "global_batch = 16 does not split" in str(e.value)


def test_unknown_hardware_is_one_line():
    with pytest.raises(UserError, match=r"unknown hardware 'h900'; known: .*h100-node"):
        load_hardware("h900")


@pytest.mark.parametrize("was,now,needle", [
    ("memory_bytes = 85899345920", "memory_bytes = 0",  # ZeroDivisionError in the pricing
     "memory_bytes = 0: input should be greater than 0"),
    ("intra_node_bandwidth = 450e9", "intra_node_bandwidth = 0",  # ZeroDivisionError
     "intra_node_bandwidth = 0: input should be greater than 0"),
    ("memory_bytes = 85899345920", 'memory_bytes = "80GB"',  # TypeError
     "memory_bytes = '80GB': input should be a valid number"),
    ("peak_fp32_flops = 494.7e12", "peak_fp32_flops = -1.0",  # ranked on nonsense
     "peak_fp32_flops = -1.0: input should be greater than 0"),
    ("efficiency = 0.55", "efficiency = nan", "efficiency = nan: input should be a finite"),
    ("devices_per_node = 8", "devices_per_node = 2.5",
     "devices_per_node = 2.5: input should be a valid integer"),
])
def test_a_hardware_file_of_wrong_values_is_one_line(tmp_path, was, now, needle):
    from helpers import ROOT

    text = (ROOT / "meshes" / "h100-node.toml").read_text()
    assert was in text
    path = tmp_path / "mine.toml"
    path.write_text(text.replace(was, now))
    with pytest.raises(UserError, match=f"hardware '{path}': {re.escape(needle)}"):
        load_hardware(str(path))


def test_hardware_auto_is_the_description_closest_to_the_device(monkeypatch):
    """--hardware auto: an H200 is priced as an H200 (its memory and bandwidth, the H100's
    tensor cores), an H100 as an H100, this CPU as the 2-core CPU."""
    import jax
    from helpers import FakeGPU

    from plait.hardware import for_device

    assert load_hardware("auto").name == "cpu-2core"
    h100, h200 = load_hardware("h100-node"), load_hardware("h200-node")
    assert (h200.peak_bf16_flops, h200.memory_bandwidth) == (h100.peak_bf16_flops, 4.8e12)
    assert h200.memory_bytes == 143_771 * 2**20 > h100.memory_bytes
    for kind, name in (("NVIDIA H200", "h200-sxm-node"),
                       ("NVIDIA H100 80GB HBM3", "h100-sxm-node")):
        monkeypatch.setattr(jax, "devices", lambda kind=kind: [FakeGPU(kind)])
        assert load_hardware("auto").name == name
    assert for_device("NVIDIA H200") == "h200-node"


def test_extrapolated_bytes_and_flops_equal_a_full_compile():
    """...of the program plait train runs: the sweep compiles with XLA:CPU's legacy
    emitters (faster) and counts no kernels, which that program has other numbers of."""
    exp = tiny(model={"layers": 8, "scan_layers": True})  # compiled at 2 and 4 layers
    cand = sweep.Candidate({"data": 2, "fsdp": 2, "tensor": 2})
    measured = sweep.measure(exp, cand, 8)
    assert measured["kernels"] is None
    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    full = analysis.analyze(Job(exp, mesh).compile(AS_TRAINED), dict(mesh.shape))
    assert measured["flops"] == pytest.approx(full["flops_per_device"], rel=1e-9)
    total = sum(b for _, b in measured["groups"].values())
    # Exact but for XLA packing the small scalar all-reduces (metrics, norms)
    # differently at each depth: 780 of 1.4 M bytes here.
    assert total == pytest.approx(sum(full["collectives_wire"].values()), rel=1e-3)
    row = sweep.predict(exp, cand, measured, load_hardware("cpu-2core"), 8)
    assert row["collective_bytes"] == pytest.approx(total)
    m = full["memory"]
    args = m["argument_bytes"] + m["output_bytes"] - m["alias_bytes"]
    assert args <= measured["memory"] <= m["total_bytes"] * 1.5


def test_a_pipelines_microbatch_counts_are_priced_from_the_fewest_and_the_most():
    """More microbatches run the executor's loop for more ticks over smaller microbatches:
    the kernels and collectives grow, the activations shrink. The sweep compiles each
    mesh and schedule at its fewest and most microbatches and interpolates the others;
    the middle one matches a compile of its own (before, every count was priced from the
    fewest's compile: N = 8's memory as N = 2's)."""
    from plait.sweep import cost
    from plait.sweep.run import programs_of

    exp = tiny()
    hw = load_hardware("cpu-2core")
    group = [sweep.Candidate({"pipeline": 2}, {"pipeline.schedule": "1f1b",
                                               "pipeline.microbatches": N,
                                               "pipeline.virtual_stages": 1})
             for N in (2, 4, 8)]
    groups, programs = programs_of(exp, 2, ("1f1b",))
    assert [c.microbatches for g in groups for c in g if c.pipeline] == [2, 4, 8]
    assert sorted(p[0].microbatches for p in programs.values() if p[0].pipeline) == [2, 8]
    exact = {c.microbatches: sweep.measure(exp, c, 2, kernels=True) for c in group}
    rows = cost.predict_group(exp, group, {2: exact[2], 8: exact[8]}, hw, 2)
    [own] = cost.predict_group(exp, group[1:2], {4: exact[4]}, hw, 2)
    assert rows[1]["kernels"] == pytest.approx(own["kernels"], rel=1e-3)
    assert rows[1]["memory_bytes"] == pytest.approx(own["memory_bytes"], rel=5e-3)
    assert rows[1]["collective_bytes"] == pytest.approx(own["collective_bytes"], rel=1e-3)
    assert rows[1]["comm_s"] == pytest.approx(own["comm_s"], rel=1e-3)
    assert rows[2]["kernels"] > 1.5 * rows[0]["kernels"]
    assert rows[2]["memory_bytes"] < 0.6 * rows[0]["memory_bytes"]


def test_sweep_command_writes_ranked_outputs_and_mesh_auto_trains_the_top_row(
        tmp_path, capsys, monkeypatch):
    from plait.cli import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    exp = tiny(train={"steps": 3, "global_batch": 2})  # pipeline variants of 2 microbatches
    path = write_experiment(tmp_path / "tiny.toml", exp)
    out = tmp_path / "sw"
    # --schedules: one pipeline program (of five) to compile.
    assert main(["sweep", str(path), "--devices", "2", "--out", str(out), "--top", "2",
                 "--run", "--schedules", "1f1b,"]) == 0
    rows = list(csv.DictReader((out / "sweep.csv").read_text().splitlines()))
    # --run trained the top two shapes here and put their step times beside the prediction,
    # then fitted the overheads to them and re-ranked every row with them added.
    assert sum(r["measured_step_s"] != "" for r in rows) == 2
    assert all(float(r["measured_step_s"]) > 0 for r in rows if r["measured_step_s"])
    assert [int(r["rank"]) for r in rows] == list(range(1, len(rows) + 1))
    report = json.loads((out / "sweep.json").read_text())
    fit = report["calibration"]
    assert fit["measured_shapes"] == 2 and fit["per_step_s"] >= 0 and fit["per_kernel_s"] >= 0
    for r in report["rows"]:
        assert r["predicted_step_s"] == pytest.approx(
            r["model_step_s"] + fit["per_step_s"] + fit["per_kernel_s"] * r["kernels"]
            + (fit["per_pipelined_step_s"] if r.get("pipeline_schedule") else 0.0))
    assert "overheads fitted to the 2 measured shapes" in capsys.readouterr().out
    meshes = {r["mesh"] for r in rows}
    assert meshes == {"data=2", "fsdp=2", "tensor=2", "pipeline=2"}
    assert {r["pipeline_schedule"] for r in rows if r["mesh"] == "pipeline=2"} == {"1f1b"}
    times = [float(r["predicted_step_s"]) for r in rows if r["fits"] == "True"]
    assert times == sorted(times)
    assert report["rows"][0]["mesh"] == rows[0]["mesh"]
    assert (out / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    # --mesh auto sweeps the devices at hand (a one-layer model: no pipeline shapes, three
    # programs to compile, one each) and ranks without measuring: by the model's own time.
    one = write_experiment(tmp_path / "one.toml", tiny(model={"layers": 1},
                                                       train={"steps": 3, "global_batch": 4}))
    from plait import sweep

    pools = []
    real_sweep = sweep.run_sweep

    def spy(*args, **kw):
        pools.append(kw.get("workers"))
        return real_sweep(*args, **kw)

    monkeypatch.setattr(sweep, "run_sweep", spy)
    assert main(["train", str(one), "--mesh", "auto", "--devices", "2",
                 "--run-dir", str(tmp_path / "run")]) == 0
    # On CPUs in one process it compiles in worker processes as `plait sweep` does, when
    # there are enough programs to pay for them (None: the sweep's default; three: none).
    assert pools == [None]
    said = capsys.readouterr().out
    assert "--mesh auto: compiling the 2-device mesh shapes to rank them" in said
    [cached] = (tmp_path / "cache" / "plait" / "mesh-auto").glob("*.json")
    ranked = json.loads(cached.read_text())
    assert {r["mesh"] for r in ranked} == {"data=2", "fsdp=2", "tensor=2"}
    best = min((r for r in ranked if r["fits"]), key=lambda r: (r["model_step_s"], r["mesh"]))
    assert f"--mesh auto chose {best['mesh']}" in said
    # The ranking is cached: a second run starts at once with the same choice.
    assert main(["train", str(one), "--mesh", "auto", "--devices", "2",
                 "--run-dir", str(tmp_path / "again")]) == 0
    said = capsys.readouterr().out
    assert "--mesh auto: the ranking of 2-device shapes" in said and str(cached) in said \
        and f"--mesh auto chose {best['mesh']}" in said
    from plait import mesh as M
    from plait.toml_files import read_toml

    resolved = read_toml(tmp_path / "run" / "config.toml", "run config")["mesh"]
    assert M.inline(resolved) == best["mesh"]


def test_vary_tries_settings_on_every_shape_each_from_its_own_compile(tmp_path, capsys):
    """On one device the mesh has one shape; --vary crosses it with remat and gradient
    accumulation, each combination its own program (full remat recomputes the forward:
    more FLOPs; two microbatches: the same work), the top two trained by --run with
    their settings (each in a process of its own), and shown by them in the table and
    the CSV."""
    from plait.cli import main

    exp = tiny(train={"global_batch": 4})
    path = write_experiment(tmp_path / "tiny.toml", exp)
    out = tmp_path / "sw"
    assert main(["sweep", str(path), "--devices", "1", "--out", str(out), "--vary",
                 "model.remat=none,full", "--vary", "train.microbatches=1,2", "--run",
                 "--run-steps", "3", "--top", "2"]) == 0
    said = capsys.readouterr()
    report = json.loads((out / "sweep.json").read_text())
    rows = {(r["varied"]["model.remat"], r["varied"]["train.microbatches"]): r
            for r in report["rows"]}
    assert set(rows) == {("none", 1), ("none", 2), ("full", 1), ("full", 2)}
    for mb in (1, 2):
        assert rows["full", mb]["flops_per_device"] > 1.2 * rows["none", mb]["flops_per_device"]
    assert rows["none", 2]["flops_per_device"] == pytest.approx(
        rows["none", 1]["flops_per_device"], rel=0.02)
    measured = [r for r in rows.values() if r.get("measured_step_s") is not None]
    assert len(measured) == 2 and all(r["measured_step_s"] > 0 for r in measured)
    assert len((out / sweep.RUNS).read_text().splitlines()) == 2
    trained = sweep.candidate_of(rows["full", 2], 1).experiment(exp)
    assert (trained.model.remat, trained.train.microbatches) == ("full", 2)
    assert all(f"model.remat={a} train.microbatches={b}" in said.out  # table, calibration
               for (a, b), r in rows.items() if r.get("measured_step_s") is not None)
    assert "plait sweep: compiled 4/4 " in said.err  # one program per combination
    csv_rows = list(csv.DictReader((out / "sweep.csv").read_text().splitlines()))
    assert {r["varied"] for r in csv_rows} == {
        f"model.remat={a} train.microbatches={b}" for a, b in rows}
    # A pipeline takes its microbatches from pipeline.microbatches: on two devices its
    # shapes come with train.microbatches = 1 only.
    cands, _ = sweep.enumerate_shapes(exp, 2, [{"train.microbatches": 1},
                                               {"train.microbatches": 2}])
    piped = {c.settings["train.microbatches"] for c in cands if c.pipeline}
    assert piped == {1} and {c.settings["train.microbatches"] for c in cands} == {1, 2}
    # A pipeline's own setting is tried on pipeline shapes only; the others once each.
    cands, _ = sweep.enumerate_shapes(exp, 2, [{"pipeline.recompute": False},
                                               {"pipeline.recompute": True}])
    assert sorted(c.label for c in cands if not c.pipeline) == ["data=2", "fsdp=2", "tensor=2"]
    assert {c.settings["pipeline.recompute"] for c in cands if c.pipeline} == {False, True}
    assert all(set(c.pipeline) == {"schedule", "microbatches", "virtual_stages"}
               for c in cands if c.pipeline)


def test_more_devices_than_can_be_simulated_is_one_line(tmp_path, capsys):
    from plait.cli import main

    path = write_experiment(tmp_path / "tiny.toml", tiny())
    assert main(["sweep", str(path), "--devices", "4096"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "more than plait simulates on one CPU" in err
    assert main(["sweep", str(path), "--devices", "2", "--schedules", "1f1b,zb"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "unknown pipeline schedule 'zb'; choose one of gpipe, 1f1b" in err
    for flags, said in [(["--top", "-3"], "--top must be at least 1, got -3"),
                        (["--run", "--run-steps", "1"], "--run-steps must be at least 2"),
                        (["--run", "--run-rounds", "0"], "--run-rounds must be at least 1"),
                        (["--run-steps", "4"], "--run-steps says how --run measures; add "
                         "--run"),
                        (["--run-rounds", "2"], "--run-rounds says how --run measures"),
                        (["--vary", "model.remat"], "--vary expects KEY=V1,V2,..."),
                        (["--vary", "model.remat=none,fulll"], "--vary model.remat"),
                        (["--vary", "model.remta=none"], "--vary model.remta"),
                        (["--vary", "pipeline.microbatches=2,4"],
                         "--vary pipeline.microbatches: the sweep tries each pipeline"),
                        (["--vary", "model.remat=full", "--vary", "model.remat=none"],
                         "--vary model.remat is given twice")]:
        assert main(["sweep", str(path), "--devices", "2", *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and said in err, err


def test_dlrm_sweep_ranks_meshes_and_embedding_placements(capsys):
    from plait.config_files import load_experiment
    from plait.parallel.embedding import PLACEMENTS
    from plait.tasks.dlrm import DLRMTask

    exp = load_experiment(Path(__file__).resolve().parents[1] / "experiments" /
                          "dlrm-tiny.toml")
    cands, _ = sweep.enumerate_shapes(exp, 2)
    # The batch axes of 2 devices x the five placements (dim 16 splits over 2 columns).
    assert sorted((c.mesh, c.settings["embedding.sharding"]) for c in cands) == sorted(
        (m, k) for m in ("data=2", "fsdp=2") for k in ("auto", *PLACEMENTS))
    hw = load_hardware("h100-node")
    rows = sweep.run_sweep(exp, 2, hw, progress=False, workers=1)
    assert len(rows) == 10 and [r["rank"] for r in rows] == list(range(1, 11))
    by = {(r["mesh"], r["embedding_sharding"]): r for r in rows}
    assert by[("data=2", "replicated")]["embedding_kinds"] == "/".join(["replicated"] * 4)
    assert by[("data=2", "row")]["embedding_kinds"] == "/".join(["row"] * 4)
    # Rows price what their compiled step moves: the table-wise step's collectives
    # are the ones plait inspect reads, and the row round-trips to the same shape.
    c = sweep.candidate_of(by[("data=2", "table")], 2)
    assert c.settings == {"embedding.sharding": "table"}
    job = DLRMTask(c.experiment(exp), make_mesh("data=2"))
    compiled = analysis.analyze(job.compile(), {"data": 2})
    wire = sum(op["wire_bytes"] for op in compiled["collective_ops"])
    assert wire > 0  # the all-to-alls of the bags and the all-gather of the ids
    assert by[("data=2", "table")]["collective_bytes"] == pytest.approx(wire, rel=1e-9)
    assert all(r["memory_traffic_s"] > 0 for r in rows)
    # The table names the placements' column for what it holds.
    from plait.views.sweep import render
    render(rows, {"experiment": exp.name, "devices": 2, "hardware": "h100-node", "sweep_s": 1})
    out = capsys.readouterr().out
    assert "tables" in out and "table/table/table/table" in out and "pipeline" not in out


def test_kernel_count_counts_loops_and_not_fusion_bodies():
    import jax
    import jax.numpy as jnp

    def body(i, x):
        return jnp.sin(x) @ x + i

    def kernels(trips: int) -> float:
        fn = jax.jit(lambda x: jax.lax.fori_loop(0, trips, body, x))
        return analysis.kernel_count(hlo.parse_hlo(
            fn.lower(jnp.ones((8, 8))).compile().as_text()))

    once = analysis.kernel_count(hlo.parse_hlo(
        jax.jit(lambda x: body(0, x)).lower(jnp.ones((8, 8))).compile().as_text()))
    k10, k20, k30 = kernels(10), kernels(20), kernels(30)
    # Each iteration launches the same kernels (its body's and its condition's), and at
    # least the body's own: the count is linear in the trip count.
    assert k20 - k10 == k30 - k20 >= 10 * once >= 10


def test_calibration_fits_per_step_and_per_kernel_overheads_and_reranks():
    def row(mesh, model, kernels, measured=None):
        r = {"mesh": mesh, "fits": True, "model_step_s": model, "predicted_step_s": model,
             "units_per_step": 1000, "predicted_units_per_s": 1000 / model, "kernels": kernels}
        if measured is not None:
            r["measured_step_s"] = measured
        return r

    truth = lambda model, k: model + 0.004 + 2e-5 * k  # noqa: E731
    rows = [row("a", 0.001, 100, truth(0.001, 100)), row("b", 0.002, 900, truth(0.002, 900)),
            row("c", 0.0015, 400, truth(0.0015, 400)), row("d", 0.0012, 2000)]
    fit = sweep.calibrate(rows)
    assert fit["per_step_s"] == pytest.approx(0.004) and fit["per_kernel_s"] == pytest.approx(2e-5)
    for r in rows[:3]:
        assert r["predicted_step_s"] == pytest.approx(r["measured_step_s"])
    # Fitting again (more measured) replaces the overheads; it does not add to them.
    assert sweep.calibrate(rows) == fit
    assert rows[0]["predicted_units_per_s"] == pytest.approx(1000 / rows[0]["measured_step_s"])
    # d had the fastest model time; its 2000 kernels make it the slowest once calibrated.
    ranked = sweep.rank(rows)
    assert ranked[-1]["mesh"] == "d" and ranked[0]["mesh"] == "a"
    # Overheads never come out negative; nothing measured: no fit.
    noisy = [row("a", 0.001, 100, 0.0009), row("b", 0.002, 900, 0.0021)]
    fit = sweep.calibrate(noisy)
    assert fit["per_step_s"] >= 0 and fit["per_kernel_s"] >= 0
    assert sweep.calibrate([row("a", 0.001, 100)]) is None
    # A pipeline's executor costs more per step than its kernels: a third overhead, fitted
    # when pipelined and other shapes were both measured.
    piped = lambda model, k: truth(model, k) + 0.02  # noqa: E731
    rows = [row("a", 0.001, 100, truth(0.001, 100)), row("b", 0.002, 900, truth(0.002, 900)),
            row("p", 0.003, 1500, piped(0.003, 1500)), row("q", 0.004, 3000, piped(0.004, 3000)),
            row("r", 0.003, 2000)]
    for r in rows[2:]:
        r["pipeline_schedule"] = "1f1b"
    fit = sweep.calibrate(rows)
    assert fit["per_step_s"] == pytest.approx(0.004) and fit["per_kernel_s"] == pytest.approx(2e-5)
    assert fit["per_pipelined_step_s"] == pytest.approx(0.02)
    assert rows[-1]["predicted_step_s"] == pytest.approx(piped(0.003, 2000))
    # Too few of either kind measured: none added.
    assert sweep.calibrate(rows[:2])["per_pipelined_step_s"] == 0.0
    assert sweep.calibrate(rows[:3])["per_pipelined_step_s"] == 0.0


def test_the_calibration_lines_tell_one_mesh_under_two_schedules_apart(capsys):
    """--run lists each measured shape with its rank and schedule: one mesh runs under
    several (rows 14 and 15 of llama-tiny's sweep were both 'data=4,pipeline=2')."""
    from plait.views.sweep import render_calibration

    rows = [{"rank": i + 1, "mesh": "data=4,pipeline=2", "pipeline_schedule": s,
             "pipeline_microbatches": n, "model_step_s": 0.005, "predicted_step_s": 0.045,
             "measured_step_s": m, "kernels": 911}
            for i, (s, n, m) in enumerate([("chimera", 2, 0.051), ("chimera", 4, 0.057),
                                           ("zb-h1", 4, 0.069)])]
    rows.append({"rank": 4, "mesh": "data=8", "model_step_s": 0.004, "kernels": 417,
                 "predicted_step_s": 0.0225})  # not measured: not listed
    render_calibration(rows, {"measured_shapes": 3, "per_step_s": 0.0, "per_kernel_s": 4.4e-5})
    lines = capsys.readouterr().out.splitlines()
    assert "overheads fitted to the 3 measured shapes" in lines[0] and len(lines) == 4
    assert [line.split()[:3] for line in lines[1:]] == [
        ["1", "data=4,pipeline=2", "chimera"], ["2", "data=4,pipeline=2", "chimera"],
        ["3", "data=4,pipeline=2", "zb-h1"]]
    assert "N=2" in lines[1] and "N=4" in lines[2] and "measured   69.000 ms" in lines[3]


def test_a_shape_that_does_not_run_is_said_and_ranked_after_those_that_do(capsys):
    """--run trains each top shape; one that fails (here a batch too big for the host once
    compiled, refused by plait train's check) is said in a line and ranked after the
    shapes that ran, instead of ending the sweep with the others unmeasured."""
    exp = tiny(model={"layers": 1})
    rows = [{"rank": 1, "mesh": "data=2", "settings": {"train.global_batch": 2**19},
             "fits": True, "predicted_step_s": 0.01},
            {"rank": 2, "mesh": "fsdp=2", "settings": {}, "fits": True,
             "predicted_step_s": 0.02}]
    sweep.measure_runs(exp, rows, 2, steps=3)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[0].startswith("plait sweep: rank 1 (data=2 524288) did not "
                                               "run: the compiled train step needs"), err
    assert err[1].startswith("plait sweep: trained 2/2 rank 2 (fsdp=2): ") and \
        err[1].endswith(" ms a step"), err  # off a terminal, a line a shape
    assert rows[0]["measured_step_s"] is None and "GiB per device" in rows[0]["measured_error"]
    assert rows[1]["measured_step_s"] > 0 and "measured_error" not in rows[1]
    assert [r["mesh"] for r in sweep.rank(rows)] == ["fsdp=2", "data=2"]


def test_the_sweep_lays_shapes_over_nodes_and_prices_the_links_they_cross():
    """On a hardware of 4 devices a node, data=8 is 2 nodes x 4: the step compiles with
    the hierarchical reduction, its reduce-scatter and all-gather stay in a node, and
    only the all-reduce of a quarter of the gradients (and the loss) crosses nodes."""
    from dataclasses import replace

    exp = tiny()
    cand = sweep.Candidate({"data": 8})
    measured = sweep.measure(exp, cand, 8, per_node=4)
    crossing = {(k[0], k[2]) for k in measured["groups"] if k[3]}
    staying = {(k[0], k[2]) for k in measured["groups"] if not k[3]}
    assert crossing == {("all-reduce", 2), ("all-reduce", 8)}
    assert staying == {("reduce-scatter", 4), ("all-gather", 4)}
    hw = replace(load_hardware("h100-4node"), devices_per_node=4)
    row = sweep.predict(exp, cand, measured, hw, 8)
    assert 0 < row["comm_across_nodes_s"] < row["comm_s"]
    assert row["collective_bytes_across_nodes"] < row["collective_bytes"] / 4


def test_a_program_whose_compile_kills_its_process_is_left_out_and_the_rest_go_on():
    """An XLA check failure aborts the compiling process and breaks the whole pool; the
    sweep finds which program it was and compiles the others (no compiler here: stand-ins
    in tests/sweep_abort.py)."""
    import sweep_abort as sa

    from plait.sweep.run import _compile_all

    meshes = ["data=2", "fsdp=2", sa.ABORTS, "data=4", "fsdp=4", "expert=2", "context=2"]
    got = {prog[0].mesh: figures for prog, figures, _ in _compile_all(
        None, 2, [[sa.Shape(m)] for m in meshes], 2, False, measure=sa.measure,
        init=sa.init)}
    assert got == {m: None if m == sa.ABORTS else {"mesh": m} for m in meshes}


def test_each_run_trains_in_a_process_of_its_own_set_up_like_this_one(monkeypatch):
    """--run trains each shape in a fresh process, as `plait train` runs: it has this
    process's devices and compile cache, plait's quiet logging, and the allocator setting
    the user gave (this process keeps none of an accelerator's memory up front); a
    process killed (by the out-of-memory killer, say) or raising is one line."""
    import os
    import signal

    import jax
    import sweep_abort as sa

    from plait.sweep import isolated

    # as leave_device_memory leaves it for a user who set no XLA_PYTHON_CLIENT_PREALLOCATE
    monkeypatch.setitem(isolated._THEIR_ENV, isolated.PREALLOCATE, None)
    monkeypatch.setenv(isolated.PREALLOCATE, "false")
    seen = isolated.call(sa.sees, devices=2)
    assert seen == {"pid": seen["pid"], "devices": jax.device_count(),
                    "cache": jax.config.jax_compilation_cache_dir, "preallocate": "unset",
                    "quiet": True}
    assert seen["pid"] != os.getpid()
    with pytest.raises(isolated.ProcessDied, match=r"^its process was killed by SIGKILL "
                       r"\(the system's out-of-memory killer, if memory ran out\)$"):
        isolated.call(signal.raise_signal, signal.SIGKILL, devices=2)
    with pytest.raises(isolated.ProcessRaised,
                       match=r"^ValueError: invalid literal for int\(\) with base 10: 'x'$"):
        isolated.call(int, "x", devices=2)


def test_a_pool_found_broken_when_submitting_hands_back_what_did_not_run():
    """The race seen in CI: a process dies after the last wait and before the next
    submit, which then raises BrokenProcessPool itself. The program not submitted goes
    back on the queue for the next pool, what was in flight ends first and is yielded
    (or handed back if it failed with the pool), nothing is raised."""
    from concurrent.futures.process import BrokenProcessPool

    import sweep_abort as sa

    from plait.sweep.run import _run_pool

    calls = []

    def submit(pool, prog):
        calls.append(prog[0].mesh)
        if len(calls) == 2:
            raise BrokenProcessPool("a process died")
        return pool.submit(sa.measure, None, prog[0], 2, None, False)

    queue = [[sa.Shape(m)] for m in ("fsdp=2", "data=4", "data=2")]  # popped from the end
    gen = _run_pool(queue, 2, submit, sa.init, 2)
    yielded = []
    try:
        while True:
            yielded.append(next(gen))
    except StopIteration as stop:
        lost = stop.value
    assert [(p[0].mesh, f) for p, f, _ in yielded] == [("data=2", {"mesh": "data=2"})]
    assert lost == [] and [p[0].mesh for p in queue] == ["fsdp=2", "data=4"]


def test_a_sweep_cut_short_resumes_from_its_journal(tmp_path, monkeypatch, capsys):
    """Each program's figures are journaled as read; a rerun reads back what the file
    holds for the same sweep (a line a kill cut short is skipped) and ranks exactly what
    an uninterrupted sweep ranks; another experiment compiles everything again."""
    from plait.sweep import compiled

    exp = tiny(model={"layers": 1}, train={"global_batch": 4})  # 3 programs on 2 devices
    hw = load_hardware("cpu-2core")
    journal = tmp_path / "sw" / sweep.JOURNAL
    compiles: list[str] = []
    real = compiled.measure

    def counted(e, c, *args):
        compiles.append(c.mesh)
        return real(e, c, *args)

    monkeypatch.setattr(compiled, "measure", counted)

    def ranked(e=exp, fresh=False) -> list[dict]:
        rows = sweep.run_sweep(e, 2, hw, progress=False, workers=1, journal=journal,
                               fresh=fresh)
        return [{k: v for k, v in r.items() if k != "compile_s"} for r in rows]

    whole = ranked()
    assert sorted(compiles) == ["data=2", "fsdp=2", "tensor=2"]
    lines = journal.read_text().splitlines()
    assert len(lines) == 3
    journal.write_text(lines[0] + "\n" + lines[1][: len(lines[1]) // 2])  # killed mid-line
    compiles.clear()
    assert ranked() == whole
    assert len(compiles) == 2 and json.loads(lines[0])["label"] not in compiles
    assert "1 of 3 programs read from" in capsys.readouterr().err
    compiles.clear()
    assert ranked() == whole and compiles == []  # all three journaled now
    assert ranked(fresh=True) == whole and len(compiles) == 3
    compiles.clear()
    other = exp.model_copy(update={"model": exp.model.model_copy(update={"d_ff": 64})})
    ranked(other)
    assert len(compiles) == 3 and len(journal.read_text().splitlines()) == 3


def test_an_interrupted_sweep_says_what_it_kept(tmp_path, capsys, monkeypatch):
    """Ctrl-C during the compiles: one line naming the journal and how to resume."""
    from plait.cli import main

    def interrupted(*args, journal, **kwargs):
        journal.parent.mkdir(parents=True, exist_ok=True)  # made by the command
        journal.write_text("{}\n{}\n")
        raise KeyboardInterrupt

    monkeypatch.setattr(sweep, "run_sweep", interrupted)
    out = tmp_path / "sw"
    path = write_experiment(tmp_path / "tiny.toml", tiny())
    assert main(["sweep", str(path), "--devices", "2", "--out", str(out)]) == 130
    err = capsys.readouterr().err.strip()
    assert err == (f"plait: interrupted; 2 compiled programs are kept in {out / sweep.JOURNAL}; "
                   "the same command resumes from them")


def test_run_times_are_journaled_and_a_rerun_measures_only_new_shapes(tmp_path, monkeypatch,
                                                                       capsys):
    """--run appends each measured step time to runs.jsonl; a rerun (or one with more
    rows) reads back those it holds for the same experiment and steps and trains only the
    others; --fresh trains all; a shape that failed is tried again."""
    import plait.train.loop as loop

    here = sweep.run.train_one  # in this process: the training stand-in below reaches it
    exp = tiny(model={"layers": 1}, train={"global_batch": 4})
    journal = tmp_path / "sw" / sweep.RUNS

    def rows_of(*meshes: str) -> list[dict]:
        return [{"rank": i, "mesh": m, "settings": {}, "fits": True, "predicted_step_s": 0.01}
                for i, m in enumerate(meshes, 1)]

    first = rows_of("data=2", "fsdp=2")
    sweep.measure_runs(exp, first, 2, steps=3, journal=journal, train=here)  # really trained
    assert all(r["measured_step_s"] > 0 for r in first)
    assert len(journal.read_text().splitlines()) == 2
    trained: list[str] = []

    def fake(e, mesh, steps, **kw):
        trained.append(",".join(f"{k}={v}" for k, v in mesh.shape.items() if v > 1))
        if "tensor" in trained[-1] and len(trained) == 1:
            raise UserError("too big")
        return {"records": [{"step_time_s": 0.5}] * steps}

    monkeypatch.setattr(loop, "train_briefly", fake)
    again = rows_of("data=2", "fsdp=2", "tensor=2")
    sweep.measure_runs(exp, again, 2, steps=3, journal=journal, train=here)
    assert trained == ["tensor=2"] and again[2]["measured_error"] == "too big"
    assert [r["measured_step_s"] for r in again[:2]] == [r["measured_step_s"] for r in first]
    assert "2 of 3 step times read from" in capsys.readouterr().err
    sweep.measure_runs(exp, rows_of("data=2", "fsdp=2", "tensor=2"), 2, steps=3,
                       journal=journal, train=here)
    assert trained == ["tensor=2", "tensor=2"]  # the failed shape, tried again
    sweep.measure_runs(exp, rows_of("data=2", "tensor=2"), 2, steps=3, journal=journal,
                       train=here)
    assert len(trained) == 2  # every shape journaled now
    sweep.measure_runs(exp, rows_of("data=2"), 2, steps=4, journal=journal,
                       train=here)  # other steps
    sweep.measure_runs(exp, rows_of("fsdp=2"), 2, steps=3, journal=journal, fresh=True,
                       train=here)
    assert trained[2:] == ["data=2", "fsdp=2"]


def test_run_rounds_go_in_rank_order_and_back_and_a_rerun_adds_rounds(tmp_path, monkeypatch,
                                                                       capsys):
    """--run-rounds 2 trains the top shapes in rank order, then back: a machine that
    slows steadily over the run (here each training 1 ms slower than the one before)
    weighs on every shape alike in the median, where one round left it all on the last
    rank. Each round is journaled; a rerun with 3 rounds trains round 3 only; a shape
    that failed is not tried again in a later round."""
    import plait.train.loop as loop

    here = sweep.run.train_one  # in this process: the training stand-in below reaches it
    exp = tiny(model={"layers": 1})
    trained: list[tuple[str, float]] = []

    def drifting(e, mesh, steps, **kw):
        shape = ",".join(f"{k}={v}" for k, v in mesh.shape.items() if v > 1)
        if shape == "pipeline=2":
            raise UserError("too big")
        t = 0.010 + 0.001 * len(trained)
        trained.append((shape, t))
        return {"records": [{"step_time_s": t}] * steps}

    monkeypatch.setattr(loop, "train_briefly", drifting)

    def rows_of(*meshes: str) -> list[dict]:
        return [{"rank": i, "mesh": m, "settings": {}, "fits": True, "predicted_step_s": 0.01}
                for i, m in enumerate(meshes, 1)]

    once = rows_of("data=2", "fsdp=2", "tensor=2")
    sweep.measure_runs(exp, once, 2, steps=3, train=here)
    assert [r["measured_step_s"] for r in once] == pytest.approx([0.010, 0.011, 0.012])
    trained.clear()
    journal = tmp_path / sweep.RUNS
    rows = rows_of("data=2", "fsdp=2", "pipeline=2", "tensor=2")
    sweep.measure_runs(exp, rows, 2, steps=3, journal=journal, rounds=2, train=here)
    assert [s for s, _ in trained] == ["data=2", "fsdp=2", "tensor=2",
                                       "tensor=2", "fsdp=2", "data=2"]
    measured = [r["measured_step_s"] for r in rows]
    assert measured[0] == measured[1] == measured[3] == pytest.approx(0.0125)  # drift gone
    assert rows[1]["measured_rounds_s"] == pytest.approx([0.011, 0.014])
    assert measured[2] is None and rows[2]["measured_error"] == "too big"
    err = capsys.readouterr().err
    assert err.count("did not run: too big") == 1  # round 2 does not try it again
    # Counted without round 2's visit of the shape that failed in round 1.
    assert "trained 5/7 rank 4 (tensor=2) round 2: 13.0 ms a step" in err
    assert "trained 7/7 rank 1 (data=2) round 2: " in err
    assert len(journal.read_text().splitlines()) == 6

    rows = rows_of("data=2", "fsdp=2", "pipeline=2", "tensor=2")
    sweep.measure_runs(exp, rows, 2, steps=3, journal=journal, rounds=3, train=here)
    assert [s for s, _ in trained[6:]] == ["data=2", "fsdp=2", "tensor=2"]  # round 3 only
    assert rows[0]["measured_rounds_s"] == pytest.approx([0.010, 0.015, 0.016])
    assert rows[0]["measured_step_s"] == pytest.approx(0.015)
    assert "6 of 12 step times read from" in capsys.readouterr().err


def test_an_interrupted_run_says_what_it_kept(tmp_path, capsys, monkeypatch):
    """Ctrl-C while --run trains: one line naming both journals."""
    from plait.cli import main

    def measured_two(exp, rows, n, steps, *, journal, fresh, rounds):
        assert (steps, rounds) == (6, 1)
        journal.write_text("{}\n{}\n")
        raise KeyboardInterrupt

    monkeypatch.setattr(sweep, "run_sweep", lambda *a, **k: [
        {"rank": 1, "mesh": "data=2", "settings": {}, "fits": True, "predicted_step_s": 0.01}])
    monkeypatch.setattr(sweep, "measure_runs", measured_two)
    out = tmp_path / "sw"
    out.mkdir()
    path = write_experiment(tmp_path / "tiny.toml", tiny())
    assert main(["sweep", str(path), "--devices", "2", "--out", str(out), "--run"]) == 130
    err = capsys.readouterr().err.strip()
    assert err == (f"plait: interrupted; 2 measured step times are kept in {out / sweep.RUNS} "
                   f"(and the compiled programs in {out / sweep.JOURNAL}); the same command "
                   "resumes from them")


def test_mesh_auto_keys_its_cached_ranking_by_plaits_sources(monkeypatch):
    """A checkout that prices differently under the same version number sweeps again."""
    from plait.sweep import auto, journal

    exp = tiny()
    before = auto._cache_path(exp, 2, "cpu-2core")
    assert auto._cache_path(exp, 2, "cpu-2core") == before
    monkeypatch.setattr(journal, "sources_digest", lambda: "other sources")
    assert auto._cache_path(exp, 2, "cpu-2core") != before
