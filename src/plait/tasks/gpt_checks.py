"""A GPT experiment against its mesh: every divisibility the model and the batch need,
checked before anything is built, as one-line errors naming the key to change."""

from __future__ import annotations

import math
from dataclasses import replace

import jax

from plait import mesh as mesh_lib
from plait import sharding
from plait.config import Experiment, GPTConfig
from plait.errors import UserError
from plait.models import ModelDef

# What each logical dimension is in the config, for error messages, checked in
# this order so the most actionable key is named first.
_DIM_KEYS = {
    "heads": ("model.heads", lambda m: m.heads),
    "kv_heads": ("model.kv_heads", lambda m: m.n_kv_heads),
    "embed": ("model.d_model", lambda m: m.d_model),
    "mlp": ("model.d_ff", lambda m: m.d_ff),
    "head_dim": ("the head size (model.head_dim, or d_model / heads)", lambda m: m.head_size),
    "seq": ("model.seq_len", lambda m: m.seq_len),
    "vocab": ("the padded vocabulary", lambda m: m.padded_vocab),
    "experts": ("model.moe.experts", lambda m: m.moe.experts),
}


def context_attention(sizes: dict[str, int], asked: str) -> tuple[str, str]:
    """(the attention the context axis runs, why). A pipeline runs each rank's action in
    its own branch, and XLA's collective-permute is one operation over every device
    (a ring step inside a branch waits for ranks that are in another): under a
    pipeline the keys and values are gathered instead."""
    if sizes.get("context", 1) == 1:
        return asked, "no context axis"
    if asked == "ring" and sizes.get("pipeline", 1) > 1:
        return "allgather", "a ring's ppermute cannot run inside a pipeline stage's branch"
    return asked, "context.attention"


def decoder_rules(sizes: dict[str, int], model: GPTConfig,
                  context_attention: str = "ring") -> sharding.Rules:
    """The mesh's rule set for this decoder: key/value heads split over the axes that
    split the query heads where they divide kv_heads, and replicated per rank
    otherwise (each rank then projects every key/value head itself; with fewer key/value
    heads than tensor ranks there is nothing else to do, as in Megatron)."""
    rules = replace(sharding.rules_for_sizes(sizes), context_attention=context_attention)
    split = [a for a in sharding.axes_tuple(rules.get("kv_heads")) if sizes.get(a, 1) > 1]
    if model.n_kv_heads % math.prod(sizes[a] for a in split):
        return replace(sharding.with_names(rules, {"kv_heads": None, "act_kv_heads": None}),
                       held={"act_kv_heads": rules.get("act_kv_heads")})
    return rules


def _axes_text(axes: tuple[str, ...], n: int) -> str:
    return f"the {axes[0]} axis ({n})" if len(axes) == 1 else f"{' x '.join(axes)} = {n}"


def _check_batch(exp: Experiment, sizes: dict[str, int], rules: sharding.Rules) -> None:
    t, d = exp.train, exp.data
    if d.source == "synthetic" and d.successors > exp.model.vocab:
        raise UserError(f"data.successors = {d.successors:,} is more than the model.vocab = "
                        f"{exp.model.vocab} tokens a synthetic stream can go on to; pick at "
                        f"most {exp.model.vocab}")
    if t.global_batch % t.microbatches:
        raise UserError(f"train.global_batch = {t.global_batch} is not divisible by "
                        f"train.microbatches = {t.microbatches}")
    per_micro = t.global_batch // t.microbatches
    for split, n in sharding.batch_splits(rules, sizes):
        if per_micro % n:
            raise UserError(
                f"train.global_batch = {t.global_batch} does not split over {' x '.join(split)}"
                f" = {n} in each of train.microbatches = {t.microbatches}; make global_batch a "
                f"multiple of {n * t.microbatches}")


def check_fits(exp: Experiment, sizes: dict[str, int], rules: sharding.Rules,
               model: ModelDef) -> None:
    """Divisibility of the model and the batch by the mesh, as one-line errors.

    Every parameter dimension is checked against the mesh axes its rules split
    it over, so a new tensor mode needs no new checks here.
    """
    m = exp.model
    failures: dict[str, tuple[tuple[str, ...], int]] = {}
    for var in jax.tree.leaves(model.variables(), is_leaf=lambda v: hasattr(v, "get_metadata")):
        logical, fan_in = sharding.param_meta(var)
        for name, dim, axes in zip(logical, var.get_value().shape,
                                   rules.param_axes(logical, fan_in), strict=True):
            split = tuple(a for a in sharding.axes_tuple(axes) if sizes.get(a, 1) > 1)
            n = math.prod(sizes[a] for a in split)
            if dim % n and name not in failures:
                failures[name] = (split, n)
    for name, (key, get) in _DIM_KEYS.items():
        if name in failures:
            axes, n = failures[name]
            hint = (f"set model.vocab_multiple to a multiple of {n}" if name == "vocab"
                    else f"make it a multiple of {n}, or split it over fewer devices")
            raise UserError(f"{key} = {get(m)} is not divisible by {_axes_text(axes, n)}; {hint}")
    _check_context(exp, sizes, rules)
    _check_experts(exp, sizes, rules)
    _check_batch(exp, sizes, rules)


def _check_experts(exp: Experiment, sizes: dict[str, int], rules: sharding.Rules) -> None:
    """What a mixture of experts needs of the mesh and the run (one-line errors)."""
    X, moe = sizes.get("expert", 1), exp.model.moe
    if moe is None:
        if X > 1:
            raise UserError(f"the expert axis ({X}) splits a mixture of experts, and this "
                            "model has none; add a [model.moe] table or drop the axis")
        return
    if X > 1 and rules.mode not in (None, "1d"):
        raise UserError(f"the expert axis ({X}) runs with 1-D tensor parallelism or none, "
                        f"not {mesh_lib.MODE_NAMES[rules.mode]}; use tensor= instead of the "
                        "2-D / 3-D axes, or drop expert")
    if sizes.get("pipeline", 1) > 1 and moe.every > 1:
        raise UserError(f"model.moe.every = {moe.every} mixes dense and expert layers, and "
                        "pipeline stages hold one kind of block; set moe.every = 1 or drop "
                        "the pipeline axis")


def _check_context(exp: Experiment, sizes: dict[str, int], rules: sharding.Rules) -> None:
    C = sizes.get("context", 1)
    if C == 1:
        return
    if rules.mode not in (None, "1d"):
        raise UserError(f"the context axis ({C}) runs with 1-D tensor parallelism or none, "
                        f"not {mesh_lib.MODE_NAMES[rules.mode]}; use tensor= instead of "
                        "the 2-D / 3-D axes, or drop context")
    seq = exp.model.seq_len
    if seq % (2 * C):
        raise UserError(f"model.seq_len = {seq} does not split into 2 x context = {2 * C} "
                        f"equal chunks (the balanced causal layout); make it a multiple of "
                        f"{2 * C}")
    n = exp.model.loss_chunks
    if n > 1 and (seq // n) % C:
        raise UserError(f"model.loss_chunks = {n} leaves {seq // n} positions per piece, "
                        f"which context = {C} does not divide; use loss_chunks dividing "
                        f"seq_len / context = {seq // C}")


def memory_fixes(exp: Experiment, pipelined: bool) -> str:
    """What to change when a decoder's step does not fit the devices' memory (the end of
    plait.train.memory's one-line refusal), by what the experiment already sets."""
    m, fixes = exp.model, []
    if pipelined:
        fixes.append("lower train.global_batch, or raise pipeline.microbatches (smaller "
                     "microbatches in flight)")
    else:
        fixes.append(f"lower train.global_batch, or raise train.microbatches (now "
                     f"{exp.train.microbatches}: the same batch in that many passes, "
                     "gradients accumulated)")
    if m.remat != "full":
        fixes.append('set model.remat = "full" (activations recomputed in the backward)')
    if m.loss_chunks == 1 and m.vocab >= 8 * m.d_model:
        fixes.append("raise model.loss_chunks (the logits made in pieces)")
    fixes.append("split the model over more devices (fsdp, tensor, pipeline); plait sweep "
                 "--devices N ranks the shapes that fit")
    return ", or ".join(fixes[:-1]) + "; " + fixes[-1]
