"""The jitted train step of dense models: loss, gradient accumulation, clipping, update."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from plait import sharding
from plait.config import Experiment
from plait.models import fp8
from plait.train.state import StateLayout

# loss_fn(params, microbatch) -> scalar loss of the microbatch
LossFn = Callable[[dict, object], jax.Array]
# loss_and_grads(params, batch) -> (loss, grads), or (loss, grads, metrics): the whole
# batch at once (a pipeline), metrics a dict of scalars the step reports beside the loss
LossAndGrads = Callable[[dict, object], tuple]


# optax.tree.norm replaced optax.global_norm; keep both optax generations working.
global_norm = getattr(getattr(optax, "tree", None), "norm", None) or optax.global_norm

# Most bytes of gradient one stacked sum of squares reads (stacked_norm): a backend that
# materialised the stack would hold no more than this beside the gradients.
STACK_BYTES = 64 << 20


def stacked_norm(tree, shardings=None) -> jax.Array:
    """optax's global norm, its sums of squares taken over stacks of the leaves alike
    (shape, dtype and, given `shardings` -- a tree like `tree` -- sharding), up to
    STACK_BYTES a stack: one reduction per stack where optax's form launches one or two
    per leaf, most of them tiny kernels (gpt2-124m's 148 leaves: 198 of the step's 988
    kernels compiled for an H100; 24 now). Compiled for an H100, XLA fuses each stack
    into its reduction; each stack keeps its leaves' sharding on the stacked axes."""
    leaves = jax.tree.leaves(tree)
    specs = jax.tree.leaves(shardings) if shardings is not None else [None] * len(leaves)
    if len(specs) != len(leaves):
        raise ValueError(f"{len(leaves)} gradients but {len(specs)} shardings")
    groups: dict = {}
    for x, spec in zip(leaves, specs, strict=True):
        groups.setdefault((x.shape, x.dtype, spec), []).append(x)
    total = jnp.zeros((), jnp.float32)
    for (_, _, spec), xs in groups.items():
        per_stack = max(1, STACK_BYTES // max(1, xs[0].size * xs[0].dtype.itemsize))
        for i in range(0, len(xs), per_stack):
            part = xs[i:i + per_stack]
            x = part[0] if len(part) == 1 else _stacked(part, spec)
            total = total + jnp.sum(jnp.square(x.astype(jnp.float32)))
    return jnp.sqrt(total)


def _stacked(xs: list, spec) -> jax.Array:
    """The leaves `xs` stacked on a new leading axis, laid out as each of them is."""
    x = jnp.stack(xs)
    if isinstance(spec, NamedSharding):
        x = jax.lax.with_sharding_constraint(
            x, NamedSharding(spec.mesh, PartitionSpec(None, *spec.spec)))
    return x


def compute_dtype(exp: Experiment):
    return jnp.bfloat16 if exp.precision.compute == "bfloat16" else None


def clip_by_norm(grads, norm: jax.Array, max_norm: float):
    """optax.clip_by_global_norm with the norm given (a pipeline counts it its own way)."""
    if max_norm <= 0:
        return grads
    return jax.tree.map(lambda g: jnp.where(norm < max_norm, g, g / norm * max_norm), grads)


def accumulated(loss_fn: LossFn, pin: Callable, has_aux: bool = False) -> LossAndGrads:
    """Mean loss and gradients over the leading (microbatch) axis of every batch leaf,
    one microbatch at a time in a lax.scan (one pass when there is one). With `has_aux`
    loss_fn returns (loss, metrics) and the result is (loss, grads, metrics), each metric
    the mean over the microbatches."""
    grad_fn = jax.value_and_grad(loss_fn, has_aux=has_aux)

    def one(params, micro):
        value, grads = grad_fn(params, micro)
        loss, metrics = value if has_aux else (value, {})
        return loss, grads, metrics

    def loss_and_grads(params, batch):
        n_micro = jax.tree.leaves(batch)[0].shape[0]
        if n_micro == 1:
            loss, grads, metrics = one(params, jax.tree.map(lambda x: x[0], batch))
        else:
            def add(carry, micro):
                loss, grads, metrics = one(params, micro)
                return (carry[0] + loss, pin(fp8.accumulate(carry[1], grads)),
                        jax.tree.map(jnp.add, carry[2], metrics)), None

            zero_metrics = jax.tree.map(
                lambda s: jnp.zeros(s.shape, s.dtype),
                jax.eval_shape(one, params, jax.tree.map(lambda x: x[0], batch))[2])
            zeros = (jnp.zeros((), jnp.float32), pin(jax.tree.map(jnp.zeros_like, params)),
                     zero_metrics)
            (loss, grads, metrics), _ = jax.lax.scan(add, zeros, batch)
            loss, metrics = jax.tree.map(lambda a: a / n_micro, (loss, metrics))
            grads = fp8.mean(grads, n_micro)
        return (loss, grads, metrics) if has_aux else (loss, grads)

    return loss_and_grads


def skipping_nonfinite(step: Callable) -> Callable:
    """`step`, except that a step whose loss or gradient norm is NaN or Inf leaves the
    whole state as it was (train.on_nonfinite = "skip"): the batch is consumed, nothing
    is updated, and the metrics say so ("skipped": 1). The select reads the old state,
    so XLA may keep a copy of what the step updates in place (a DLRM's tables)."""
    def guarded(state, batch):
        new, metrics = step(state, batch)
        # Every replica's (local SGD: one value each), so all agree on what is skipped.
        ok = jnp.all(jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"]))
        kept = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, state)
        return kept, {**metrics, "skipped": (~ok).astype(jnp.int32)}
    return guarded


def dense_update(tx: optax.GradientTransformation, params, opt_state, grads, norm: jax.Array,
                 grad_clip: float):
    """(params, opt_state) after one optimizer step on the gradients clipped to
    `grad_clip` by their global norm `norm`."""
    updates, opt_state = tx.update(clip_by_norm(grads, norm, grad_clip), opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def jit_step(step: Callable, mesh: Mesh, lay: StateLayout, batch_sharding,
             skip_nonfinite: bool, per_replica: str | None = None,
             extra_metrics: tuple[str, ...] = ()):
    """jit(step)(state, batch) -> (state, metrics): the state donated and pinned to its
    shardings, every metric replicated (or, with `per_replica` a mesh axis, the loss and
    gradient norm one per replica over it: the host averages them, so a step that has
    no other reason to talk over that axis does not); with `skip_nonfinite`, behind the
    guard that leaves the state as it was after a NaN/Inf (skipping_nonfinite)."""
    keys = ("loss", "grad_norm", "lr") + (("skipped",) if skip_nonfinite else ()) \
        + extra_metrics
    metrics = dict.fromkeys(keys, sharding.replicated(mesh))
    if per_replica:
        split = NamedSharding(mesh, PartitionSpec(per_replica))
        metrics.update(loss=split, grad_norm=split, **dict.fromkeys(extra_metrics, split))
    return jax.jit(skipping_nonfinite(step) if skip_nonfinite else step,
                   in_shardings=(lay.shardings, batch_sharding),
                   out_shardings=(lay.shardings, metrics), donate_argnums=0)


def make_train_step(mesh: Mesh, lay: StateLayout, batch_sharding, tx: optax.GradientTransformation,
                    lr_schedule: optax.Schedule, grad_clip: float, loss_fn: LossFn | None = None,
                    loss_and_grads: LossAndGrads | None = None,
                    grad_norm: Callable | None = None, skip_nonfinite: bool = False,
                    extra_metrics: tuple[str, ...] = ()):
    """jit(step)(state, batch) -> (state, metrics), outputs pinned to the state's shardings.

    The state is {"step", "params", "opt_state"}; the gradients come from
    `loss_and_grads`, or by accumulating `loss_fn` over the batch's microbatches. With
    `extra_metrics`, loss_fn returns (loss, metrics) (loss_and_grads: loss, grads,
    metrics) and those metrics are reported with the step's. The gradient norm is
    `grad_norm`'s, by default stacked_norm's over the parameters' shardings.
    """
    def pin(grads):
        return jax.lax.with_sharding_constraint(grads, lay.params)

    loss_and_grads = loss_and_grads or accumulated(loss_fn, pin, has_aux=bool(extra_metrics))
    if grad_norm is None:
        def grad_norm(grads):
            return stacked_norm(grads, lay.params)

    def step(state, batch):
        params = state["params"]
        loss, grads, *more = loss_and_grads(params, batch)
        extra = more[0] if more else {}
        grads = pin(grads)
        # FP8 scaling state (models.fp8): its "gradient" is its next value, not trained.
        weight_grads = fp8.take(grads)
        norm = grad_norm(weight_grads)
        params, opt_state = dense_update(tx, params, state["opt_state"], weight_grads, norm,
                                         grad_clip)
        opt_state = fp8.kept_moments(tx, opt_state, state["opt_state"], params)
        params = fp8.put(params, grads, state["params"], state["step"])
        new_state = {"step": state["step"] + 1, "params": params, "opt_state": opt_state}
        return new_state, {"loss": loss, "grad_norm": norm, "lr": lr_schedule(state["step"]),
                           **{k: extra[k] for k in extra_metrics}}

    return jit_step(step, mesh, lay, batch_sharding, skip_nonfinite,
                    extra_metrics=extra_metrics)

