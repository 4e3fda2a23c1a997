"""Hugging Face checkpoints' tensors <-> plait's decoder parameters: each tensor's name
and layout on both sides (the config.json side is plait.hf.config_json).

The architectures map onto plait's one decoder: GPT2LMHeadModel (kind "gpt":
LayerNorm, learned positions, GELU, fused q/k/v stored as Conv1D [in, out]) and
LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM (kind "llama": RMSNorm,
rotary positions in the half-split layout, SwiGLU, grouped-query attention,
Qwen2's q/k/v biases; torch Linear weights stored [out, in]); MixtralForCausalLM is
the Llama layout with a dropless mixture of experts in every layer (its router
`block_sparse_moe.gate` [E, d], each expert's w1 (gate), w3 (up), w2 (down)), and
Qwen2MoeForCausalLM Qwen2's with one in every layer (router `mlp.gate`, experts'
gate/up/down_proj, the top-k probabilities as they are unless `norm_topk_prob`, and
a shared expert every token passes through, scaled by a sigmoid gate
`mlp.shared_expert_gate` [1, d]), and OlmoeForCausalLM the Llama layout with
RMS norms over the whole query and key projections (`self_attn.q_norm` /
`k_norm`) and experts in every layer (Qwen2-MoE's names, no shared expert, the
top-k probabilities as they are unless `norm_topk_prob`). Every conversion
is a reshape, a transpose, a stack or a vocabulary pad of one layer's tensors,
so import and export read and write one tensor (or one layer's q/k/v) at a
time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from plait.hf.config_json import ARCHITECTURES, family, moe_family
from plait.model_schema import GPTConfig

Path = tuple[str, ...]  # a parameter's place in plait's (canonical) parameter dict
Read = Callable[[str], np.ndarray]


class ShapeMismatch(ValueError):
    """A tensor that config.json's sizes do not fit (convert names it in one line)."""


def _shaped(a: np.ndarray, *shape: int) -> np.ndarray:
    """`a` in config.json's shape; ShapeMismatch where its size is another (heads or
    head_dim of 10**12 were numpy's reshape error)."""
    if a.size != math.prod(shape):
        raise ShapeMismatch(f"{a.shape} does not reshape to {shape}")
    return a.reshape(shape)


def _pad(a: np.ndarray, rows: int, vocab: int, axis: int = 0) -> np.ndarray:
    """Zero rows (vocabulary padding) up to `rows` along `axis`; a table of fewer rows
    than the vocabulary is refused before the padded copy is made (vocab_size = 10**12
    asked numpy for 233 TiB)."""
    if a.shape[axis] < vocab:
        raise ShapeMismatch(f"{a.shape[axis]} rows for a vocabulary of {vocab}")
    extra = rows - a.shape[axis]
    if extra == 0:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, extra)
    return np.pad(a, widths)


def gpt2_prefix(names: set[str]) -> str:
    """GPT-2 checkpoints store their body with or without "transformer."."""
    return "transformer." if "transformer.wte.weight" in names else ""


def layers_held(names: set[str], arch: str, prefix: str = "") -> int:
    """How many decoder layers a checkpoint's tensor names hold (one past the highest
    layer index): what config.json's layer count is checked against before a model of
    that depth is laid out."""
    head = f"{prefix}h." if ARCHITECTURES[arch] == "gpt2" else "model.layers."
    found = [int(n[len(head):].split(".", 1)[0]) for n in names
             if n.startswith(head) and n[len(head):].split(".", 1)[0].isdigit()]
    return max(found, default=-1) + 1


def to_plait(cfg: GPTConfig, arch: str, read: Read, prefix: str = ""
             ) -> Iterator[tuple[Path, np.ndarray]]:
    """(plait path, array) for every parameter, reading one tensor at a time, in the
    stored dtype."""
    d, h, kv, hd, V = cfg.d_model, cfg.heads, cfg.n_kv_heads, cfg.head_size, cfg.padded_vocab
    if ARCHITECTURES[arch] == "gpt2":
        p = prefix
        yield ("tok_embed",), _pad(read(f"{p}wte.weight"), V, cfg.vocab)
        yield ("pos_embed",), read(f"{p}wpe.weight")
        for i in range(cfg.layers):
            b, blk = f"{p}h.{i}.", ("blocks", str(i))
            for hf_ln, ln in (("ln_1", "ln1"), ("ln_2", "ln2")):
                yield (*blk, ln, "scale"), read(f"{b}{hf_ln}.weight")
                yield (*blk, ln, "bias"), read(f"{b}{hf_ln}.bias")
            yield (*blk, "attn", "wqkv"), _shaped(read(f"{b}attn.c_attn.weight"), d, 3, h, hd)
            yield (*blk, "attn", "bqkv"), _shaped(read(f"{b}attn.c_attn.bias"), 3, h, hd)
            yield (*blk, "attn", "wo"), _shaped(read(f"{b}attn.c_proj.weight"), h, hd, d)
            yield (*blk, "attn", "bo"), read(f"{b}attn.c_proj.bias")
            yield (*blk, "mlp", "w1"), read(f"{b}mlp.c_fc.weight")
            yield (*blk, "mlp", "b1"), read(f"{b}mlp.c_fc.bias")
            yield (*blk, "mlp", "w2"), read(f"{b}mlp.c_proj.weight")
            yield (*blk, "mlp", "b2"), read(f"{b}mlp.c_proj.bias")
        yield ("ln_f", "scale"), read(f"{p}ln_f.weight")
        yield ("ln_f", "bias"), read(f"{p}ln_f.bias")
        return
    yield ("tok_embed",), _pad(read("model.embed_tokens.weight"), V, cfg.vocab)
    for i in range(cfg.layers):
        b, blk = f"model.layers.{i}.", ("blocks", str(i))
        a = f"{b}self_attn."
        q = _shaped(read(f"{a}q_proj.weight").T, d, h, hd)
        k, v = (_shaped(read(f"{a}{n}_proj.weight").T, d, kv, hd) for n in ("k", "v"))
        if cfg.fused_qkv:
            yield (*blk, "attn", "wqkv"), np.stack([q, k, v], axis=1)
        else:
            yield (*blk, "attn", "wq"), q
            yield (*blk, "attn", "wkv"), np.stack([k, v], axis=1)
        del q, k, v
        if cfg.qkv_bias:
            bq = _shaped(read(f"{a}q_proj.bias"), h, hd)
            bk, bv = (_shaped(read(f"{a}{n}_proj.bias"), kv, hd) for n in ("k", "v"))
            if cfg.fused_qkv:
                yield (*blk, "attn", "bqkv"), np.stack([bq, bk, bv])
            else:
                yield (*blk, "attn", "bq"), bq
                yield (*blk, "attn", "bkv"), np.stack([bk, bv])
        yield (*blk, "attn", "wo"), _shaped(read(f"{a}o_proj.weight").T, h, hd, d)
        if cfg.qk_norm:
            yield (*blk, "attn", "q_norm"), _shaped(read(f"{a}q_norm.weight"), h, hd)
            yield (*blk, "attn", "k_norm"), _shaped(read(f"{a}k_norm.weight"), kv, hd)
        if cfg.moe is not None:
            yield from _experts_to_plait(cfg, read, b, blk, arch)
        else:
            gate, up = (read(f"{b}mlp.{n}_proj.weight").T for n in ("gate", "up"))
            yield (*blk, "mlp", "w13"), np.stack([gate, up], axis=1)
            del gate, up
            yield (*blk, "mlp", "w2"), read(f"{b}mlp.down_proj.weight").T
        yield (*blk, "ln1", "scale"), read(f"{b}input_layernorm.weight")
        yield (*blk, "ln2", "scale"), read(f"{b}post_attention_layernorm.weight")
    yield ("ln_f", "scale"), read("model.norm.weight")
    if not cfg.tie_embeddings:
        yield ("head",), _pad(read("lm_head.weight").T, V, cfg.vocab, axis=1)


# Where each MoE family keeps a layer's router and experts: (module prefix, the
# experts' gate, up and down projections).
MOE_NAMES = {"MixtralForCausalLM": ("block_sparse_moe.", ("w1", "w3", "w2")),
             "Qwen2MoeForCausalLM": ("mlp.", ("gate_proj", "up_proj", "down_proj")),
             "OlmoeForCausalLM": ("mlp.", ("gate_proj", "up_proj", "down_proj"))}


def _experts_to_plait(cfg: GPTConfig, read: Read, b: str, blk: Path, arch: str
                      ) -> Iterator[tuple[Path, np.ndarray]]:
    """A sparse layer's router and experts (and shared expert): each of plait's stacked
    expert tensors read from the experts' own, one at a time."""
    assert cfg.moe is not None
    where, (g, u, dn) = MOE_NAMES[arch]
    m, E = f"{b}{where}", cfg.moe.experts
    yield (*blk, "mlp", "router"), read(f"{m}gate.weight").T
    w13 = None
    for e in range(E):
        gate, up = (read(f"{m}experts.{e}.{n}.weight").T for n in (g, u))
        if w13 is None:
            w13 = np.empty((E, gate.shape[0], 2, gate.shape[1]), gate.dtype)
        w13[e, :, 0], w13[e, :, 1] = gate, up
    yield (*blk, "mlp", "w13"), w13
    del w13
    down = [read(f"{m}experts.{e}.{dn}.weight").T for e in range(E)]
    yield (*blk, "mlp", "w2"), np.stack(down)
    if cfg.moe.shared_d_ff:
        s = f"{m}shared_expert."
        gate, up = (read(f"{s}{n}_proj.weight").T for n in ("gate", "up"))
        yield (*blk, "mlp", "shared", "w13"), np.stack([gate, up], axis=1)
        yield (*blk, "mlp", "shared", "w2"), read(f"{s}down_proj.weight").T
        yield (*blk, "mlp", "shared_gate"), read(f"{m}shared_expert_gate.weight").reshape(-1)


def to_hf(cfg: GPTConfig, params: dict) -> Iterator[tuple[str, np.ndarray]]:
    """(Hugging Face name, array) for every tensor of the checkpoint `transformers`
    loads, from plait's canonical parameters; the vocabulary padding dropped."""
    d, h, kv, hd, V = cfg.d_model, cfg.heads, cfg.n_kv_heads, cfg.head_size, cfg.vocab

    def get(*path: str) -> np.ndarray:
        node: Any = params
        for k in path:
            node = node[k]
        return np.asarray(node)

    if family(cfg) == "gpt2":
        p = "transformer."
        yield f"{p}wte.weight", get("tok_embed")[:V]
        yield f"{p}wpe.weight", get("pos_embed")
        for i in range(cfg.layers):
            b, blk = f"{p}h.{i}.", ("blocks", str(i))
            for hf_ln, ln in (("ln_1", "ln1"), ("ln_2", "ln2")):
                yield f"{b}{hf_ln}.weight", get(*blk, ln, "scale")
                yield f"{b}{hf_ln}.bias", get(*blk, ln, "bias")
            yield f"{b}attn.c_attn.weight", get(*blk, "attn", "wqkv").reshape(d, 3 * h * hd)
            yield f"{b}attn.c_attn.bias", get(*blk, "attn", "bqkv").reshape(3 * h * hd)
            yield f"{b}attn.c_proj.weight", get(*blk, "attn", "wo").reshape(h * hd, d)
            yield f"{b}attn.c_proj.bias", get(*blk, "attn", "bo")
            yield f"{b}mlp.c_fc.weight", get(*blk, "mlp", "w1")
            yield f"{b}mlp.c_fc.bias", get(*blk, "mlp", "b1")
            yield f"{b}mlp.c_proj.weight", get(*blk, "mlp", "w2")
            yield f"{b}mlp.c_proj.bias", get(*blk, "mlp", "b2")
        yield f"{p}ln_f.weight", get("ln_f", "scale")
        yield f"{p}ln_f.bias", get("ln_f", "bias")
        return
    yield "model.embed_tokens.weight", get("tok_embed")[:V]
    for i in range(cfg.layers):
        b, blk = f"model.layers.{i}.", ("blocks", str(i))
        a = f"{b}self_attn."
        if cfg.fused_qkv:
            qkv = get(*blk, "attn", "wqkv")
            q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        else:
            q, kv_w = get(*blk, "attn", "wq"), get(*blk, "attn", "wkv")
            k, v = kv_w[:, 0], kv_w[:, 1]
        yield f"{a}q_proj.weight", np.ascontiguousarray(q.reshape(d, h * hd).T)
        yield f"{a}k_proj.weight", np.ascontiguousarray(k.reshape(d, kv * hd).T)
        yield f"{a}v_proj.weight", np.ascontiguousarray(v.reshape(d, kv * hd).T)
        if cfg.qkv_bias:
            if cfg.fused_qkv:
                bqkv = get(*blk, "attn", "bqkv")
                bq, bk, bv = bqkv[0], bqkv[1], bqkv[2]
            else:
                bq, bkv = get(*blk, "attn", "bq"), get(*blk, "attn", "bkv")
                bk, bv = bkv[0], bkv[1]
            yield f"{a}q_proj.bias", bq.reshape(h * hd)
            yield f"{a}k_proj.bias", bk.reshape(kv * hd)
            yield f"{a}v_proj.bias", bv.reshape(kv * hd)
        yield f"{a}o_proj.weight", np.ascontiguousarray(
            get(*blk, "attn", "wo").reshape(h * hd, d).T)
        if cfg.qk_norm:
            yield f"{a}q_norm.weight", get(*blk, "attn", "q_norm").reshape(h * hd)
            yield f"{a}k_norm.weight", get(*blk, "attn", "k_norm").reshape(kv * hd)
        w13 = get(*blk, "mlp", "w13")
        if cfg.moe is not None:
            where, (g, u, dn) = MOE_NAMES[moe_family(cfg)[0]]
            m = f"{b}{where}"
            yield f"{m}gate.weight", np.ascontiguousarray(get(*blk, "mlp", "router").T)
            w2 = get(*blk, "mlp", "w2")
            for e in range(cfg.moe.experts):
                x = f"{m}experts.{e}."
                yield f"{x}{g}.weight", np.ascontiguousarray(w13[e, :, 0].T)
                yield f"{x}{u}.weight", np.ascontiguousarray(w13[e, :, 1].T)
                yield f"{x}{dn}.weight", np.ascontiguousarray(w2[e].T)
            if cfg.moe.shared_d_ff:
                s, sw13 = f"{m}shared_expert.", get(*blk, "mlp", "shared", "w13")
                yield f"{s}gate_proj.weight", np.ascontiguousarray(sw13[:, 0].T)
                yield f"{s}up_proj.weight", np.ascontiguousarray(sw13[:, 1].T)
                yield f"{s}down_proj.weight", np.ascontiguousarray(
                    get(*blk, "mlp", "shared", "w2").T)
                yield f"{m}shared_expert_gate.weight", get(*blk, "mlp", "shared_gate")[None]
        else:
            yield f"{b}mlp.gate_proj.weight", np.ascontiguousarray(w13[:, 0].T)
            yield f"{b}mlp.up_proj.weight", np.ascontiguousarray(w13[:, 1].T)
            yield f"{b}mlp.down_proj.weight", np.ascontiguousarray(get(*blk, "mlp", "w2").T)
        yield f"{b}input_layernorm.weight", get(*blk, "ln1", "scale")
        yield f"{b}post_attention_layernorm.weight", get(*blk, "ln2", "scale")
    yield "model.norm.weight", get("ln_f", "scale")
    if not cfg.tie_embeddings:
        yield "lm_head.weight", np.ascontiguousarray(get("head")[:, :V].T)
