"""Decoder-only transformer (GPT-2 layout) in Flax NNX.

The model knows only logical axis names: each parameter carries
`logical_axes` metadata (and, for weights, `fan_in`: the dimensions a matmul
contracts), activations are pinned with `sharding.constrain`, and matmuls and
the embedding lookup go through `sharding.dense` / `sharding.lookup`. Which
mesh axes the names land on, and which tensor-parallel layer runs, is decided
in `plait.sharding` from the mesh.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from plait.config import GPTConfig
from plait.loss_mask import document_positions
from plait.models import (
    ATTENTION_NAMES,
    ModelDef,
    build,
    fp8,
    layer_list,
    layer_stack,
    module_values,
    remat_policy,
    stacked_layers,
)
from plait.models.activations import swiglu_halves
from plait.models.keys import ParamKeys
from plait.models.loss import chunked_cross_entropy, cross_entropy
from plait.models.moe import MoE, no_stats, sparse_layers, summarize
from plait.models.norms import norm, rms
from plait.models.params import param as _param
from plait.models.rope import rope_of, rotate
from plait.parallel.ops import (
    add_bias,
    attend,
    dense,
    dense_parts,
    dense_value,
    gathered_weight,
    gelu_mlp,
    lookup,
    sequence_positions,
    weight_grad_by_shard,
)
from plait.sharding import constrain

BATCH_SEQ_EMBED = ("act_batch", "act_seq", "act_embed")
LOGITS = ("act_batch", "act_seq", "act_vocab")
KV = tuple[jax.Array, jax.Array]  # one layer's cached keys and values, for sampling


def _bias(module: nnx.Module, name: str) -> jax.Array | float:
    """The module's bias `name`, or 0 where the model has none (model.bias, qkv_bias)."""
    return getattr(module, name)[...] if hasattr(module, name) else 0.0


def _scaling(module: nnx.Module, name: str) -> fp8.Scaling | None:
    """The FP8 scaling state of the module's matmul `name`, or None (precision.matmul)."""
    return None if module.fp8 is None else getattr(module.fp8, name)


HEADS = ("act_batch", "act_seq", "act_heads", "act_head_dim")
KV_HEADS = ("act_batch", "act_seq", "act_kv_heads", "act_head_dim")
KV_PAIR = ("act_batch", "act_seq", None, "act_kv_heads", "act_head_dim")


class Attention(nnx.Module):
    """Causal self-attention; query/key/value column-split and output row-split by head.

    Every head with its own keys and values: one fused projection [d, 3, heads, head].
    Grouped-query attention (kv_heads < heads): queries [d, heads, head] and keys and
    values [d, 2, kv_heads, head] apart, each group of heads / kv_heads query heads
    attending over one key/value head.
    """

    def __init__(self, cfg: GPTConfig, rngs: ParamKeys):
        d, h, kv, hd = cfg.d_model, cfg.heads, cfg.n_kv_heads, cfg.head_size
        resid_std = 0.02 / math.sqrt(2 * cfg.layers)
        biased = cfg.bias or cfg.qkv_bias
        if cfg.fused_qkv:
            self.wqkv = _param(rngs, (d, 3, h, hd), ("embed", "qkv", "heads", "head_dim"), 0.02,
                               fan_in=("embed",))
            if biased:
                self.bqkv = _param(rngs, (3, h, hd), ("qkv", "heads", "head_dim"), 0.0)
        else:
            self.wq = _param(rngs, (d, h, hd), ("embed", "heads", "head_dim"), 0.02,
                             fan_in=("embed",))
            self.wkv = _param(rngs, (d, 2, kv, hd), ("embed", "qkv", "kv_heads", "head_dim"),
                              0.02, fan_in=("embed",))
            if biased:
                self.bq = _param(rngs, (h, hd), ("heads", "head_dim"), 0.0)
                self.bkv = _param(rngs, (2, kv, hd), ("qkv", "kv_heads", "head_dim"), 0.0)
        self.wo = _param(rngs, (h, hd, d), ("heads", "head_dim", "embed"), resid_std,
                         fan_in=("heads", "head_dim"))
        if cfg.bias:
            self.bo = _param(rngs, (d,), ("norm",), 0.0)
        if cfg.qk_norm:
            k_heads = "heads" if cfg.fused_qkv else "kv_heads"
            self.q_norm = _param(rngs, (h, hd), ("heads", "head_dim"), None)
            self.k_norm = _param(rngs, (kv, hd), (k_heads, "head_dim"), None)
            self.norm_eps = cfg.norm_eps
        # "auto" is resolved by the task for the device (tasks.gpt_runtime.attention_for).
        self.implementation = None if cfg.attention == "auto" else cfg.attention
        self.fused = cfg.fused_qkv
        self.fp8 = fp8.scalings(("wqkv", "wo") if cfg.fused_qkv else ("wq", "wkv", "wo"),
                                cfg.fp8_history, cfg.fp8_kernel == "pallas")
        self.rope = rope_of(cfg)

    def qkv(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, ...]:
        """x [batch, T, d] at positions [T] -> q [batch, T, heads, head], k, v [batch, T,
        kv_heads, head], rotated when the model has rotary positions."""
        if self.fused:
            q, k, v = dense_parts(x, self.wqkv, "qkv", _scaling(self, "wqkv"),
                                  self.bqkv[...] if hasattr(self, "bqkv") else None)
        else:
            q = add_bias(dense(x, self.wq, _scaling(self, "wq")), _bias(self, "bq"))
            kv = add_bias(dense(x, self.wkv, _scaling(self, "wkv")), _bias(self, "bkv"))
            # split by kv head, not by the k/v pair: the slices' transposes (pads) must
            # not cross devices (ZB-H1's input-gradient pass, left to itself, split the
            # pair over tensor, and the pads became collective permutes inside the tick's
            # switch, where the other stage never joins them)
            kv = constrain(kv, KV_PAIR)
            k, v = kv[:, :, 0], kv[:, :, 1]
        if hasattr(self, "q_norm"):
            # OLMoE's q_norm / k_norm: every head's values together (split heads: an
            # all-reduce across their devices, GSPMD's)
            q, k = (rms(a, getattr(self, n), self.norm_eps, (-2, -1))
                    for a, n in ((q, "q_norm"), (k, "k_norm")))
        if self.rope is not None:
            q, k = rotate(q, positions, self.rope), rotate(k, positions, self.rope)
        kv_names = HEADS if self.fused else KV_HEADS
        return constrain(q, HEADS), constrain(k, kv_names), constrain(v, kv_names)

    def _projected(self, o: jax.Array) -> jax.Array:
        return dense(constrain(o, HEADS), self.wo, _scaling(self, "wo"))

    def out(self, o: jax.Array) -> jax.Array:
        return self._projected(o) + _bias(self, "bo")

    def _attended(self, x: jax.Array) -> jax.Array:
        # The position of each stored token: the natural order, or the balanced order of
        # a context axis (parallel.context), which the causal mask then follows.
        pos = sequence_positions(x.shape[1])
        q, k, v = self.qkv(x, jnp.arange(x.shape[1]) if pos is None else jnp.asarray(pos))
        # Named for the remat policies that keep attention and recompute the rest
        # (models.remat_policy); no-ops without one.
        q, k, v = (checkpoint_name(a, ATTENTION_NAMES[0]) for a in (q, k, v))
        return checkpoint_name(attend(q, k, v, pos, self.implementation), ATTENTION_NAMES[1])

    def __call__(self, x):
        o = self._attended(x)
        return constrain(checkpoint_name(self.out(o), ATTENTION_NAMES[2]), BATCH_SEQ_EMBED)

    def unbiased(self, x: jax.Array) -> tuple[jax.Array, jax.Array | float]:
        """(the output before its bias, the bias): for a norm that adds both to the
        residual stream itself (models.norms.LayerNorm.after_add)."""
        h = checkpoint_name(self._projected(self._attended(x)), ATTENTION_NAMES[2])
        return constrain(h, BATCH_SEQ_EMBED), _bias(self, "bo")

    def decode(self, x: jax.Array, cache: KV, pos: jax.Array) -> tuple[jax.Array, KV]:
        """Attention of x [batch, T, d] at positions pos .. pos + T - 1 over themselves and
        the cached keys and values of earlier positions (k, v [batch, max_len, kv_heads,
        head]); returns the output and the cache with these positions added."""
        q, k, v = self.qkv(x, pos + jnp.arange(x.shape[1]))
        keys, values = (jax.lax.dynamic_update_slice(c, new.astype(c.dtype), (0, pos, 0, 0))
                        for c, new in zip(cache, (k, v), strict=True))
        seen = jnp.arange(keys.shape[1])[None, :] <= pos + jnp.arange(x.shape[1])[:, None]
        o = jax.nn.dot_product_attention(q, keys.astype(q.dtype), values.astype(q.dtype),
                                         mask=seen[None, None], implementation="xla")
        return self.out(o), (keys, values)


class MLP(nnx.Module):
    """GPT-2's GELU MLP, or Llama's SwiGLU: silu(x W_gate) * (x W_up), one fused
    [d, 2, d_ff] projection for the gate and the up matrix, then W_down."""

    def __init__(self, cfg: GPTConfig, rngs: ParamKeys, d_ff: int | None = None):
        d, f = cfg.d_model, d_ff or cfg.d_ff
        self.swiglu = cfg.mlp == "swiglu"
        if self.swiglu:
            self.w13 = _param(rngs, (d, 2, f), ("embed", "gate_up", "mlp"), 0.02,
                              fan_in=("embed",))
        else:
            self.w1 = _param(rngs, (d, f), ("embed", "mlp"), 0.02, fan_in=("embed",))
            if cfg.bias:
                self.b1 = _param(rngs, (f,), ("mlp",), 0.0)
        self.w2 = _param(rngs, (f, d), ("mlp", "embed"), 0.02 / math.sqrt(2 * cfg.layers),
                         fan_in=("mlp",))
        if cfg.bias:
            self.b2 = _param(rngs, (d,), ("norm",), 0.0)
        self.fp8 = fp8.scalings(("w13", "w2") if self.swiglu else ("w1", "w2"),
                                cfg.fp8_history, cfg.fp8_kernel == "pallas")

    def __call__(self, x):
        if self.swiglu:
            h = swiglu_halves(dense(x, self.w13, _scaling(self, "w13")))
            h = constrain(h, ("act_batch", "act_seq", "act_mlp"))
            y = dense(h, self.w2, _scaling(self, "w2"))
        else:
            y = gelu_mlp(x, self.w1, _bias(self, "b1"), self.w2, _scaling(self, "w1"),
                         _scaling(self, "w2"))
        return constrain(y + _bias(self, "b2"), BATCH_SEQ_EMBED)


class Block(nnx.Module):
    """Attention then an MLP, each behind a pre-norm and a residual add. A sparse layer
    (model.moe, `sparse`) has a mixture of experts in place of the MLP; by default every
    block of a model with experts is one (stacked layers and pipeline stages hold one
    kind of block: moe.every = 1)."""

    def __init__(self, cfg: GPTConfig, rngs: ParamKeys, sparse: bool | None = None):
        self.ln1 = norm(cfg, rngs)
        self.attn = Attention(cfg, rngs)
        self.ln2 = norm(cfg, rngs)
        self.sparse = cfg.moe is not None if sparse is None else sparse
        if self.sparse:
            assert cfg.moe is not None
            shared = MLP(cfg, rngs, cfg.moe.shared_d_ff) if cfg.moe.shared_d_ff else None
            self.mlp = MoE(cfg, rngs, shared)
        else:
            self.mlp = MLP(cfg, rngs)

    def forward(self, x: jax.Array) -> tuple[jax.Array, dict | None]:
        """x -> (the block's output, its router figures; None for a dense block)."""
        if self.ln2.kernel_here():  # the attention's residual add and ln2 in one kernel
            x, y = self.ln2.after_add(x, *self.attn.unbiased(self.ln1(x)))
        else:
            x = x + self.attn(self.ln1(x))
            y = self.ln2(x)
        if self.sparse:
            h, stats = self.mlp(y)
            return x + h, stats
        return x + self.mlp(y), None

    def __call__(self, x):
        return self.forward(x)[0]

    def decode(self, x: jax.Array, cache: KV, pos: jax.Array) -> tuple[jax.Array, KV]:
        h, cache = self.attn.decode(self.ln1(x), cache, pos)
        x = x + h
        out = self.mlp(self.ln2(x))
        return x + (out[0] if self.sparse else out), cache


def _run_block(block: Block, x: jax.Array) -> tuple[jax.Array, dict]:
    x, stats = block.forward(x)
    return x, no_stats() if stats is None else stats


@functools.lru_cache(maxsize=8)
def _block_stack(config_cls: type[GPTConfig], config_json: str):
    return layer_stack(Block, config_cls.model_validate_json(config_json))


class GPT(nnx.Module):
    def __init__(self, cfg: GPTConfig, rngs: ParamKeys):
        v, d = cfg.padded_vocab, cfg.d_model
        # fan_in: the tied output head contracts the table's embed dimension.
        # Rows past model.vocab pad the table for sharding; no token uses them, and the
        # loss ignores their logits (models.loss.cross_entropy's `vocab`).
        self.tok_embed = _param(rngs, (v, d), ("vocab", "embed"), 0.02, fan_in=("embed",),
                                used=(cfg.vocab, d))
        self.learned_positions = cfg.position == "learned"
        if self.learned_positions:
            self.pos_embed = _param(rngs, (cfg.seq_len, d), ("seq", "embed"), 0.01)
        self.scan_layers = cfg.scan_layers is True and cfg.layers > 0
        if self.scan_layers:  # one Block whose parameters are stacked [layers, ...]
            self.blocks = stacked_layers(Block, cfg, rngs, cfg.layers)
            # for the scan body's one-layer graph
            self.config_cls, self.config_json = type(cfg), cfg.model_dump_json()
        else:
            self.blocks = nnx.List(layer_list(lambda k, sparse: Block(cfg, k, sparse), rngs,
                                              [cfg.is_sparse(i) for i in range(cfg.layers)]))
        self.sparse_layers = sparse_layers(cfg)
        self.ln_f = norm(cfg, rngs)
        if not cfg.tie_embeddings:
            self.head = _param(rngs, (d, v), ("embed", "vocab"), 0.02, fan_in=("embed",),
                               used=(d, cfg.vocab))
        self.tied = cfg.tie_embeddings
        self.remat = cfg.remat
        self.vocab, self.loss_chunks = cfg.vocab, cfg.loss_chunks
        self.loss_kernel = cfg.loss_kernel

    def _loop_blocks(self, x: jax.Array) -> tuple[jax.Array, dict]:
        total = no_stats()
        for block in self.blocks:
            x, stats = (nnx.remat(_run_block, policy=remat_policy(self.remat))(block, x)
                        if self.remat != "none" else _run_block(block, x))
            total = jax.tree.map(jnp.add, total, stats)
        return x, total

    def _scan_blocks(self, x: jax.Array) -> tuple[jax.Array, dict]:
        """One compiled block body under lax.scan over the stacked parameters: no copy
        of them per step, and compile time does not grow with depth."""
        stack = _block_stack(self.config_cls, self.config_json)
        return stack.apply_with_stats(module_values(self.blocks), x, no_stats())

    def embed(self, tokens: jax.Array) -> jax.Array:
        """tokens [batch, seq] (in the order `sequence_positions` gives) -> the residual
        stream entering the first block."""
        x = constrain(lookup(self.tok_embed, tokens), BATCH_SEQ_EMBED)
        if not self.learned_positions:  # rotary: positions enter each attention
            return x
        # packed documents (data.document_mask): each from position 0
        pos = document_positions()
        if pos is None:  # in the stored order under a context axis, else 0, 1, ...
            order = sequence_positions(tokens.shape[1])
            pos = jnp.arange(tokens.shape[1], dtype=jnp.int32) if order is None else order
        # One row per token, gathered, not [seq, embed] rows broadcast over the batch:
        # the broadcast's gradient, a sum over the batch, made XLA:GPU lay the whole
        # residual stream out batch-minor, and every matmul then transposed its input
        # (docs/architecture.md, "Position rows by gather"). Gathered from float32 so
        # that the gradient's scatter-add sums the batch's rows in float32. The table
        # whole on each device for the lookup (it is [seq, embed]): left sharded over
        # fsdp, XLA's SPMD partitioner warned on a data x fsdp mesh (the quickstart's)
        # that it could not partition the gather, for the same compiled program.
        pos = jnp.broadcast_to(jnp.asarray(pos), tokens.shape)
        table = constrain(self.pos_embed[...].astype(jnp.float32), (None, None))
        rows = jnp.take(table, pos, axis=0, mode="clip")
        return constrain(x + rows.astype(x.dtype), BATCH_SEQ_EMBED)

    def logits(self, x: jax.Array) -> jax.Array:
        """The residual stream after the last block -> logits [batch, seq, padded_vocab]."""
        logits = dense(self.ln_f(x), self.tok_embed if self.tied else self.head)
        return constrain(logits, LOGITS)

    def loss(self, x: jax.Array, targets: jax.Array) -> jax.Array:
        """The residual stream after the last block -> mean cross-entropy against
        targets [batch, seq], the logits formed in model.loss_chunks pieces of the
        tokens (models.loss) or all at once. With model.loss_kernel = "pallas" a single
        piece is formed as the pieces are: its loss and gradient come from one kernel
        that writes the gradient over the logits (models.loss._sum_and_gradient)."""
        if self.loss_chunks == 1 and self.loss_kernel != "pallas":
            return cross_entropy(self.logits(x), targets, self.vocab, self.loss_kernel)
        w = self.tok_embed if self.tied else self.head

        def project(h, value):
            return constrain(dense_value(h, w, value), LOGITS)

        return chunked_cross_entropy(project, self.ln_f(x), gathered_weight(w), targets,
                                     self.vocab, self.loss_chunks,
                                     weight_grad_by_shard(w, x.ndim), self.loss_kernel)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """tokens [batch, seq] -> logits [batch, seq, padded_vocab] in the compute dtype."""
        return self.forward(tokens)[0]

    def forward(self, tokens: jax.Array) -> tuple[jax.Array, dict]:
        """tokens -> (logits, the step's router metrics: empty without experts)."""
        x, metrics = self.hidden(tokens)
        return self.logits(x), metrics

    def hidden(self, tokens: jax.Array) -> tuple[jax.Array, dict]:
        """tokens -> (the residual stream after the last block, the router metrics)."""
        x = self.embed(tokens)
        x, stats = self._scan_blocks(x) if self.scan_layers else self._loop_blocks(x)
        return x, summarize(stats, self.sparse_layers) if self.sparse_layers else {}

    def decode(self, tokens: jax.Array, caches: list[KV], pos: jax.Array
               ) -> tuple[jax.Array, list[KV]]:
        """tokens [batch, T] at positions pos .. pos + T - 1, given every layer's cache of
        the earlier positions -> (logits [batch, T, padded_vocab], the extended caches).
        For sampling (plait sample); the layers one entry each (scan_layers = false)."""
        if self.scan_layers:
            raise ValueError("decode runs the per-layer model (scan_layers = false)")
        x = lookup(self.tok_embed, tokens)
        if self.learned_positions:
            x = x + jax.lax.dynamic_slice_in_dim(self.pos_embed[...], pos, tokens.shape[1])
        out = []
        for block, cache in zip(self.blocks, caches, strict=True):
            x, cache = block.decode(x, cache, pos)
            out.append(cache)
        return self.logits(x), out


def abstract_model(cfg: GPTConfig) -> ModelDef:
    """The decoder of `cfg` (GPT-2 or Llama layout), structure only (cached per config)."""
    return _abstract_model(type(cfg), cfg.model_dump_json())


@functools.lru_cache(maxsize=8)
def _abstract_model(cls: type[GPTConfig], cfg_json: str) -> ModelDef:
    return build(GPT, cls.model_validate_json(cfg_json))
