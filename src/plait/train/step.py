"""The jitted train step of dense models: loss, gradient accumulation, clipping, update."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from plait import sharding
from plait.config import Experiment
from plait.train.state import StateLayout

# loss_fn(params, microbatch) -> scalar loss of the microbatch
LossFn = Callable[[dict, object], jax.Array]
# loss_and_grads(params, batch) -> (loss, grads): the whole batch at once (a pipeline)
LossAndGrads = Callable[[dict, object], tuple[jax.Array, dict]]


def cross_entropy(logits: jax.Array, targets: jax.Array, vocab: int | None = None) -> jax.Array:
    """Mean token cross-entropy in float32.

    The label logit is picked with a masked sum rather than a gather, so a
    vocabulary sharded over devices costs one small all-reduce, not a gather of
    the logits. Logits at ids >= `vocab` (the padding of a vocabulary rounded up
    for sharding) are left out, so padding does not change the loss.
    """
    logits = logits.astype(jnp.float32)
    vocab_ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    if vocab is not None and vocab < logits.shape[-1]:
        logits = jnp.where(vocab_ids < vocab, logits, -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=-1)
    label_logit = jnp.sum(jnp.where(vocab_ids == targets[..., None], logits, 0.0), axis=-1)
    return jnp.mean(lse - label_logit)


# optax.tree.norm replaced optax.global_norm; keep both optax generations working.
global_norm = getattr(getattr(optax, "tree", None), "norm", None) or optax.global_norm


def compute_dtype(exp: Experiment):
    return jnp.bfloat16 if exp.precision.compute == "bfloat16" else None


def clip_by_norm(grads, norm: jax.Array, max_norm: float):
    """optax.clip_by_global_norm with the norm given (a pipeline counts it its own way)."""
    if max_norm <= 0:
        return grads
    return jax.tree.map(lambda g: jnp.where(norm < max_norm, g, g / norm * max_norm), grads)


def accumulated(loss_fn: LossFn, pin: Callable) -> LossAndGrads:
    """Mean loss and gradients over the leading (microbatch) axis of every batch leaf,
    one microbatch at a time in a lax.scan (one pass when there is one)."""
    grad_fn = jax.value_and_grad(loss_fn)

    def loss_and_grads(params, batch):
        n_micro = jax.tree.leaves(batch)[0].shape[0]
        if n_micro == 1:
            return grad_fn(params, jax.tree.map(lambda x: x[0], batch))

        def add(carry, micro):
            loss_sum, grad_sum = carry
            loss, grads = grad_fn(params, micro)
            return (loss_sum + loss, pin(jax.tree.map(jnp.add, grad_sum, grads))), None

        zeros = pin(jax.tree.map(jnp.zeros_like, params))
        (loss, grads), _ = jax.lax.scan(add, (jnp.zeros((), jnp.float32), zeros), batch)
        return loss / n_micro, jax.tree.map(lambda g: g / n_micro, grads)

    return loss_and_grads


def make_train_step(mesh: Mesh, lay: StateLayout, batch_sharding, tx: optax.GradientTransformation,
                    lr_schedule: optax.Schedule, grad_clip: float, loss_fn: LossFn | None = None,
                    loss_and_grads: LossAndGrads | None = None,
                    grad_norm: Callable = global_norm):
    """jit(step)(state, batch) -> (state, metrics), outputs pinned to the state's shardings.

    The state is {"step", "params", "opt_state"}; the gradients come from
    `loss_and_grads`, or by accumulating `loss_fn` over the batch's microbatches.
    """
    def pin(grads):
        return jax.lax.with_sharding_constraint(grads, lay.params)

    loss_and_grads = loss_and_grads or accumulated(loss_fn, pin)

    def step(state, batch):
        params = state["params"]
        loss, grads = loss_and_grads(params, batch)
        grads = pin(grads)
        norm = grad_norm(grads)
        grads = clip_by_norm(grads, norm, grad_clip)
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        new_state = {"step": state["step"] + 1, "params": optax.apply_updates(params, updates),
                     "opt_state": opt_state}
        return new_state, {"loss": loss, "grad_norm": norm, "lr": lr_schedule(state["step"])}

    replicated = sharding.replicated(mesh)
    return jax.jit(step, in_shardings=(lay.shardings, batch_sharding),
                   out_shardings=(lay.shardings, {"loss": replicated, "grad_norm": replicated,
                                                  "lr": replicated}),
                   donate_argnums=0)

