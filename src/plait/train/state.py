"""The train state (step, parameters, optimizer state), its shardings and its creation.

The state is a plain dict of pure-dict pytrees so it is canonical on disk and
the same whatever the mesh: resharding is only a matter of target shardings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from plait import sharding
from plait.config import Experiment, OptimizerConfig


def lr_schedule(opt: OptimizerConfig, steps: int) -> optax.Schedule:
    """Linear warmup from 0 to `lr` over `warmup_steps`, then `opt.schedule` down to
    `lr * min_lr_ratio` at `decay_steps` (train.steps unless set), flat after it."""
    decay = _decay_end(opt, steps)
    warmup, end = opt.warmup_steps, opt.lr * opt.min_lr_ratio
    if opt.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0 if warmup else opt.lr, peak_value=opt.lr,
            warmup_steps=warmup, decay_steps=decay, end_value=end)
    hold = _decay_start(opt, decay)
    if opt.schedule == "constant":
        end = opt.lr

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        ramp = jnp.clip((step - hold) / max(decay - hold, 1), 0.0, 1.0)
        return jnp.where(step < warmup, opt.lr * step / max(warmup, 1),
                         opt.lr + (end - opt.lr) * ramp)

    return schedule


def _decay_end(opt: OptimizerConfig, steps: int) -> int:
    """The step the learning rate reaches lr * min_lr_ratio: decay_steps, else the run's
    length, and never inside the warmup."""
    return max(opt.decay_steps or steps, opt.warmup_steps + 1)


def _decay_start(opt: OptimizerConfig, decay: int) -> int:
    """The step the learning rate starts down from lr (decay for "constant": never).
    wsd's cooldown is a fraction of the whole run, warmup included, at least one step."""
    if opt.schedule == "wsd":
        return decay - min(max(round(opt.cooldown_fraction * decay), 1),
                           decay - opt.warmup_steps)
    return decay if opt.schedule == "constant" else opt.warmup_steps


def schedule_text(opt: OptimizerConfig, steps: int) -> str:
    """The optimizer and its learning rate in words, for the run's header."""
    decay = _decay_end(opt, steps)
    warm = f"warmup {opt.warmup_steps} steps, then " if opt.warmup_steps else ""
    end = f"{opt.lr * opt.min_lr_ratio:.3g} at step {decay}"
    rest = {"constant": "constant", "wsd": f"held to step {_decay_start(opt, decay)}, then "
            f"linear to {end}"}.get(opt.schedule, f"{opt.schedule} to {end}")
    # A short run of a long config (a smoke test, --steps 10 with warmup 2000) never
    # reaches the lr it names; a loss that barely moves is then no sign of a bug.
    short = (f" (the run's {steps} step{'s end' if steps > 1 else ' ends'} inside the "
             f"warmup: the lr reaches "
             f"{opt.lr * (steps - 1) / opt.warmup_steps:.3g} at most)"
             if 0 < steps <= opt.warmup_steps else "")
    return f"{opt.name}, lr {opt.lr:.3g}: {warm}{rest}{short}"


def optimizer(exp: Experiment, decay_mask=None) -> tuple[optax.GradientTransformation,
                                                         optax.Schedule]:
    """(the dense optimizer, its learning-rate schedule). AdamW: no decay on vectors
    (norms, biases). Global-norm clipping happens in the
    step (train.step.clip_by_norm), so the optimizer state has one structure whatever
    the parallel layout and checkpoints move between layouts."""
    opt = exp.optimizer
    lr = lr_schedule(opt, exp.train.steps)
    if opt.name == "sgd":
        return optax.sgd(lr), lr
    if opt.name == "adagrad":
        return optax.adagrad(lr, initial_accumulator_value=opt.adagrad_initial,
                             eps=opt.eps), lr
    adamw = optax.adamw(
        lr, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=opt.weight_decay,
        mask=decay_mask or (lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)),
    )
    return adamw, lr


@dataclass(frozen=True)
class StateLayout:
    """Abstract shapes and shardings of the whole train state."""

    shapes: dict
    shardings: dict

    @property
    def params(self) -> dict:
        return self.shardings["params"]

    def abstract(self) -> dict:
        """ShapeDtypeStructs carrying the target shardings (for restore and AOT compile)."""
        return jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
            self.shapes, self.shardings,
        )


def layout(param_shapes: dict, param_shardings: dict, tx: optax.GradientTransformation,
           mesh: Mesh) -> StateLayout:
    """Shapes and shardings of {"step", "params", "opt_state"}: the optimizer's moments
    are laid out like their parameters, its scalars replicated."""
    opt_shapes = jax.eval_shape(tx.init, param_shapes)
    replicated = sharding.replicated(mesh)
    opt_sh = optax.tree_map_params(
        tx, lambda _, s: s, opt_shapes, param_shardings,
        transform_non_params=lambda _: replicated,
    )
    shapes = {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": param_shapes,
              "opt_state": opt_shapes}
    shardings = {"step": replicated, "params": param_shardings, "opt_state": opt_sh}
    return StateLayout(shapes, shardings)


def map_params(state: dict, is_params: Callable[[object], bool], fn: Callable[[dict], dict]
               ) -> dict:
    """Apply a params -> params conversion to the parameters and to every optimizer
    moment shaped like them (the subtrees `is_params` recognises)."""
    def walk(node):
        if is_params(node):
            return fn(node)
        if isinstance(node, tuple) and hasattr(node, "_fields"):
            return type(node)(*(walk(x) for x in node))
        if isinstance(node, (tuple, list)):
            return type(node)(walk(x) for x in node)
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        return node

    return {k: walk(v) if k in ("params", "opt_state") else v for k, v in state.items()}


def init_state(init_params: Callable[..., dict], tx: optax.GradientTransformation,
               lay: StateLayout, given: dict | None = None) -> dict:
    """A fresh state, created directly in its shards (never whole on one device). With
    `given` (parameters from elsewhere: imported weights), `init_params(given)` lays them
    out and the optimizer state starts fresh."""
    return init_program(init_params, tx, lay)(given)


def init_program(init_params: Callable[..., dict], tx: optax.GradientTransformation,
                 lay: StateLayout):
    """The jitted program of `init_state` (given -> state), for compiling ahead of time."""

    def init(given):
        params = init_params() if given is None else init_params(given)
        return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params)}

    return jax.jit(init, out_shardings=lay.shardings)
