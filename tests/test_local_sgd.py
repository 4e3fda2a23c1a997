"""Sync EASGD and DiLoCo over the data axis: the limit case is synchronous data
parallelism; each step equals a NumPy implementation on the same gradients; the
compiled step exchanges nothing over `data` on local steps and one model's worth
(sharded) on sync steps; checkpoints resume bit-exact mid-period and onto another
replica count."""

import jax
import numpy as np
import pytest
from helpers import LINE_LOG, losses, make_mesh, run, tiny

from plait import data
from plait.errors import UserError
from plait.tasks.gpt import GPTTask as Job

SGD = {"name": "sgd", "lr": 0.1, "warmup_steps": 0, "grad_clip": 0.0}


def test_diloco_with_period_1_outer_lr_1_and_no_momentum_is_allreduce(tmp_path):
    spec = "data=2,fsdp=2,tensor=2"
    ref = losses(run(tiny(optimizer=SGD), spec, tmp_path / "allreduce"))
    got = losses(run(tiny(optimizer=SGD, sync={"method": "diloco", "period": 1,
                                               "outer_lr": 1.0, "outer_momentum": 0.0}),
                     spec, tmp_path / "diloco"))
    np.testing.assert_allclose(got, ref, rtol=1e-5)


def _numpy_exchange(method, xs, sync, cfg):
    """The papers' rules, on float64 arrays: xs [R, ...] replicas, sync = center state."""
    if method == "easgd":
        c = sync["center"]
        d = xs - c
        return xs - cfg["alpha"] * d, {"center": c + cfg["alpha"] * d.sum(0)}
    c, m = sync["center"], sync["momentum"]
    g = c - xs.mean(0)
    m = cfg["outer_momentum"] * m + g
    c = c - cfg["outer_lr"] * (g + cfg["outer_momentum"] * m)
    return np.broadcast_to(c, xs.shape), {"center": c, "momentum": m}


@pytest.mark.parametrize("method,cfg", [
    ("easgd", {"period": 2, "alpha": 0.2}),
    ("diloco", {"period": 2, "outer_lr": 0.7, "outer_momentum": 0.9}),
])
def test_each_step_equals_numpy_on_the_same_gradients(method, cfg):
    """4 replicas (data=4, tensor=2), inner SGD: every step's replicas and center equal
    a NumPy implementation fed each replica's gradient on its own rows, computed by a
    single-device model."""
    exp = tiny(optimizer=SGD, sync={"method": method, **cfg})
    job = Job(exp, make_mesh("data=4,tensor=2"))
    dense = Job(tiny(optimizer=SGD), make_mesh("data=1"))
    grad = jax.jit(jax.grad(lambda p, toks: dense.loss(p, toks)))
    state = job.init_state()
    src = job.source()
    R = 4
    ref = None
    for step in range(5):
        batch = job.batch(src, step)
        tokens = np.asarray(data.global_batch(dense.source(), step, dense.batch_shape,
                                              dense.batch_sharding))[0]
        host = jax.tree.map(lambda a: np.asarray(a, np.float64), state)
        if ref is None:
            ref = host
        rows = tokens.shape[0] // R
        grads = [grad(jax.tree.map(lambda a, i=i: np.asarray(a[i], np.float32),
                                   state["params"]), tokens[i * rows:(i + 1) * rows])
                 for i in range(R)]
        lr = float(job.lr_schedule(step))
        xs = jax.tree.map(lambda x, *g, lr=lr: x - lr * np.stack([np.asarray(gi) for gi in g]),
                          ref["params"], *grads)
        sync = ref["sync"]
        if (step + 1) % cfg["period"] == 0:
            flat_x, tdef = jax.tree.flatten(xs)
            parts = [_numpy_exchange(method, x, {k: jax.tree.leaves(v)[i]
                                                 for k, v in sync.items()}, cfg)
                     for i, x in enumerate(flat_x)]
            xs = jax.tree.unflatten(tdef, [p[0] for p in parts])
            sync = {k: jax.tree.unflatten(tdef, [p[1][k] for p in parts]) for k in sync}
        state, _ = job.step_fn(state, batch)
        ref = {"params": xs, "sync": sync}
        for name, want in (("params", xs), ("sync", sync)):
            got = jax.tree.map(np.asarray, state[name])
            for (path, w), g in zip(jax.tree_util.tree_leaves_with_path(want),
                                    jax.tree.leaves(got), strict=True):
                where = f"step {step} {name}{jax.tree_util.keystr(path)}"
                np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6, err_msg=where)
    # Replicas drift apart between exchanges (they saw different rows).
    p = jax.tree.leaves(state["params"])[0]
    assert method == "diloco" or not np.allclose(p[0], p[1])


@pytest.mark.parametrize("method", ["easgd", "diloco"])
def test_data_axis_bytes_are_zero_on_local_steps_and_one_model_on_sync_steps(method):
    from plait.inspect import inspect_step

    exp = tiny(sync={"method": method, "period": 4})
    mesh = make_mesh("data=4,tensor=2")
    report = inspect_step(exp, mesh)

    def data_bytes(phase):
        return sum(r["bytes"] for r in report["phases"][phase]["collective_ops"]
                   if r["axes"] == ["data"])

    # One model's worth per device: each parameter's bytes over its tensor split.
    job = Job(exp, mesh)
    shapes, shardings = job._params
    model = sum(np.prod(s.shape) * s.dtype.itemsize / np.prod(
        [mesh.shape[a] for part in sh.spec if part for a in
         ((part,) if isinstance(part, str) else part)])
        for s, sh in zip(jax.tree.leaves(shapes), jax.tree.leaves(shardings), strict=True))
    local, sync = data_bytes("local_step"), data_bytes("sync_step")
    # Nothing: even the loss and gradient norm stay per replica (averaged on the host).
    assert local == 0
    # A reduce-scatter of the replicas' sum (its input: one model) and an all-gather of
    # the center (its output: one model).
    assert sync == pytest.approx(2 * model, rel=1e-6)
    kinds = {r["kind"] for r in report["phases"]["sync_step"]["collective_ops"]
             if r["axes"] == ["data"]}
    assert {"reduce-scatter", "all-gather"} <= kinds


def test_microbatches_do_not_change_what_a_replica_trains_on(tmp_path):
    """A replica's rows of every microbatch come from its own block of the global batch,
    as with one microbatch: accumulation is a memory setting, not another data order.
    (Each microbatch split over the replicas had given replica r samples 2r, 2r + 1,
    8 + 2r and 9 + 2r instead of 4r to 4r + 3: 1.2e-3 apart by step 6.)"""
    sync = {"method": "easgd", "period": 2, "alpha": 0.25}
    ref = losses(run(tiny(sync=sync, train={"steps": 6}), "data=4,tensor=2", tmp_path / "m1"))
    got = losses(run(tiny(sync=sync, train={"steps": 6, "microbatches": 2}),
                     "data=4,tensor=2", tmp_path / "m2"))
    np.testing.assert_allclose(got, ref, rtol=2e-6)


def test_resume_in_the_middle_of_a_period_is_bit_exact(tmp_path):
    ckpt = {"enabled": True, "every_steps": 6, "keep": 2, "async_save": False}
    sync = {"method": "diloco", "period": 4}
    whole = losses(run(tiny(sync=sync), "data=2,fsdp=2,tensor=2", tmp_path / "whole"))
    run(tiny(sync=sync, checkpoint=ckpt, train={"steps": 6}), "data=2,fsdp=2,tensor=2",
        tmp_path / "cut")
    resumed = run(tiny(sync=sync, checkpoint=ckpt), "data=2,fsdp=2,tensor=2", tmp_path / "cut")
    assert resumed["records"][0]["step"] == 7
    np.testing.assert_array_equal(losses(tmp_path / "cut"), whole)


def test_resume_on_another_replica_count_restarts_from_the_center(tmp_path, capsys):
    ckpt = {"enabled": True, "every_steps": 3, "keep": 2, "async_save": False}
    sync = {"method": "easgd", "period": 4, "alpha": 0.25}
    run(tiny(sync=sync, checkpoint=ckpt, train={"steps": 3}), "data=4,tensor=2", tmp_path)
    exp = tiny(sync=sync, checkpoint=ckpt, train={"steps": 3}, log=LINE_LOG)
    mesh = make_mesh("data=2,tensor=2,fsdp=2")
    from plait.train.run import Run

    r = Run(exp, mesh, tmp_path)
    try:
        state, start, restored = r.restore()
    finally:
        r.close()
    assert restored and start == 3
    assert "holds 4 data replicas and this mesh has 2" in r.restore_note
    center = jax.tree.map(np.asarray, state["sync"]["center"])
    for x, c in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(center), strict=True):
        np.testing.assert_array_equal(np.asarray(x)[0], c)
        np.testing.assert_array_equal(np.asarray(x)[1], c)
    # And training goes on from there.
    out = run(tiny(sync=sync, checkpoint=ckpt, train={"steps": 6}), "data=2,tensor=2,fsdp=2",
              tmp_path)
    assert out["records"][0]["step"] == 4 and np.isfinite(losses(out)).all()


@pytest.mark.parametrize("spec,sections,needle", [
    ("data=2,pipeline=2,tensor=2", {"model": {"layers": 2}}, "pipeline"),
    ("data=2,tensor_row=2,tensor_col=2", {}, "2-D tensor mode"),
])
def test_what_local_sgd_does_not_run_is_refused_in_one_line(spec, sections, needle):
    exp = tiny(sync={"method": "easgd"}, **sections)
    with pytest.raises(UserError, match=needle):
        Job(exp, make_mesh(spec))


def test_checkpoints_keep_their_sync_method(tmp_path):
    ckpt = {"enabled": True, "every_steps": 2, "keep": 1, "async_save": False}
    run(tiny(checkpoint=ckpt, train={"steps": 2}), "data=2", tmp_path)
    with pytest.raises(UserError, match='trained with sync.method = "allreduce"'):
        run(tiny(checkpoint=ckpt, sync={"method": "diloco"}), "data=2", tmp_path)
    assert (tmp_path / "checkpoints" / "2").is_dir()  # nothing lost


@pytest.mark.parametrize("method,on_nonfinite", [("diloco", "stop"), ("easgd", "skip")])
def test_no_collective_runs_beside_the_meeting(method, on_nonfinite):
    """The meeting's conditional holds the whole step, so XLA:CPU has no collective to
    run beside it in another order on another device: with the replicas' loss and
    norm reduced beside it, the step hung in about one run of three and XLA aborted the
    process (the CI failure of 2026-11-25)."""
    from plait import hlo

    exp = tiny(optimizer=SGD, sync={"method": method, "period": 2},
               train={"on_nonfinite": on_nonfinite})
    mod = hlo.parse_hlo(Job(exp, make_mesh("data=2,fsdp=2,tensor=2")).compile().as_text())
    conds = [i for instrs in mod.computations.values() for i in instrs
             if i.opcode == "conditional"]
    assert len(conds) == 1
    assert hlo.unordered_beside_conditionals(mod) == []


def test_a_conditional_beside_an_unordered_collective_is_refused_before_it_runs():
    """plait train's check after compiling, on the shape of program that hung: a psum
    inside a conditional and another psum neither feeds nor reads."""
    from plait import hlo
    from plait.train.loop import _would_hang

    mesh = make_mesh("data=8")
    spec = jax.sharding.NamedSharding(mesh, jax.P("data"))

    def body(x, y, flag):
        inner = jax.lax.cond(flag[0] > 0, lambda v: jax.lax.psum(v, "data"), lambda v: v, x)
        return inner, jax.lax.psum(y, "data")

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(jax.P("data"),) * 3,
                              out_specs=(jax.P("data"),) * 2, check_vma=False))
    ones = jax.device_put(np.ones(8, np.float32), spec)
    compiled = f.lower(ones, ones, ones).compile()
    pairs = hlo.unordered_beside_conditionals(hlo.parse_hlo(compiled.as_text()))
    assert [(c.opcode, o.opcode) for c, o in pairs] == [("conditional", "all-reduce")]

    class Task:
        def branches_diverge(self):
            return False

    assert _would_hang(Task(), compiled).startswith(
        "the compiled step would hang on XLA:CPU: a conditional holding collectives "
        "(from ")
    # The same program with the second psum reading the conditional's result is fine.
    g = jax.jit(jax.shard_map(lambda x, y, flag: body(x, y + body(x, y, flag)[0], flag),
                              mesh=mesh, in_specs=(jax.P("data"),) * 3,
                              out_specs=(jax.P("data"),) * 2, check_vma=False))
    assert _would_hang(Task(), g.lower(ones, ones, ones).compile()) is None
