"""Pipeline parallelism: schedule tables equal the published formulas; every schedule
trains like the non-pipelined model (losses and gradients), alone and with data,
fsdp or tensor axes; checkpoints move between schedules and to no pipeline."""

import json

import jax
import numpy as np
import pytest
from helpers import losses, make_mesh, run, tiny

from plait import data, sharding
from plait.models.loss import cross_entropy
from plait.parallel import schedules
from plait.tasks.gpt import GPTTask as Job

SIZES = [(D, N) for D in (2, 4, 8) for N in (D, 2 * D, 4 * D)]


@pytest.mark.parametrize("D,N", SIZES)
def test_gpipe_and_1f1b_bubble(D, N):
    for name in ("gpipe", "1f1b"):
        f = schedules.build(name, D, N).figures
        assert f["bubble"] == pytest.approx((D - 1) / (N + D - 1))
    # 1F1B holds at most D - rank microbatches; GPipe holds all N.
    assert schedules.build("1f1b", D, N).figures["peak_inflight"] == list(range(D, 0, -1))
    assert schedules.build("gpipe", D, N).figures["peak_inflight"] == [N] * D


@pytest.mark.parametrize("D,N", SIZES)
@pytest.mark.parametrize("v", [2, 4])
def test_interleaved_bubble(D, N, v):
    f = schedules.build("interleaved", D, N, v).figures
    assert f["bubble_ratio"] == pytest.approx((D - 1) / (v * N))


@pytest.mark.parametrize("D,N", SIZES)
def test_chimera_bubble_and_memory(D, N):
    f = schedules.build("chimera", D, N).figures
    assert f["bubble"] == pytest.approx((D - 2) / (2 * N + D - 2))
    assert f["ticks"] == 2 * N + D - 2
    assert max(f["peak_inflight"]) <= D  # no rank above 1F1B's peak


@pytest.mark.parametrize("D,N", SIZES)
def test_zero_bubble_h1_idles_a_third_of_1f1b_holding_what_1f1b_holds(D, N):
    zb = schedules.build("zb-h1", D, N).figures
    one = schedules.build("1f1b", D, N).figures
    assert zb["idle_time"] * 3 == one["idle_time"] == 3 * (D - 1)
    # From forward to weight gradient, no rank holds more than 1F1B's peak (D), and a
    # split backward is the same work as a whole one.
    assert max(zb["peak_inflight"]) == max(one["peak_inflight"]) == D
    assert zb["work_per_rank"] == one["work_per_rank"] == [3 * N] * D


@pytest.mark.parametrize("D,N", [(D, N) for D, N in SIZES if N > D])
def test_chimera_units_concatenate_with_the_papers_memory(D, N):
    """N = kD: basic units whose starts fill the previous unit's tail; each rank holds
    what one unit holds (D/2 + 1 at the ends, D in the middle), ticks 2N + D - 2."""
    f = schedules.build("chimera", D, N).figures
    unit = schedules.build("chimera", D, D).figures
    assert f["peak_inflight"] == unit["peak_inflight"]
    assert all(D // 2 + 1 <= p <= D for p in f["peak_inflight"])
    assert f["peak_inflight"][0] == f["peak_inflight"][-1] == D // 2 + 1
    assert f["ticks"] == 2 * N + D - 2


def _check_table(s):
    seen = {}
    for t, row in enumerate(s.table):
        for r, a in enumerate(row):
            if a is None:
                continue
            assert a not in seen and s.rank_of(a.pipe, a.stage) == r
            assert all(seen.get(d, t) < t for d in s.deps(a)), (s.name, a)
            seen[a] = t
    kinds = 3 if s.kind.split_backward else 2  # each microbatch runs on one pipe
    assert len(seen) == kinds * s.num_stages * s.microbatches


def test_tables_respect_dependencies_and_run_each_action_once():
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
        _check_table(schedules.build(name, 4, 8, v))
    for D, N in SIZES:
        for name in ("chimera", "zb-h1"):
            _check_table(schedules.build(name, D, N))


def test_schedule_command_json_and_png(tmp_path, capsys):
    from plait.cli import main

    png = tmp_path / "c.png"
    assert main(["schedule", "chimera", "--stages", "4", "--microbatches", "4", "--json",
                 "--png", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bubble"] == pytest.approx(2 / 10) and out["ticks"] == 10
    assert len(out["peak_inflight"]) == 4
    assert png.read_bytes()[:4] == b"\x89PNG"
    # the format is the name's: an SVG; a suffix matplotlib does not write was its
    # ValueError's traceback
    assert main(["schedule", "1f1b", "--stages", "2", "--microbatches", "2", "--png",
                 str(tmp_path / "c.svg")]) == 0
    assert (tmp_path / "c.svg").read_text().lstrip().startswith("<?xml")
    capsys.readouterr()
    assert main(["schedule", "1f1b", "--stages", "2", "--microbatches", "2", "--png",
                 str(tmp_path / "c.txt")]) == 2
    assert "name it e.g. '" + str(tmp_path / "c.png") in capsys.readouterr().err
    assert out["executor"]["stash_slots_per_rank"] == out["peak_inflight"] == [3, 4, 4, 3]
    assert main(["schedule", "zb-h1", "--stages", "4", "--microbatches", "8", "--recompute",
                 "--json"]) == 0
    held = json.loads(capsys.readouterr().out)["executor"]
    # Recompute: stage inputs until Bx; W's inputs kept from Bx to W (rank r: r + 1).
    assert held["stash_slots_per_rank"] == [4, 3, 2, 1]
    assert held["keep_slots_per_rank"] == [1, 2, 3, 4]
    assert held["work_per_rank"] == [32] * 4  # 3N + a recomputed forward per microbatch
    assert main(["schedule", "1f1b", "--stages", "4", "--microbatches", "8"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("rank 0: F0") and "bubble 0.2727" in text
    assert "a .1 suffix = the second pipe" in text  # the notation is explained


def test_schedule_legend_names_every_mark():
    from plait.views.schedule import legend

    chimera = [label for label, _, _ in legend(schedules.build("chimera", 4, 4))]
    assert chimera[:2] == ["F: forward", "B: backward"]
    assert "second pipe (x.1 in the text)" in chimera and "number in a box: microbatch" in chimera
    zb = [label for label, _, _ in legend(schedules.build("zb-h1", 4, 4))]
    assert "W: backward, weight gradients" in zb and "second pipe (x.1 in the text)" not in zb
    small = legend(schedules.build("1f1b", 4, 4), numbered=False)
    assert small[-1][0] == "boxes too small to number: microbatches in the text table"


def test_a_long_schedule_is_drawn_within_the_charts_bounds(tmp_path):
    """Boxes shrink past MAX_INCHES and lose their numbers (64 stages x 512 microbatches
    had drawn a chart 370 inches wide: 167 s, 2.2 GB)."""
    from PIL import Image

    from plait.views.schedule import MAX_INCHES, draw

    s = schedules.build("1f1b", 4, 160)  # 326 ticks: 0.17 inch each, unnumbered
    draw(s, str(tmp_path / "long.png"))
    width, height = Image.open(tmp_path / "long.png").size
    assert 0.9 * MAX_INCHES[0] * 120 < width <= MAX_INCHES[0] * 120 and height < 600


def test_inspect_cuts_shapes_between_arrays():
    from plait.views.common import clip_shape

    many = "(" + ", ".join(["f32[16,1024,768]{2,1,0}"] * 4) + ")"
    assert clip_shape(many) == "(f32[16,1024,768]{2,1,0} ..."
    assert clip_shape("bf16[8,128]") == "bf16[8,128]"
    assert len(clip_shape(many, 60)) <= 60


# One layer per stage on pipeline=4 (and per virtual stage of interleaved on pipeline=2):
# the executor, the tables and the transfers are all there, at half the compile time of
# two layers per stage.
LAYERS = 4


def _pipe_exp(schedule: str, layers: int = LAYERS, model: dict | None = None, **pipeline):
    return tiny(model={"layers": layers, **(model or {})},
                pipeline={"schedule": schedule, **pipeline})


# Every schedule's gradients equal the unpipelined ones on pipeline=4 (below); these
# train each with another axis beside it (the plain pipeline=4 runs of gpipe, 1f1b and
# zb-h1 proved nothing those do not), 6 steps of the 12-step reference. 1F1B on
# tensor=2,pipeline=4: test_checkpoints_move_between_schedules_and_to_no_pipeline's
# first four steps.
@pytest.mark.parametrize("schedule,spec,extra", [
    ("gpipe", "data=2,pipeline=4", {}),
    ("interleaved", "data=2,pipeline=2", {"virtual_stages": 2, "microbatches": 4}),
    ("chimera", "pipeline=4", {"microbatches": 8}),
    ("chimera", "fsdp=2,pipeline=4", {}),
    # ZB-H1's split backward re-evaluates the layer's jaxpr: with a remat policy that
    # keeps named values (save_attention) inside it
    ("zb-h1", "tensor=2,pipeline=4", {"microbatches": 8, "model": {"remat": "save_attention"}}),
    ("zb-h1", "tensor_row=2,tensor_col=2,pipeline=2", {"microbatches": 4}),
    ("1f1b", "pipeline=2", {"recompute": True}),
])
def test_losses_equal_the_unpipelined_run(schedule, spec, extra, four_layer_reference, tmp_path):
    exp = _pipe_exp(schedule, **extra).model_copy(
        update={"train": tiny().train.model_copy(update={"steps": 6})})
    got = losses(run(exp, spec, tmp_path))
    assert len(got) == 6
    np.testing.assert_allclose(got, four_layer_reference[:6], rtol=1e-4)


def _grads(exp, spec):
    mesh = make_mesh(spec)
    job = Job(exp, mesh)
    state = job.init_state()
    dense = Job(exp, make_mesh("data=1"))
    tokens = np.asarray(data.global_batch(dense.source(), 0, dense.batch_shape,
                                          dense.batch_sharding))
    if job.pipeline is None:
        def loss(params, toks):
            with sharding.use(mesh, job.rules):
                return cross_entropy(job.model.apply(params, toks[0, :, :-1]), toks[0, :, 1:])
        g = jax.jit(jax.grad(loss))(state["params"], tokens)
    else:
        batch = jax.device_put(tokens.reshape(job.batch_shape), job.batch_sharding)

        def grads(params, batch):
            with sharding.use(mesh, job.rules):
                _, g = job.pipeline.loss_and_grads(params, batch, None)
            return job.pipeline.to_canonical(g)
        g = jax.jit(grads)(state["params"], batch)
    return jax.tree.map(np.asarray, g)


@pytest.mark.parametrize("schedule", schedules.SCHEDULES)
def test_gradients_equal_the_unpipelined_ones(schedule):
    """On pipeline=4; interleaved with two virtual stages each (8 layers, one a stage)."""
    exp = _pipe_exp(schedule, layers=8 if schedule == "interleaved" else LAYERS,
                    microbatches=4, **({"virtual_stages": 2} if schedule == "interleaved"
                                       else {}))
    dense = _grads(exp, "data=1")
    got = _grads(exp, "pipeline=4")
    for (path, d), g in zip(jax.tree_util.tree_leaves_with_path(dense), jax.tree.leaves(got),
                            strict=True):
        np.testing.assert_allclose(g, d, rtol=1e-4, atol=1e-5 * np.abs(d).max(),
                                   err_msg=jax.tree_util.keystr(path))


def test_checkpoints_move_between_schedules_and_to_no_pipeline(four_layer_reference, tmp_path):
    """1F1B on tensor=2,pipeline=4 (8 microbatches; equal to the reference from its
    first step), Chimera on data=2,pipeline=2, no pipeline on data=2,tensor=2: one
    curve."""
    ckpt = {"enabled": True, "every_steps": 4, "keep": 3, "async_save": False}
    run(tiny(model={"layers": LAYERS}, checkpoint=ckpt, train={"steps": 4},
             pipeline={"schedule": "1f1b", "microbatches": 8}), "tensor=2,pipeline=4", tmp_path)
    run(tiny(model={"layers": LAYERS}, checkpoint=ckpt, train={"steps": 8},
             pipeline={"schedule": "chimera", "microbatches": 4}), "data=2,pipeline=2", tmp_path)
    resumed = run(tiny(model={"layers": LAYERS}, checkpoint=ckpt), "data=2,tensor=2", tmp_path)
    assert resumed["records"][0]["step"] == 9
    np.testing.assert_allclose(losses(tmp_path), four_layer_reference, rtol=1e-4)


def test_pipeline_stages_hold_only_their_layers():
    job = Job(_pipe_exp("1f1b"), make_mesh("pipeline=4"))
    state = job.init_state()
    w1 = state["params"]["stages"]["mlp"]["w1"]
    assert w1.shape[:3] == (4, 1, 1)
    assert w1.addressable_shards[0].data.shape[:3] == (1, 1, 1)


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2),
                                    ("chimera", 1), ("zb-h1", 1)])
def test_executor_buffers_hold_the_schedule_peak(name, v):
    from plait.parallel.tick_table import tick_table

    for D, N in ((4, 4), (4, 8), (8, 16)):
        s = schedules.build(name, D, N, v)
        p = tick_table(s, 2 * D * v)
        assert p.stash_slots == max(s.figures["peak_inflight"])
        assert p.inbox_slots <= N + 1  # gpipe: N loss gradients + one arriving activation


@pytest.mark.parametrize("schedule", ["1f1b", "chimera"])
def test_inspect_counts_each_switch_branch_as_often_as_the_table_runs_it(schedule):
    from plait.inspect import inspect_step

    report = inspect_step(_pipe_exp(schedule), make_mesh("pipeline=4"))
    assert report["pipeline"]["schedule"] == schedule
    assert report["flops_per_device"] == pytest.approx(report["model_flops_per_device"],
                                                       rel=1e-6)


def _inspect_4_layers(schedule: str, **pipeline) -> dict:
    from plait.inspect import inspect_step

    exp = tiny(model={"layers": 4, "d_model": 128, "heads": 8, "d_ff": 512},
               pipeline={"schedule": schedule, "microbatches": 8, **pipeline})
    return inspect_step(exp, make_mesh("pipeline=4"))


def test_zero_bubble_costs_what_1f1b_costs():
    """The split backward recomputes no matmul: ZB-H1's compiled matmul FLOPs are 1F1B's;
    a microbatch's stash row (W's residuals, then Bx's or the frontier in the same
    bytes) is no larger than 1F1B's (tests/test_residuals.py: W computes again what
    Bx made of the residuals by elementwise steps); and its temporary memory within
    25% of 1F1B's (it was 1.34x and 1.33x with one vjp called twice and 2D - 1
    microbatches held; 1.07x before the norms kept only their statistics, which saved
    1F1B 36% and ZB-H1 26% of their temporaries here)."""
    from plait.parallel.split_backward import LayerGrad

    rows: dict[str, int] = {}
    real_init = LayerGrad.__post_init__

    def sized(self):
        real_init(self)
        rows.update({k: sum(a.size * a.dtype.itemsize for a in v)
                     for k, v in self.examples().items()})

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LayerGrad, "__post_init__", sized)
        one, zb = _inspect_4_layers("1f1b"), _inspect_4_layers("zb-h1")
    assert rows["res_w"] + max(rows["res_b"], rows["frontier"]) <= rows["stashed"], rows
    assert zb["flops_per_device"] == pytest.approx(one["flops_per_device"], rel=0.02)
    assert zb["memory"]["temp_bytes"] <= 1.25 * one["memory"]["temp_bytes"]
    assert zb["pipeline"]["stash_slots_per_rank"] == [4, 4, 4, 4]
    assert one["pipeline"]["stash_slots_per_rank"] == [4, 3, 2, 1]


def test_split_backward_runs_each_matmul_once_and_stashes_no_parameter():
    from flax import nnx

    from plait.config import GPTConfig
    from plait.models import flat_to_pure, layer_stack
    from plait.models.gpt import Block
    from plait.parallel.split_backward import _CHEAP, LayerGrad

    cfg = GPTConfig.model_validate({"layers": 1, "d_model": 32, "heads": 4, "d_ff": 64,
                                    "vocab": 64, "seq_len": 8})
    stack = layer_stack(Block, cfg)
    keys = iter(jax.random.split(jax.random.key(0), 64))
    p = jax.tree.map(lambda v: 0.1 * jax.random.normal(next(keys), v.get_value().shape),
                     flat_to_pure(nnx.to_flat_state(stack.abstract)),
                     is_leaf=lambda x: hasattr(x, "get_metadata"))
    x, g = (jax.random.normal(next(keys), (2, 8, 32)) for _ in range(2))
    layer = stack.layer_fn()
    lg = LayerGrad(layer, p, x)
    # Bx and W share only the cheap elementwise steps W runs again rather than take a
    # value of Bx's over (split_backward._CHEAP: a norm's normalised input)
    both = set(lg._b_eqns) & set(lg._w_eqns)
    assert both and {lg.bwd.jaxpr.eqns[i].primitive.name for i in both} <= _CHEAP
    dots = [sum(lg.bwd.jaxpr.eqns[i].primitive.name == "dot_general" for i in eqns)
            for eqns in (lg._b_eqns, lg._w_eqns)]
    # W: the weight matmuls, q, k and v (the fused weight's three parts: ops.dense_parts),
    # out, w1, w2
    assert dots[1] == 6 and dots[0] > 0
    param_shapes = {a.shape for a in jax.tree.leaves(p)}
    assert not param_shapes & {a.shape for a in lg.examples()["stashed"]}
    # the replayed equations keep their name scopes, which the compiled program's op
    # names carry (a dropless layer's spill switch is priced by its scope:
    # hlo.SIZED_BY_DATA; replayed without it, every size was counted)
    for jaxpr, scope in ((lg.fwd.jaxpr, "jvp("), (lg.bwd.jaxpr, "transpose(jvp(")):
        names = [str(e.source_info.name_stack) for e in jaxpr.eqns
                 if e.primitive.name == "dot_general"]
        assert names and all(n.startswith(scope) for n in names), names
    y, stashed = lg.forward(p, x)
    ref_y, vjp = jax.vjp(layer, p, x)
    ref_dp, ref_dx = vjp(g)
    by_index = dict(zip(lg.stashed, stashed, strict=True))
    dx, frontier = lg.backward_input(p, [by_index[i] for i in lg.res_b],
                                     [by_index[i] for i in lg.res_w], g)
    dp = lg.backward_weight(p, [by_index[i] for i in lg.res_w], frontier)
    np.testing.assert_allclose(y, ref_y, rtol=1e-6)
    np.testing.assert_allclose(dx, ref_dx, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(dp), jax.tree.leaves(ref_dp), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    whole_dp, whole_dx = lg.backward(p, stashed, g)
    np.testing.assert_allclose(whole_dx, ref_dx, rtol=1e-5, atol=1e-6)


def test_zero_bubble_with_recompute_and_remat_trains_like_one_device(four_layer_reference,
                                                                      tmp_path):
    """pipeline.recompute with the model's save_dots remat inside the split layers (full
    remat was checked by hand: the same losses)."""
    exp = tiny(model={"layers": LAYERS, "remat": "save_dots"}, train={"steps": 4},
               pipeline={"schedule": "zb-h1", "microbatches": 4, "recompute": True})
    np.testing.assert_allclose(losses(run(exp, "pipeline=2", tmp_path)), four_layer_reference[:4],
                               rtol=1e-4)


THREE_D_PIPELINE = """
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 16)
sys.path.insert(0, "tests")
from helpers import losses, run, tiny
from pathlib import Path
exp = tiny(model={"layers": 4}, train={"steps": 3},
           pipeline={"schedule": "zb-h1", "microbatches": 2})
print(json.dumps([float(x) for x in losses(run(exp, "tensor_x=2,tensor_y=2,tensor_z=2,pipeline=2",
                            Path(sys.argv[1])))]))
"""


def test_pipeline_nests_the_3d_tensor_mode(four_layer_reference, tmp_path):
    """Pipeline x 3-D tensor on 16 simulated devices (a process of its own): the tensor
    layers' shard_maps nest inside the pipeline's, losses equal one device's."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", THREE_D_PIPELINE, str(tmp_path)], cwd=root,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    np.testing.assert_allclose(got, four_layer_reference[:3], rtol=1e-4)


def test_microbatch_rows_must_split_over_the_2d_grid_too():
    """A 2-D grid splits rows over tensor_row as well: one row per microbatch on
    tensor_row=2 is a one-line error naming the axes (it was a sharding traceback)."""
    from plait.errors import UserError

    exp = tiny(model={"layers": 8}, train={"global_batch": 4},
               pipeline={"schedule": "1f1b", "microbatches": 4})
    with pytest.raises(UserError, match="tensor_row = 2; make it a multiple of 8"):
        Job(exp, make_mesh("pipeline=2,tensor_row=2,tensor_col=2"))
