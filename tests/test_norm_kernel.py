"""parallel.norm_kernel: LayerNorm, and the residual add before it, in one Pallas
(Triton) pass each way (`model.norm_kernel = "pallas"`), run here in Pallas's
interpreter against XLA's form."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FakeGPU, assert_refused_off_a_gpu, losses, run, tiny

from plait.parallel import norm_kernel


def _reference_norm(x, w, b, eps):
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + eps) * w + b).astype(x.dtype)


def _reference_add_norm(x, h, hb, w, b, eps):
    s = (x.astype(jnp.float32) + h.astype(jnp.float32) + hb).astype(x.dtype)
    return s, _reference_norm(s, w, b, eps)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_the_kernels_give_a_layer_norms_values_and_gradients(dtype, tol):
    """Rows not a multiple of the kernel's blocks (21 of 4), a width not a power of two
    (24 of 32 columns loaded), a mean far from zero; the norm alone and after a residual
    add, values and every gradient against XLA's form; and the backward's column sums the
    same however many programs share the rows."""
    k = jax.random.split(jax.random.key(0), 7)
    shape, eps = (3, 7, 24), 1e-5
    x = (jax.random.normal(k[0], shape) * 2 + 30).astype(dtype)
    h = jax.random.normal(k[1], shape).astype(dtype)
    hb, b = (jax.random.normal(k[i], (24,)) for i in (2, 3))
    w = 1 + 0.1 * jax.random.normal(k[4], (24,))
    dy, ds = (jax.random.normal(k[i], shape).astype(dtype) for i in (5, 6))

    def close(a, c, scale=1):
        np.testing.assert_allclose(np.float32(a), np.float32(c), rtol=tol * scale,
                                   atol=tol * scale)

    def against(cot):
        return lambda f: lambda *a: sum(jnp.sum(o.astype(jnp.float32) * c.astype(jnp.float32))
                                        for o, c in zip(f(*a), cot, strict=True))

    ours, theirs = (lambda *a: (norm_kernel.layer_norm(*a, eps),),
                    lambda *a: (_reference_norm(*a, eps),))
    close(ours(x, w, b)[0], theirs(x, w, b)[0])
    got, want = (jax.grad(against((dy,))(f), (0, 1, 2))(x, w, b) for f in (ours, theirs))
    jax.tree.map(lambda a, c: close(a, c, 5), got, want)

    ours, theirs = (lambda *a: norm_kernel.add_layer_norm(*a, eps),
                    lambda *a: _reference_add_norm(*a, eps))
    jax.tree.map(close, ours(x, h, hb, w, b), theirs(x, h, hb, w, b))
    got, want = (jax.grad(against((ds, dy))(f), (0, 1, 2, 3, 4))(x, h, hb, w, b)
                 for f in (ours, theirs))
    jax.tree.map(lambda a, c: close(a, c, 5), got, want)

    rows = [a.reshape(-1, 24) for a in (x, dy, ds)]
    at = norm_kernel.placement(2)
    _, mean, rstd = norm_kernel._run_forward(at, False, eps, (rows[0], w, b))
    one, many = (norm_kernel._backward(*rows, mean, rstd, w, True, programs=p) for p in (2, 528))
    jax.tree.map(lambda a, c: np.testing.assert_allclose(np.float32(a), np.float32(c),
                                                         rtol=1e-5, atol=1e-5), one, many)


def test_a_gpt_on_the_norm_kernel_trains_like_one_device_on_xlas(whole_loss, tmp_path,
                                                                 monkeypatch, capsys):
    """Off a GPU `plait train` refuses the kernel in one line; let run interpreted, a
    GPT with its norms in the kernel (in a shard_map over the tokens: batch
    over data, sequence over context, replicated over tensor) trains like one device on
    XLA's norms, and every norm of the model runs in it on each device's rows, forward
    and backward: each ln2 after the attention's residual add, ln1 and ln_f alone."""
    exp = tiny(train={"steps": 6})
    layers = exp.model.layers
    kernel = exp.model_copy(update={"model": exp.model.model_copy(
        update={"norm_kernel": "pallas"})})
    assert_refused_off_a_gpu(kernel, "norm_kernel", tmp_path, capsys)

    monkeypatch.setattr("plait.train.run.check_kernels", lambda *a: None)
    forward, backward, traced, back = norm_kernel._forward, norm_kernel._backward, [], []
    monkeypatch.setattr(norm_kernel, "_forward", lambda x, h, *a: traced.append(
        (x.shape, h is not None)) or forward(x, h, *a))
    monkeypatch.setattr(norm_kernel, "_backward", lambda x, dy, ds, *a: back.append(
        (x.shape, ds is not None)) or backward(x, dy, ds, *a))
    got = losses(run(kernel, "data=2,context=2,tensor=2", tmp_path / "kernel"))
    np.testing.assert_allclose(got, whole_loss, rtol=1e-5)
    # each device: 16 sequences / 2 x 32 positions / 2 = 128 rows of 64
    assert set(traced) == set(back) == {((128, 64), False), ((128, 64), True)}, (traced, back)
    for calls in (traced, back):  # per model: ln2 after an add, ln1 and ln_f alone
        added = sum(residual for _, residual in calls)
        assert added * (layers + 1) == (len(calls) - added) * layers, calls


def test_both_kernels_train_local_sgd_replicas_like_xlas_forms(tmp_path, monkeypatch):
    """Under Sync EASGD each data replica trains on its own: the step maps the model over
    the replicas (vmap) inside the mesh, and the norm and loss kernels run batched there
    (interpreted), a local step and a meeting, as XLA's forms do."""
    from plait.parallel import loss_kernel

    monkeypatch.setattr("plait.train.run.check_kernels", lambda *a: None)
    calls = []
    for module, name in ((norm_kernel, "_forward"), (norm_kernel, "_backward"),
                         (loss_kernel, "_rows_with_gradient")):
        kernel = getattr(module, name)
        monkeypatch.setattr(module, name, lambda x, *a, kernel=kernel, name=name, **k: (
            calls.append((name, type(x).__name__)) or kernel(x, *a, **k)))
    sync = {"method": "easgd", "period": 2, "alpha": 0.2}
    one = {"layers": 1}  # a layer has each kind of norm: ln1 alone, ln2 after an add
    want = losses(run(tiny(train={"steps": 3}, sync=sync, model=one), "data=2,fsdp=2",
                      tmp_path / "xla"))
    got = losses(run(tiny(train={"steps": 3}, sync=sync,
                          model={**one, "norm_kernel": "pallas", "loss_kernel": "pallas"}),
                     "data=2,fsdp=2", tmp_path / "kernels"))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    # each ran, the norms' on the replicas' batch (the loss's inside its scan's body)
    assert {name for name, _ in calls} == {"_forward", "_backward", "_rows_with_gradient"}
    assert {("_forward", "BatchTracer"), ("_backward", "BatchTracer")} <= set(calls), calls


def test_auto_takes_both_kernels_on_a_hopper_gpu_only():
    """`model.loss_kernel`, `model.norm_kernel` and `model.fp8_kernel` default to
    "auto": plait's Triton kernels on a Hopper GPU, XLA's on other GPUs and off a GPU; a
    setting given is kept. The task runs what "auto" resolved to, and the start-up line
    names the kernels in use (not a LayerNorm kernel for RMS norms, not FP8's without
    FP8)."""
    from helpers import make_mesh

    from plait.tasks.gpt import GPTTask
    from plait.tasks.gpt_runtime import kernels_for, start_up_lines

    exp = tiny()
    cfg = exp.model
    assert (cfg.loss_kernel, cfg.norm_kernel, cfg.fp8_kernel) == ("auto",) * 3
    both = {"loss_kernel": "pallas", "norm_kernel": "pallas", "fp8_kernel": "pallas"}
    assert kernels_for(cfg, FakeGPU("NVIDIA H200")) == (both, "auto: a Hopper GPU")
    for device in (FakeGPU("NVIDIA A100-SXM4-80GB", "8.0", 108), jax.devices()[0]):
        assert kernels_for(cfg, device) == (
            {"loss_kernel": "xla", "norm_kernel": "xla", "fp8_kernel": "xla"},
            "auto: XLA's off a Hopper GPU")
    one = cfg.model_copy(update={"loss_kernel": "xla"})
    assert kernels_for(one, FakeGPU())[0] == {
        "loss_kernel": "xla", "norm_kernel": "pallas", "fp8_kernel": "pallas"}
    given = cfg.model_copy(update=both)
    named = "model.loss_kernel, model.norm_kernel, model.fp8_kernel"
    assert kernels_for(given, jax.devices()[0]) == (both, named)

    mesh = make_mesh("data=2")
    task = GPTTask(exp, mesh)
    assert (task.exp.model.loss_kernel, task.exp.model.norm_kernel) == ("xla", "xla")
    assert "Triton" not in start_up_lines(task)[0]
    line = start_up_lines(GPTTask(exp.model_copy(update={"model": given}), mesh))[0]
    assert line.endswith(f"; the LayerNorms and the loss in plait's Triton kernels "
                         f"({named})"), line
    rms = given.model_copy(update={"norm": "rmsnorm"})
    line = start_up_lines(GPTTask(exp.model_copy(update={"model": rms}), mesh))[0]
    assert line.endswith(f"; the loss in plait's Triton kernels ({named})"), line
    fp8 = type(exp).model_validate({**exp.model_dump(), "model": given.model_dump(),
                                    "precision": {"matmul": "fp8"}})
    line = start_up_lines(GPTTask(fp8, mesh))[0]
    assert line.endswith(f"; the LayerNorms, the loss and the FP8 operands' quantisation in "
                         f"plait's Triton kernels ({named})"), line
