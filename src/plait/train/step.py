"""The jitted train step: loss, gradient accumulation, clipping, AdamW update."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding

from plait import sharding
from plait.config import Experiment
from plait.models import ModelDef
from plait.train.state import StateLayout


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean token cross-entropy in float32.

    The label logit is picked with a masked sum rather than a gather, so a
    vocabulary sharded over devices costs one small all-reduce, not a gather of
    the logits.
    """
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    vocab_ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    label_logit = jnp.sum(jnp.where(vocab_ids == targets[..., None], logits, 0.0), axis=-1)
    return jnp.mean(lse - label_logit)


# optax.tree.norm replaced optax.global_norm; keep both optax generations working.
_global_norm = getattr(getattr(optax, "tree", None), "norm", None) or optax.global_norm


def compute_dtype(exp: Experiment):
    return jnp.bfloat16 if exp.precision.compute == "bfloat16" else None


def clip_by_norm(grads, norm: jax.Array, max_norm: float):
    """optax.clip_by_global_norm with the norm given (a pipeline counts it its own way)."""
    if max_norm <= 0:
        return grads
    return jax.tree.map(lambda g: jnp.where(norm < max_norm, g, g / norm * max_norm), grads)


def make_train_step(model: ModelDef, exp: Experiment, mesh: Mesh, rules: sharding.Rules,
                    tx: optax.GradientTransformation, schedule: optax.Schedule,
                    lay: StateLayout, batch_sharding: NamedSharding, pipe=None):
    """jit(step)(state, batch) -> (state, metrics), outputs pinned to the state's shardings.

    With `pipe` (a train.pipelined.Pipelined) the loss and gradients come from the
    pipeline executor over the whole batch of pipeline microbatches.
    """
    dtype = compute_dtype(exp)

    def loss_fn(params, tokens):
        with sharding.use(mesh, rules):
            logits = model.apply(params, tokens[:, :-1], dtype)
        return cross_entropy(logits, tokens[:, 1:])

    grad_fn = jax.value_and_grad(loss_fn)

    def pin(grads):
        return jax.lax.with_sharding_constraint(grads, lay.params)

    def step(state, batch):
        params = state["params"]
        n_micro = batch.shape[0]
        if pipe is not None:
            with sharding.use(mesh, rules):
                loss, grads = pipe.loss_and_grads(params, batch, dtype, cross_entropy)
        elif n_micro == 1:
            loss, grads = grad_fn(params, batch[0])
        else:
            def accumulate(carry, tokens):
                loss_sum, grad_sum = carry
                loss, grads = grad_fn(params, tokens)
                return (loss_sum + loss, pin(jax.tree.map(jnp.add, grad_sum, grads))), None

            zeros = pin(jax.tree.map(jnp.zeros_like, params))
            (loss, grads), _ = jax.lax.scan(accumulate, (jnp.zeros((), jnp.float32), zeros), batch)
            loss = loss / n_micro
            grads = jax.tree.map(lambda g: g / n_micro, grads)
        grads = pin(grads)
        grad_norm = pipe.grad_norm(grads) if pipe is not None else _global_norm(grads)
        grads = clip_by_norm(grads, grad_norm, exp.optimizer.grad_clip)
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        new_state = {
            "step": state["step"] + 1,
            "params": optax.apply_updates(params, updates),
            "opt_state": opt_state,
        }
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": schedule(state["step"])}
        return new_state, metrics

    replicated = sharding.replicated(mesh)
    return jax.jit(
        step,
        in_shardings=(lay.shardings, batch_sharding),
        out_shardings=(lay.shardings, {"loss": replicated, "grad_norm": replicated,
                                       "lr": replicated}),
        donate_argnums=0,
    )
