"""The context axis: sequences split over it, attention by a ring or by gathering keys
and values. Loss and gradients equal the run without the axis for the GPT and the Llama
decoder on several meshes; checkpoints move on and off the axis; the compiled
collectives over it equal the formula; every rank does the same causal work; a long
sequence's step needs a fraction of the memory of one sequence per device."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import losses, make_mesh, run, tiny

LLAMA = {"kind": "llama", "heads": 8, "kv_heads": 2, "d_ff": 96, "qkv_bias": True,
         "rope_theta": 10000.0}
MODELS = {"gpt": {}, "llama": LLAMA}


def experiment(kind: str, attention: str = "ring", **sections):
    return tiny(model={**MODELS[kind], **sections.pop("model", {})},
                context={"attention": attention}, **sections)


@functools.cache
def loss_and_grads(model: str, attention: str, spec: str):
    from plait.tasks.gpt import GPTTask

    exp = experiment(model, attention, model={"layers": 1})  # one block shows it all
    task = GPTTask(exp, make_mesh(spec))
    params = task.init_state()["params"]
    tokens = np.random.default_rng(0).integers(0, exp.model.vocab,
                                               (exp.train.global_batch, exp.model.seq_len + 1))
    loss, grads = jax.jit(jax.value_and_grad(task.loss))(params, jnp.asarray(tokens, jnp.int32))
    return float(loss), jax.tree.map(np.asarray, grads)


@pytest.mark.parametrize("model,attention,spec", [
    *((m, a, s) for s in ("context=4", "data=2,context=2,tensor=2", "fsdp=2,context=4")
      for a in ("ring", "allgather") for m in MODELS),
    # the Llama's 2 key/value heads on 4 tensor ranks: replicated there
    ("llama", "ring", "context=2,tensor=4"), ("llama", "allgather", "context=2,tensor=4")])
def test_loss_and_gradients_equal_the_run_without_the_axis(model, attention, spec):
    """context=2,tensor=4: the Llama's key/value heads are replicated over tensor; the
    ring's per-block conditional had held their gradients' sum over the query heads'
    ranks, and plait train refused the step (parallel.context.attend)."""
    want_loss, want = loss_and_grads(model, "ring", "data=1")
    got_loss, got = loss_and_grads(model, attention, spec)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    for path, g in jax.tree_util.tree_leaves_with_path(got):
        w = want
        for k in path:
            w = w[k.key]
        # rtol 1e-5 of each gradient's scale (elements near 0 have no relative precision)
        np.testing.assert_allclose(g, w, atol=1e-5 * np.abs(w).max(), rtol=1e-5,
                                   err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("model", MODELS)
def test_pipeline_with_a_context_axis_trains_like_one_device(model, tmp_path):
    """Under a pipeline the context axis gathers keys and values (a ring step inside a
    stage's branch would wait for ranks in another): losses equal the one-device run."""
    steps = {"train": {"steps": 4}, "model": {"layers": 2}}  # a layer per stage
    want = losses(run(experiment(model, **steps), "data=1", tmp_path / "one"))
    exp = experiment(model, pipeline={"schedule": "1f1b", "microbatches": 4}, **steps)
    got = losses(run(exp, "context=2,pipeline=2", tmp_path / "cp"))
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_checkpoints_move_on_and_off_the_axis(tmp_path):
    """4 steps on context=4, 4 on data=4, 4 on context=4 again: the curve of 12 steps on
    data=4 (RoPE, stacked layers, so the positions and the layer layout both move)."""
    ckpt = {"enabled": True, "every_steps": 4, "keep": 2, "async_save": False}
    exp = functools.partial(experiment, "llama", checkpoint=ckpt,
                            model={"layers": 2, "scan_layers": True},
                            log={"every_steps": 1, "tensorboard": False, "console": "none"})
    full = losses(run(exp(), "data=4,fsdp=2", tmp_path / "full"))
    part = tmp_path / "part"
    for steps, spec in ((4, "context=4,fsdp=2"), (8, "data=4,fsdp=2"), (12, "context=4,fsdp=2")):
        run(exp(train={"steps": steps}), spec, part)
    np.testing.assert_allclose(losses(part), full, rtol=1e-5)


def test_balanced_order_gives_every_rank_the_same_causal_work():
    from plait.parallel.context import balanced_order

    seq, C = 64, 4
    order = balanced_order(seq, C)
    assert sorted(order) == list(range(seq))
    # the (query, key) pairs a rank's queries see: keys at positions up to each query's
    visible = [int((p + 1).sum()) for p in order.reshape(C, -1)]
    assert len(set(visible)) == 1 and sum(visible) == seq * (seq + 1) // 2
    contiguous = [int((p + 1).sum()) for p in np.arange(seq).reshape(C, -1)]
    assert max(contiguous) / min(contiguous) > 6  # what the order avoids


@pytest.fixture(scope="module")
def ring_step():
    """The compiled step of the Llama on context=4 (ring), read by the next two tests."""
    from plait.inspect import inspect_step

    exp = experiment("llama")
    mesh = make_mesh("context=4")
    return exp, mesh, inspect_step(exp, mesh)


def test_compiled_ring_bytes_equal_the_formula(ring_step):
    from plait import analysis, hlo
    from plait.parallel import formulas
    from plait.tasks import make_task

    exp, mesh, report = ring_step
    got = formulas.context_wire_bytes(report)
    want = formulas.context_bytes(exp, dict(mesh.shape), "cpu")
    assert got["collective-permute"] == want["collective-permute"]
    assert report["context"]["formula_bytes"] == want  # what plait inspect prints
    # Key/value heads replicated over tensor: one sent round per query head, and no
    # sum over the query heads' ranks inside the ring's per-block conditional, which
    # XLA:CPU does not order against the ring's sends (plait train refused the step).
    mesh = make_mesh("context=2,tensor=4")
    compiled = make_task(exp, mesh).compile()
    assert hlo.unordered_beside_conditionals(hlo.parse_hlo(compiled.as_text())) == []
    got = formulas.context_wire_bytes(analysis.analyze(compiled, dict(mesh.shape)))
    assert got["collective-permute"] == \
        formulas.context_bytes(exp, dict(mesh.shape), "cpu")["collective-permute"]


def test_compiled_allgather_bytes_equal_the_formula():
    from plait.inspect import inspect_step
    from plait.parallel import formulas

    exp = experiment("llama", "allgather", model={"remat": "full"})
    mesh = make_mesh("data=2,context=2,tensor=2")
    got = formulas.context_wire_bytes(inspect_step(exp, mesh))
    want = formulas.context_bytes(exp, dict(mesh.shape), "cpu")
    np.testing.assert_allclose(got["all-gather"], want["all-gather"], rtol=0.01)
    # the key/value gradients ride in the all-reduces with the weight gradients
    assert got["all-reduce"] > want["all-reduce"]


def test_every_ring_step_computes_the_same_on_every_rank(ring_step):
    """Each ring step after the first is a conditional (the block came from an earlier or
    a later rank); its two branches must cost the same matmul FLOPs, within 5%."""
    from plait import analysis, hlo
    from plait.tasks.gpt import GPTTask

    exp, mesh, _ = ring_step
    mod = hlo.parse_hlo(GPTTask(exp, mesh).compile().as_text())
    pairs = []
    for instrs in mod.computations.values():
        for ins in instrs:
            if ins.opcode != "conditional":
                continue
            names = hlo.branches(ins.attrs)
            flops = [analysis.dot_flops(dataclasses.replace(mod, entry=b)) for b in names]
            if len(flops) == 2 and max(flops) > 0:
                pairs.append(flops)
    # forward and backward, C - 1 steps, 2 layers
    assert len(pairs) >= 2 * (4 - 1) * exp.model.layers
    for a, b in pairs:
        assert abs(a - b) <= 0.05 * max(a, b), (a, b)


def test_long_sequence_memory_is_a_fraction_of_one_sequence_per_device():
    """seq_len 16384 on 8 devices: the compiled step's temporary memory per device on
    context=8 (ring) at most 1/6 of data=8 with one sequence per device."""
    from plait.inspect import inspect_step

    model = {"kind": "llama", "layers": 2, "d_model": 64, "heads": 4, "kv_heads": 2,
             "d_ff": 128, "seq_len": 16384, "rope_theta": 10000.0}
    exp = tiny(model=model, train={"global_batch": 8})
    temp = {spec: inspect_step(exp, make_mesh(spec))["memory"]["temp_bytes"]
            for spec in ("data=8", "context=8")}
    assert temp["context=8"] <= temp["data=8"] / 6, temp


def test_context_errors_are_one_line():
    from plait.errors import UserError
    from plait.tasks.gpt import GPTTask

    with pytest.raises(UserError, match="2 x context = 8 equal chunks"):
        GPTTask(experiment("gpt", model={"seq_len": 36}), make_mesh("context=4"))
    with pytest.raises(UserError, match="1-D tensor parallelism or none"):
        GPTTask(experiment("gpt"), make_mesh("context=2,tensor_row=2,tensor_col=2"))
    with pytest.raises(UserError, match="leaves 4 positions per piece, which context = 8"):
        GPTTask(experiment("gpt", model={"loss_chunks": 8}), make_mesh("context=8"))


def test_sweep_tries_the_axis_for_long_sequences_only():
    from plait.config_files import load_experiment
    from plait.sweep.shapes import enumerate_shapes

    long, _ = enumerate_shapes(load_experiment("experiments/llama3.2-1b-32k.toml", []), 8)
    assert {c.sizes.get("context", 1) for c in long} == {1, 2, 4, 8}
    short, reasons = enumerate_shapes(tiny(model={"seq_len": 1024}), 8)
    assert {c.sizes.get("context", 1) for c in short} == {1}
    assert not any("context" in r for r in reasons)


def test_sync_replicas_with_a_context_axis_train_as_with_fsdp(tmp_path):
    """EASGD replicas over data, each split over context (keys and values gathered: the
    ring's shard_map cannot run in the per-replica vmap), train as each split over fsdp."""
    exp = experiment("llama", train={"steps": 4}, sync={"method": "easgd", "period": 2})
    want = losses(run(exp, "data=2,fsdp=4", tmp_path / "fsdp"))
    got = losses(run(exp, "data=2,context=4", tmp_path / "context"))
    np.testing.assert_allclose(got, want, rtol=1e-5)
