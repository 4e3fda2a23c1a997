"""Dropless on JAX's Pallas grouped GEMM kernels (`model.moe.grouped = "pallas"`,
parallel.grouped_pallas): its hand-written VJP against autodiff of the same MLP, the
model's loss and gradients against the tiles path's on a data-parallel mesh (with
reference products standing in for the kernels, which run only on a Hopper GPU), the
one-line refusals. The kernels themselves are checked against the same reference
products on a Hopper GPU by benchmarks/pallas_blocks.py (these tests run on CPUs)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FakeGPU, make_mesh, ragged_dot_mlp, tiny, write_experiment

from plait.parallel import grouped_pallas

MODEL = {"kind": "llama", "heads": 4, "kv_heads": 2, "d_ff": 64, "rope_theta": 10000.0,
         "layers": 1}
MOE = {"experts": 4, "top_k": 2, "capacity_factor": 0.0, "aux_weight": 0.1,
       "z_weight": 0.01}


@pytest.fixture
def reference(monkeypatch):
    """The kernels replaced by jax.lax.ragged_dot's products (any backend)."""
    monkeypatch.setattr(grouped_pallas, "KERNELS", grouped_pallas.reference_kernels())


def _mlp_case(activation: str, dtype=jnp.float32, M=100, G=4, K=16, F=12, seed=1):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((M, K)), dtype)
    w = {"w2": jnp.asarray(rng.standard_normal((G, F, K)) / 4, dtype)}
    if activation == "swiglu":
        w["w13"] = jnp.asarray(rng.standard_normal((G, K, 2, F)) / 4, dtype)
    else:
        w["w1"] = jnp.asarray(rng.standard_normal((G, K, F)) / 4, dtype)
    # over, under a balanced share, and one group with no rows
    cut = np.array([0.05, 0.0, 0.6, 0.35])
    sizes = np.floor(cut * M).astype(np.int32)
    sizes[2] += M - sizes.sum()
    return x, w, jnp.asarray(sizes)


def _value_and_grads(fn, x, w):
    def loss(x, w):
        y = fn(x, w)
        return jnp.sum(jnp.sin(y.astype(jnp.float32))), y
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, w)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_its_vjp_equals_autodiff_of_the_same_mlp(reference, activation):
    """Values and the gradients of the rows and every weight (an empty group's 0)."""
    x, w, s = _mlp_case(activation)
    (_, got), got_g = _value_and_grads(
        lambda x, w: grouped_pallas.pallas_mlp(x, w, s, activation), x, w)
    (_, want), want_g = _value_and_grads(
        lambda x, w: ragged_dot_mlp(x, w, s, activation), x, w)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-5)
    assert not np.asarray(got_g[1]["w2"][1]).any()


def test_the_model_on_it_trains_like_the_tiles(reference, monkeypatch):
    """A Mixtral-layout block's loss and gradients with grouped = "pallas" (on a mesh of
    data = 2: each device's rows through its kernels) equal the tiles path's."""
    from plait.tasks import gpt_runtime
    from plait.tasks.gpt import GPTTask

    def loss_and_grads(grouped: str):
        exp = tiny(model={**MODEL, "moe": {**MOE, "grouped": grouped}})
        task = GPTTask(exp, make_mesh("data=2"))
        assert task.exp.model.moe.grouped == grouped
        params = task.init_state()["params"]
        tokens = jnp.asarray(np.random.default_rng(0).integers(
            0, exp.model.vocab, (exp.train.global_batch, exp.model.seq_len + 1)), jnp.int32)
        (loss, _), grads = jax.jit(jax.value_and_grad(task.loss_and_metrics, has_aux=True))(
            params, tokens)
        return float(loss), grads

    want, want_g = loss_and_grads("tiles")
    monkeypatch.setattr(gpt_runtime, "_pallas_obstacle", lambda *a: None)  # "a Hopper"
    got, got_g = loss_and_grads("pallas")
    assert got == pytest.approx(want, rel=1e-6)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got_g),
                            jax.tree.leaves(want_g), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5 * float(jnp.abs(b).max()), rtol=1e-5,
                                   err_msg=jax.tree_util.keystr(path))


def test_where_the_kernels_cannot_run_train_refuses_in_one_line(tmp_path, capsys):
    """On a CPU `plait train` refuses before the run directory is made; `inspect` (and
    the sweep) trace the tiles path there instead."""
    from plait.cli import main
    from plait.tasks.gpt import GPTTask

    exp = tiny(model={**MODEL, "moe": {**MOE, "grouped": "pallas"}})
    path = write_experiment(tmp_path / "pallas.toml", exp)
    assert main(["train", str(path), "--mesh", "data=2", "--run-dir",
                 str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Hopper GPUs (compute capability 9.0), not cpu;" in err, err
    assert 'use model.moe.grouped = "auto" or "tiles"' in err, err
    assert not (tmp_path / "run").exists()
    assert GPTTask(exp, make_mesh("data=2")).exp.model.moe.grouped == "tiles"


@pytest.mark.parametrize("grouped,compute,mesh,want,why", [
    ("auto", "bfloat16", {"data": 8}, "pallas", "auto: a Hopper GPU"),
    ("auto", "float32", {}, "tiles", "auto: the Hopper kernels multiply in bf16"),
    ("auto", "bfloat16", {"expert": 2}, "tiles", "auto: an expert axis"),
    ("tiles", "bfloat16", {}, "tiles", "model.moe.grouped"),
    ("pallas", "bfloat16", {}, "pallas", "model.moe.grouped"),
])
def test_auto_takes_the_kernels_where_they_run(grouped, compute, mesh, want, why):
    from plait.tasks.gpt_runtime import grouped_for

    cfg = tiny(model={**MODEL, "d_model": 128, "moe": {**MOE, "grouped": grouped}}).model
    got, said = grouped_for(cfg, compute, FakeGPU(), mesh)
    assert (got.moe.grouped, said) == (want, why)
    cpu = jax.devices()[0]
    assert grouped_for(cfg, compute, cpu, mesh)[0].moe.grouped in ("tiles", "ragged_dot")
    assert tiny().model.moe is None or tiny().model.moe.grouped == "auto"


@pytest.mark.parametrize("change,message", [
    ({"precision": {"compute": "float32"}}, 'not precision.compute = "float32"'),
    ({"mesh": {"expert": 2}}, "without an expert axis"),
    ({"model": {"d_model": 96}}, "multiples of 64, not model.d_model = 96"),
])
def test_what_the_kernels_do_not_take_is_refused_on_a_hopper_gpu(change, message):
    from plait.errors import UserError
    from plait.tasks.gpt_runtime import check_grouped

    model = {**MODEL, "d_model": 128, "d_ff": 256, "moe": {**MOE, "grouped": "pallas"}}
    check_grouped(tiny(model=model).model, "bfloat16", FakeGPU(), {"data": 1})  # takes it
    exp = tiny(model={**model, **change.get("model", {})},
               precision={"compute": "bfloat16", **change.get("precision", {})})
    with pytest.raises(UserError, match=message):
        check_grouped(exp.model, exp.precision.compute, FakeGPU(), change.get("mesh", {}))


@pytest.mark.parametrize("spec,model", [
    ("data=2,fsdp=2,tensor=2", {}),
    ("pipeline=2", {}),
    ("data=2", {"scan_layers": True, "remat": "full"}),
], ids=["data-fsdp-tensor", "pipeline", "data-stacked-remat"])
def test_the_hopper_kernels_trace_in_the_train_step(monkeypatch, spec, model):
    """The real kernels (not reference products) traced into the whole train step on
    meshes "auto" would run them on: inside the rows' shard_map, a pipeline's stages,
    scanned layers under remat. Each kernel's result must take the varying type of its
    operands there, or the custom VJP's gradients do not type-check (a data-parallel
    GPU run's failure, found by tracing here; the kernels are traced, never run, on a
    CPU)."""
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

    from plait.tasks import gpt_runtime
    from plait.tasks.gpt import GPTTask

    class JaxOnHopper:
        devices = staticmethod(lambda *a: [FakeGPU()])

        def __getattr__(self, name):
            return getattr(jax, name)

    mesh = make_mesh(spec)
    monkeypatch.setattr(transposed_ragged_dot_mgpu, "jax", JaxOnHopper())
    monkeypatch.setattr(gpt_runtime, "_pallas_obstacle", lambda *a: None)  # "a Hopper"
    exp = tiny(model={**MODEL, "layers": 2, "d_model": 64, "d_ff": 128, **model,
                      "moe": {**MOE, "grouped": "pallas"}}, precision={"compute": "bfloat16"})
    task = GPTTask(exp, mesh)
    jaxpr = str(task.step_fn.trace(task.layout.abstract(), task.abstract_batch()).jaxpr)
    # the kernels are there (their warpgroup matrix multiplies), not reference products
    assert "wgmma" in jaxpr and "ragged_dot" not in jaxpr
