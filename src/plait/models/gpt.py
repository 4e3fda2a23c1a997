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

from plait.config import GPTConfig
from plait.models import layer_stack, module_values, remat_policy, stacked_layers
from plait.models.keys import ParamKeys
from plait.parallel.ops import dense, lookup
from plait.sharding import constrain

BATCH_SEQ_EMBED = ("act_batch", "act_seq", "act_embed")
KV = tuple[jax.Array, jax.Array]  # one layer's cached keys and values, for sampling


def _param(rngs: ParamKeys, shape, logical, std: float | None, fan_in=(),
           used: tuple[int, ...] | None = None) -> nnx.Param:
    """A parameter of `shape`; with `used`, only that leading block is drawn and the rest
    (vocabulary padding) is zeros, so the values do not depend on the padding."""
    if std is None:  # ones (norm scales)
        value = jnp.ones(shape, jnp.float32)
    elif std == 0.0:
        value = jnp.zeros(shape, jnp.float32)
    else:
        value = std * jax.random.normal(rngs.params(), used or shape, jnp.float32)
        value = jnp.pad(value, [(0, full - u) for full, u in zip(shape, value.shape,
                                                                   strict=True)])
    return nnx.Param(value, logical_axes=tuple(logical), fan_in=tuple(fan_in))


class LayerNorm(nnx.Module):
    """LayerNorm with statistics in float32 whatever the compute dtype."""

    def __init__(self, d: int, eps: float, rngs: ParamKeys):
        self.scale = _param(rngs, (d,), ("norm",), None)
        self.bias = _param(rngs, (d,), ("norm",), 0.0)
        self.eps = eps

    def __call__(self, x):
        dtype = x.dtype
        x = x.astype(jnp.float32)
        mean = x.mean(-1, keepdims=True)
        var = jnp.square(x - mean).mean(-1, keepdims=True)
        y = (x - mean) * jax.lax.rsqrt(var + self.eps)
        y = y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
        return y.astype(dtype)


class Attention(nnx.Module):
    """Causal self-attention; QKV column-split and output row-split by head."""

    def __init__(self, cfg: GPTConfig, rngs: ParamKeys):
        d, h = cfg.d_model, cfg.heads
        hd = d // h
        resid_std = 0.02 / math.sqrt(2 * cfg.layers)
        self.wqkv = _param(rngs, (d, 3, h, hd), ("embed", "qkv", "heads", "head_dim"), 0.02,
                           fan_in=("embed",))
        self.bqkv = _param(rngs, (3, h, hd), ("qkv", "heads", "head_dim"), 0.0)
        self.wo = _param(rngs, (h, hd, d), ("heads", "head_dim", "embed"), resid_std,
                         fan_in=("heads", "head_dim"))
        self.bo = _param(rngs, (d,), ("norm",), 0.0)
        # "auto" is resolved by the task for the device (tasks.gpt_runtime.attention_for).
        self.implementation = None if cfg.attention == "auto" else cfg.attention

    def __call__(self, x):
        qkv = dense(x, self.wqkv) + self.bqkv[...]
        q, k, v = (constrain(qkv[:, :, i], ("act_batch", "act_seq", "act_heads", "act_head_dim"))
                   for i in range(3))
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                         implementation=self.implementation)
        o = constrain(o, ("act_batch", "act_seq", "act_heads", "act_head_dim"))
        y = dense(o, self.wo) + self.bo[...]
        return constrain(y, BATCH_SEQ_EMBED)

    def decode(self, x: jax.Array, cache: KV, pos: jax.Array) -> tuple[jax.Array, KV]:
        """Attention of x [batch, T, d] at positions pos .. pos + T - 1 over themselves and
        the cached keys and values of earlier positions (k, v [batch, max_len, heads,
        head_dim]); returns the output and the cache with these positions added."""
        qkv = dense(x, self.wqkv) + self.bqkv[...]
        q, k, v = (qkv[:, :, i] for i in range(3))
        keys, values = (jax.lax.dynamic_update_slice(c, new.astype(c.dtype), (0, pos, 0, 0))
                        for c, new in zip(cache, (k, v), strict=True))
        seen = jnp.arange(keys.shape[1])[None, :] <= pos + jnp.arange(x.shape[1])[:, None]
        o = jax.nn.dot_product_attention(q, keys.astype(q.dtype), values.astype(q.dtype),
                                         mask=seen[None, None], implementation="xla")
        return dense(o, self.wo) + self.bo[...], (keys, values)


class MLP(nnx.Module):
    def __init__(self, cfg: GPTConfig, rngs: ParamKeys):
        d, f = cfg.d_model, cfg.d_ff
        self.w1 = _param(rngs, (d, f), ("embed", "mlp"), 0.02, fan_in=("embed",))
        self.b1 = _param(rngs, (f,), ("mlp",), 0.0)
        self.w2 = _param(rngs, (f, d), ("mlp", "embed"), 0.02 / math.sqrt(2 * cfg.layers),
                         fan_in=("mlp",))
        self.b2 = _param(rngs, (d,), ("norm",), 0.0)

    def __call__(self, x):
        h = dense(x, self.w1) + self.b1[...]
        h = constrain(jax.nn.gelu(h, approximate=True), ("act_batch", "act_seq", "act_mlp"))
        y = dense(h, self.w2) + self.b2[...]
        return constrain(y, BATCH_SEQ_EMBED)


class Block(nnx.Module):
    def __init__(self, cfg: GPTConfig, rngs: ParamKeys):
        self.ln1 = LayerNorm(cfg.d_model, cfg.norm_eps, rngs)
        self.attn = Attention(cfg, rngs)
        self.ln2 = LayerNorm(cfg.d_model, cfg.norm_eps, rngs)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))

    def decode(self, x: jax.Array, cache: KV, pos: jax.Array) -> tuple[jax.Array, KV]:
        h, cache = self.attn.decode(self.ln1(x), cache, pos)
        x = x + h
        return x + self.mlp(self.ln2(x)), cache


def _run_block(block: Block, x: jax.Array) -> jax.Array:
    return block(x)


@functools.lru_cache(maxsize=8)
def _block_stack(config_json: str):
    return layer_stack(Block, GPTConfig.model_validate_json(config_json))


class GPT(nnx.Module):
    def __init__(self, cfg: GPTConfig, rngs: ParamKeys):
        v, d = cfg.padded_vocab, cfg.d_model
        # fan_in: the tied output head contracts the table's embed dimension.
        # Rows past model.vocab pad the table for sharding; no token uses them, and the
        # loss ignores their logits (train.step.cross_entropy's `vocab`).
        self.tok_embed = _param(rngs, (v, d), ("vocab", "embed"), 0.02, fan_in=("embed",),
                                used=(cfg.vocab, d))
        self.pos_embed = _param(rngs, (cfg.seq_len, d), ("seq", "embed"), 0.01)
        self.scan_layers = cfg.scan_layers is True and cfg.layers > 0
        if self.scan_layers:  # one Block whose parameters are stacked [layers, ...]
            self.blocks = stacked_layers(Block, cfg, rngs, cfg.layers)
            self.config_json = cfg.model_dump_json()  # for the scan body's one-layer graph
        else:
            self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.layers)])
        self.ln_f = LayerNorm(d, cfg.norm_eps, rngs)
        if not cfg.tie_embeddings:
            self.head = _param(rngs, (d, v), ("embed", "vocab"), 0.02, fan_in=("embed",),
                               used=(d, cfg.vocab))
        self.tied = cfg.tie_embeddings
        self.remat = cfg.remat

    def _loop_blocks(self, x: jax.Array) -> jax.Array:
        for block in self.blocks:
            x = (nnx.remat(_run_block, policy=remat_policy(self.remat))(block, x)
                 if self.remat != "none" else block(x))
        return x

    def _scan_blocks(self, x: jax.Array) -> jax.Array:
        """One compiled block body under lax.scan over the stacked parameters: no copy
        of them per step, and compile time does not grow with depth."""
        return _block_stack(self.config_json).apply(module_values(self.blocks), x)

    def embed(self, tokens: jax.Array) -> jax.Array:
        """tokens [batch, seq] -> the residual stream entering the first block."""
        x = constrain(lookup(self.tok_embed, tokens), BATCH_SEQ_EMBED)
        return constrain(x + self.pos_embed[...][: tokens.shape[1]], BATCH_SEQ_EMBED)

    def logits(self, x: jax.Array) -> jax.Array:
        """The residual stream after the last block -> logits [batch, seq, padded_vocab]."""
        logits = dense(self.ln_f(x), self.tok_embed if self.tied else self.head)
        return constrain(logits, ("act_batch", "act_seq", "act_vocab"))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """tokens [batch, seq] -> logits [batch, seq, padded_vocab] in the compute dtype."""
        x = self.embed(tokens)
        x = self._scan_blocks(x) if self.scan_layers else self._loop_blocks(x)
        return self.logits(x)

    def decode(self, tokens: jax.Array, caches: list[KV], pos: jax.Array
               ) -> tuple[jax.Array, list[KV]]:
        """tokens [batch, T] at positions pos .. pos + T - 1, given every layer's cache of
        the earlier positions -> (logits [batch, T, padded_vocab], the extended caches).
        For sampling (plait sample); the layers one entry each (scan_layers = false)."""
        if self.scan_layers:
            raise ValueError("decode runs the per-layer model (scan_layers = false)")
        x = lookup(self.tok_embed, tokens)
        x = x + jax.lax.dynamic_slice_in_dim(self.pos_embed[...], pos, tokens.shape[1])
        out = []
        for block, cache in zip(self.blocks, caches, strict=True):
            x, cache = block.decode(x, cache, pos)
            out.append(cache)
        return self.logits(x), out


def param_count(cfg: GPTConfig) -> int:
    """Parameters of the model, counted from the config without building anything."""
    d, f, L, v = cfg.d_model, cfg.d_ff, cfg.layers, cfg.padded_vocab
    block = 4 * d * d + 2 * d * f + 9 * d + f  # qkv, out, mlp; their biases; two norms
    head = 0 if cfg.tie_embeddings else d * v
    return L * block + v * d + cfg.seq_len * d + 2 * d + head


def flops_per_token(cfg: GPTConfig) -> float:
    """Model FLOPs per trained token (forward + backward), PaLM-style.

    6 x (parameters in matrix multiplies, head included) + 12 x layers x seq x d_model
    for attention scores and values. Recomputation (remat) is not counted: this is
    model FLOPs, the numerator of MFU.
    """
    d, f, L = cfg.d_model, cfg.d_ff, cfg.layers
    matmul_params = L * (4 * d * d + 2 * d * f) + d * cfg.padded_vocab
    return 6.0 * matmul_params + 12.0 * L * cfg.seq_len * d
