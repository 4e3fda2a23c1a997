"""A decoder's small parameters (biases, norms' scales): the gradient norm summed over
stacks of like leaves (train.step.stacked_norm), LayerNorm's parameters kept in float32
when the model computes in bfloat16 (as PyTorch's autocast keeps them), the fused q/k/v
biases' gradient in one reduction (ops.add_part_biases)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from helpers import make_mesh, tiny

from plait.tasks.gpt import GPTTask
from plait.train import step


def _noisy(tree, seed: int = 0):
    """Values like gradients, one random draw per leaf."""
    keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(tree))))
    return jax.tree.map(lambda x: jax.random.normal(next(keys), x.shape, x.dtype) * 0.1, tree)


def _reductions(fn, *args) -> int:
    """reduce_sum equations in fn's trace (a new function each time: traces are cached)."""
    return sum(1 for e in jax.make_jaxpr(lambda *a: fn(*a))(*args).jaxpr.eqns
               if e.primitive.name == "reduce_sum")


def test_stacked_norm_is_optaxs_norm_with_one_reduction_a_stack(monkeypatch):
    """The value of optax's global norm, from one reduction per group of leaves alike
    (a 4-layer GPT: 9 groups for 68 leaves); capped stacks (STACK_BYTES) split a group
    and give the same value."""
    task = GPTTask(tiny(model={"layers": 4}), make_mesh("data=1"))
    grads = _noisy(task.init_state()["params"])
    leaves = jax.tree.leaves(grads)
    want = float(step.global_norm(grads))
    alike = {(x.shape, x.dtype) for x in leaves}
    assert len(alike) < len(leaves) / 4
    np.testing.assert_allclose(float(step.stacked_norm(grads)), want, rtol=1e-6)
    assert _reductions(step.stacked_norm, grads) == len(alike)
    assert _reductions(step.global_norm, grads) == len(leaves)
    # stacks of at most two [64, 128] float32 kernels: the MLP's two groups in two each
    monkeypatch.setattr(step, "STACK_BYTES", 2 * 64 * 128 * 4)
    np.testing.assert_allclose(float(step.stacked_norm(grads)), want, rtol=1e-6)
    assert _reductions(step.stacked_norm, grads) > len(alike)


def test_stacked_norm_moves_no_gradient_between_devices():
    """Across a data x fsdp x tensor mesh, leaves are stacked only with leaves laid out
    as they are and the stack keeps their layout: the compiled program sums where the
    gradients are and adds the sums up (all-reduce); no gradient is gathered or moved."""
    task = GPTTask(tiny(), make_mesh("data=2,fsdp=2,tensor=2"))
    shardings = task.layout.params
    grads = jax.device_put(_noisy(task.init_state()["params"]), shardings)
    norm = jax.jit(lambda g: step.stacked_norm(g, shardings))
    hlo = norm.lower(grads).compile().as_text()
    for moving in ("all-gather", "all-to-all", "collective-permute", "reduce-scatter"):
        assert moving not in hlo, moving
    assert "all-reduce" in hlo
    np.testing.assert_allclose(float(norm(grads)), float(step.global_norm(grads)),
                               rtol=1e-6)


def test_the_train_step_takes_the_stacked_norm(monkeypatch):
    """The step's gradient norm is stacked_norm's, over the parameters' shardings."""
    seen = []

    def spy(tree, shardings=None):
        seen.append(shardings)
        return step.global_norm(tree)

    monkeypatch.setattr(step, "stacked_norm", spy)
    task = GPTTask(tiny(), make_mesh("data=2"))
    task.step_fn.lower(task.layout.abstract(), task.abstract_batch())
    assert seen == [task.layout.params]


def test_norm_parameters_compute_in_float32_and_get_float32_gradients():
    """In a bfloat16 model LayerNorm's scales and biases stay float32 (their gradients
    are not rounded to bfloat16 on the way back); the matmul weights are cast."""
    exp = tiny(precision={"compute": "bfloat16"})
    task = GPTTask(exp, make_mesh("data=1"))
    params = task.init_state()["params"]
    module = task.model.module(params, jnp.bfloat16)
    block = module.blocks[0]
    assert block.ln1.scale[...].dtype == jnp.float32 and block.ln1.bias[...].dtype == jnp.float32
    assert module.ln_f.scale[...].dtype == jnp.float32
    assert block.mlp.w1[...].dtype == jnp.bfloat16

    tokens = jax.random.randint(jax.random.key(1), (4, exp.model.seq_len + 1), 0,
                                exp.model.vocab)
    grads = jax.jit(jax.grad(task.loss))(params, tokens)

    def bf16_exact(g):
        g = np.asarray(g, np.float32)
        return np.array_equal(g, np.asarray(g.astype(jnp.bfloat16), np.float32))

    assert bf16_exact(grads["blocks"]["0"]["mlp"]["w1"])
    assert not bf16_exact(grads["blocks"]["0"]["ln1"]["scale"])
    assert not bf16_exact(grads["ln_f"]["bias"])


def test_fused_qkv_biases_get_one_float32_gradient():
    """ops.add_part_biases: the q / k / v parts' biases, their gradient one reduction
    over the parts' stacked gradients in float32 (autodiff's: one per part, in the
    compute dtype), equal to the exact sums to within bfloat16's rounding."""
    from plait.parallel.ops import add_bias, add_part_biases

    k = jax.random.split(jax.random.key(2), 4)
    parts = tuple(jax.random.normal(k[i], (2, 5, 3, 4)).astype(jnp.bfloat16) for i in range(3))
    b = (0.1 * jax.random.normal(k[3], (3, 3, 4))).astype(jnp.bfloat16)
    cot = tuple(jnp.cos(p) for p in parts)

    def loss(f):
        return lambda ps, b: sum(jnp.sum((o * c).astype(jnp.float32))
                                 for o, c in zip(f(ps, b), cot, strict=True))

    def autodiff(ps, b):
        return tuple(add_bias(p, b[i]) for i, p in enumerate(ps))

    ours = add_part_biases(parts, b)
    for a, c in zip(ours, autodiff(parts, b), strict=True):
        np.testing.assert_array_equal(np.float32(a), np.float32(c))
    (gp, gb), (wp, wb) = (jax.grad(loss(f), (0, 1))(parts, b) for f in (add_part_biases, autodiff))
    for a, c in zip(gp, wp, strict=True):
        np.testing.assert_array_equal(np.float32(a), np.float32(c))
    exact = np.stack([np.float32(c).sum((0, 1)) for c in cot])
    np.testing.assert_allclose(np.float32(gb), exact, rtol=8e-3, atol=1e-2)
    assert gb.dtype == jnp.bfloat16 and gb.shape == b.shape
    ours, theirs = (_reductions(jax.grad(loss(f), 1), parts, b)
                    for f in (add_part_biases, autodiff))
    assert ours == 3 + 1 and theirs >= 3 + 3  # the loss's own three sums, and the bias's
