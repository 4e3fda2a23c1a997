"""The decoder's loss in pieces of the tokens (model.loss_chunks, models.loss): the
same value and gradients as the loss over all logits at once, in the same matmul
FLOPs and collective bytes, with less memory. More meshes (2-D tensor, stacked
layers, a ZB-H1 pipeline, the hierarchical reduction) are checked against one
device in tests/test_llama.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_refused_off_a_gpu, losses, make_mesh, run, tiny

from plait.models.loss import chunked_cross_entropy, cross_entropy


@pytest.mark.parametrize("layout", ["tied", "untied"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pieces_give_the_loss_and_gradients_of_all_logits(layout, dtype):
    """A vocabulary padded past `vocab` (37 of 40 ids), the head as the tied table
    [vocab, d] or an untied [d, vocab]; float32 to rounding, bfloat16 to its own."""
    k = jax.random.split(jax.random.key(0), 3)
    B, S, d, V, vocab = 4, 16, 8, 40, 37
    dt = jnp.dtype(dtype)
    h = jax.random.normal(k[0], (B, S, d), dt)
    shape, eq = ((V, d), "bsd,vd->bsv") if layout == "tied" else ((d, V), "bsd,dv->bsv")
    w = jax.random.normal(k[1], shape, dt)
    t = jax.random.randint(k[2], (B, S), 0, vocab)

    def project(h, w):
        return jnp.einsum(eq, h, w)

    def whole(h, w):
        return cross_entropy(project(h, w), t, vocab)

    def pieces(h, w):
        return chunked_cross_entropy(project, h, w, t, vocab, 4)

    tol = 1e-6 if dtype == "float32" else 2e-2
    want, got = jax.value_and_grad(whole, (0, 1))(h, w), \
        jax.jit(jax.value_and_grad(pieces, (0, 1)))(h, w)
    np.testing.assert_allclose(got[0], want[0], rtol=tol)
    for g, ref in zip(got[1], want[1], strict=True):
        assert g.dtype == ref.dtype
        scale = float(jnp.max(jnp.abs(ref.astype(jnp.float32))))
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(ref, np.float32),
                                   atol=tol * scale * (1 if dtype == "float32" else 4))
    # Without differentiation only the loss is computed (held-out evaluation).
    np.testing.assert_allclose(jax.jit(pieces)(h, w), want[0], rtol=tol)


@pytest.mark.parametrize("spec", ["data=2,fsdp=2,tensor=2", "data=2,fsdp=2,context=2",
                                  "tensor_x=2,tensor_y=2,tensor_z=2"],
                         ids=["1d", "context", "3d"])
def test_a_tied_gpt_trains_in_pieces_like_one_device_all_at_once(whole_loss, tmp_path, spec):
    """The GPT layout (tied head) on data x fsdp x tensor, beside a context axis (pieces
    of its sequence shards) and on the 3-D cube (its own matmuls), against one device
    without pieces."""
    from plait.tasks.gpt import GPTTask

    chunked = tiny(train={"steps": 6}, model={"loss_chunks": 4})
    got = losses(run(chunked, spec, tmp_path))
    np.testing.assert_allclose(got, whole_loss, rtol=1e-5)
    # the start-up line says so
    line = GPTTask(chunked, make_mesh(spec)).describe({})[0]
    assert "loss in 4 pieces of 8 positions per sequence" in line, line


def test_pieces_compile_to_the_same_flops_and_bytes_in_less_memory():
    """No matmul is recomputed, no weight is gathered or reduced once per piece (fsdp
    and context split the tokens), and the step's temporaries shrink by more than the
    logits."""
    from plait.inspect import inspect_step

    model = {"vocab": 4096, "layers": 1, "remat": "full"}
    mesh = make_mesh("fsdp=2,context=2,tensor=2")
    whole = inspect_step(tiny(model=model), mesh)
    pieces = inspect_step(tiny(model={**model, "loss_chunks": 8}), mesh)
    assert pieces["flops_per_device"] == pytest.approx(whole["flops_per_device"], rel=1e-9)
    # The loop's collectives are per token (the log-sum-exp's and the residual
    # gradient's all-reduces over tensor, as without pieces) or a float32 scalar (each
    # piece's loss); the head's weight is gathered once and its gradient summed over
    # the token shards once. GSPMD sums the tied table's two gradients (lookup, head)
    # in a different order then: fewer bytes in all, here 8% fewer.
    ring = [op for op in whole["collective_ops"] if op["kind"] == "collective-permute"]
    loop = [op for op in pieces["collective_ops"] if op["count"] == 8 and op not in ring]
    assert loop and all(op["kind"] == "all-reduce" for op in loop), loop
    assert {op["shape"] for op in loop if op["axes"] != ["tensor"]} == {"f32[]"}, loop
    assert sum(pieces["collectives"].values()) <= sum(whole["collectives"].values()), \
        (pieces["collectives"], whole["collectives"])
    # the logits per device: 16 x 32 tokens over fsdp x context, 4096 ids over tensor,
    # float32: 1 MiB (then their gradient); measured 4.94 -> 3.14 MB
    logits = 16 * 32 // 4 * 4096 // 2 * 4
    assert pieces["memory"]["temp_bytes"] < whole["memory"]["temp_bytes"] - logits, \
        (pieces["memory"], whole["memory"])


def test_one_pass_logsumexp_equals_jax_and_keeps_padding_out():
    """The loss's log-sum-exp in one reduction (running max, sum rescaled to it: one read
    of the logits where jax.nn.logsumexp makes two) against jax's, with large spreads,
    the vocabulary's padding at -inf, and rows of padding only (-inf, not nan). A split
    vocabulary keeps jax's two all-reduces (tests/test_inspect.py, Megatron's)."""
    from plait.models.loss import _logsumexp_one_pass

    x = 30.0 * jax.random.normal(jax.random.key(0), (6, 1000))
    x = x.at[:, 900:].set(-jnp.inf).at[5].set(-jnp.inf)
    got, want = jax.jit(_logsumexp_one_pass)(x), jax.nn.logsumexp(x, axis=-1)
    np.testing.assert_allclose(got[:5], want[:5], rtol=1e-6)
    assert np.isneginf(got[5])
    # its derivative is the softmax
    grad = jax.grad(lambda x: jnp.sum(_logsumexp_one_pass(x)))(x[:5])
    np.testing.assert_allclose(grad, jax.nn.softmax(x[:5], axis=-1), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_loss_kernel_gives_the_loss_and_gradients_of_xlas_reductions(dtype):
    """model.loss_kernel = "pallas" (parallel.loss_kernel, here in Pallas's interpreter):
    the log-sum-exp and the label's logit in blocks of columns, a vocabulary padded past
    `vocab` (37 of 40 ids) and logits far apart, all at once and in pieces; the pieces'
    loss and gradient from one kernel (loss_and_gradient: fewer programs than rows, rows
    the loss leaves out), a single piece as model.loss_kernel's GPT forms it."""
    from plait.parallel.loss_kernel import loss_and_gradient, lse_and_label

    k = jax.random.split(jax.random.key(1), 3)
    B, S, d, V, vocab = 2, 8, 8, 40, 37
    dt = jnp.dtype(dtype)
    h = jax.random.normal(k[0], (B, S, d), dt)
    w = 4.0 * jax.random.normal(k[1], (V, d), dt)
    t = jax.random.randint(k[2], (B, S), 0, vocab).at[0, 0].set(vocab - 1)

    def project(h, w):
        return jnp.einsum("bsd,vd->bsv", h, w)

    # the kernel's blocks: 16 columns a block, the last one past the array
    x = project(h, w)
    lse, label = jax.jit(lambda x, t: lse_and_label(x, t, vocab, chunk=16))(x, t)
    ref = np.asarray(x, np.float64)[..., :vocab]
    np.testing.assert_allclose(lse, np.log(np.exp(ref).sum(-1)), rtol=1e-6)
    np.testing.assert_array_equal(label, np.take_along_axis(ref, np.asarray(t)[..., None],
                                                            -1)[..., 0].astype(np.float32))
    weights = jnp.where(jnp.arange(S) % 3 == 0, 0.0, 0.5) * jnp.ones((B, 1))
    lse_ref = np.log(np.exp(ref).sum(-1))
    want_grad = np.zeros(x.shape)
    want_grad[..., :vocab] = np.exp(ref - lse_ref[..., None]) - (
        np.arange(vocab) == np.asarray(t)[..., None])
    want_grad *= np.asarray(weights)[..., None]
    for reverse in (False, True):  # the second pass from the row's first block or last
        loss, grad = jax.jit(lambda x, t, w, reverse=reverse: loss_and_gradient(
            x, t, w, vocab, chunk=16, programs=3, reverse=reverse))(x, t, weights)
        np.testing.assert_allclose(loss, lse_ref - np.take_along_axis(
            ref, np.asarray(t)[..., None], -1)[..., 0], rtol=1e-5)
        assert grad.dtype == dt
        np.testing.assert_allclose(np.asarray(grad, np.float64), want_grad,
                                   atol=1e-6 if dtype == "float32" else 2e-3)
    # a piece's loss and gradient as models.loss forms them, targets left out (~id)
    from plait import loss_mask
    from plait.models.loss import _sum_and_gradient

    left_out = jnp.where(jnp.arange(S) % 3 == 0, ~t, t)
    with loss_mask.kept_targets(left_out):
        pieces = [_sum_and_gradient(x, left_out, vocab, 0.25, kernel)
                  for kernel in ("pallas", "xla")]
    np.testing.assert_allclose(pieces[0][0], pieces[1][0], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(pieces[0][1], np.float32),
                               np.asarray(pieces[1][1], np.float32), atol=1e-6)
    for loss in (lambda h, w, kernel: cross_entropy(project(h, w), t, vocab, kernel),
                 lambda h, w, kernel: chunked_cross_entropy(project, h, w, t, vocab, 4,
                                                            kernel=kernel),
                 lambda h, w, kernel: chunked_cross_entropy(project, h, w, t, vocab, 1,
                                                            kernel=kernel)):
        want = jax.jit(jax.value_and_grad(lambda h, w, f=loss: f(h, w, "xla"), (0, 1)))(h, w)
        got = jax.jit(jax.value_and_grad(lambda h, w, f=loss: f(h, w, "pallas"), (0, 1)))(h, w)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
        for g, r in zip(got[1], want[1], strict=True):
            np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32),
                                       rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(jax.jit(lambda h, w, f=loss: f(h, w, "pallas"))(h, w),
                                   want[0], rtol=1e-6)


def test_a_gpt_on_the_loss_kernel_trains_like_one_device_on_xlas(whole_loss, tmp_path,
                                                                 monkeypatch, capsys):
    """The loss and its gradient from the kernel inside a shard_map over the token axes
    (batch over data x fsdp, sequence over context), all at once (formed as one piece)
    and in pieces of the tokens, against one device on XLA's reductions; off a GPU `plait
    train` refuses it in one line (the test lets it run interpreted)."""
    exp = tiny(train={"steps": 6}, model={"loss_kernel": "pallas"})
    assert_refused_off_a_gpu(exp, "loss_kernel", tmp_path, capsys)
    from plait.parallel import loss_kernel

    monkeypatch.setattr("plait.train.run.check_kernels", lambda *a: None)
    rows, traced = loss_kernel._rows_with_gradient, []
    monkeypatch.setattr(loss_kernel, "_rows_with_gradient",
                        lambda x, *a, **k: traced.append(x.shape) or rows(x, *a, **k))
    for chunks in (1, 4):
        traced.clear()
        exp = tiny(train={"steps": 6}, model={"loss_kernel": "pallas", "loss_chunks": chunks})
        got = losses(run(exp, "data=2,fsdp=2,context=2", tmp_path / f"run{chunks}"))
        np.testing.assert_allclose(got, whole_loss, rtol=1e-5, err_msg=f"{chunks} pieces")
        # each device's rows: a piece of 32 / chunks positions of 16 / 4 sequences, split
        # over context 2; 256 ids
        assert traced and set(traced) == {(16 // 4 * 32 // chunks // 2, 256)}, traced
