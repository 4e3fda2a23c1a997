"""Hugging Face checkpoints <-> plait's decoder: the `[model]` table from a
`config.json` and back, and each tensor's name and layout on both sides.

Four architectures map onto plait's one decoder: GPT2LMHeadModel (kind "gpt":
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

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from plait.errors import UserError
from plait.model_schema import GPTConfig

ARCHITECTURES = {
    "GPT2LMHeadModel": "gpt2",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "MixtralForCausalLM": "llama",
    "Qwen2MoeForCausalLM": "llama",
    "OlmoeForCausalLM": "llama",
}
DEFAULT_SEQ_LEN = 2048  # a RoPE model's training length unless --seq-len says otherwise

Path = tuple[str, ...]  # a parameter's place in plait's (canonical) parameter dict
Read = Callable[[str], np.ndarray]


def architecture(hf: dict, where: str) -> str:
    archs = hf.get("architectures") or []
    if not archs:
        raise UserError(f"{where} names no architecture (\"architectures\"); plait imports "
                        f"{', '.join(ARCHITECTURES)}")
    if archs[0] not in ARCHITECTURES:
        raise UserError(f"{where}: architecture {archs[0]} is not one plait imports; it "
                        f"imports {', '.join(ARCHITECTURES)}")
    return archs[0]


def _rope(hf: dict, where: str) -> tuple[float, dict | None]:
    """(theta, plait's rope_scaling table or None) from either spelling transformers uses
    (rope_theta + rope_scaling, or v5's rope_parameters)."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or params
    theta = float(hf.get("rope_theta") or params.get("rope_theta") or 10000.0)
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise UserError(f"{where}: rotary scaling '{kind}' is not one plait runs (it runs "
                        "none and Llama 3.1's 'llama3')")
    return theta, {"factor": float(scaling["factor"]),
                   "low_freq_factor": float(scaling["low_freq_factor"]),
                   "high_freq_factor": float(scaling["high_freq_factor"]),
                   "original_context": int(scaling["original_max_position_embeddings"])}


def model_table(hf: dict, where: str, seq_len: int | None = None) -> dict[str, Any]:
    """plait's `[model]` table for a Hugging Face config.json (one-line errors for what
    plait's decoder does not run)."""
    arch = architecture(hf, where)
    if ARCHITECTURES[arch] == "gpt2":
        act = hf.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise UserError(f"{where}: activation {act} is not GPT-2's tanh GELU, which plait "
                            "runs")
        d = hf["n_embd"]
        positions = hf.get("n_positions", 1024)
        if seq_len is not None and seq_len != positions:
            raise UserError(f"--seq-len {seq_len}: GPT-2's learned position table has "
                            f"{positions} rows; leave --seq-len out")
        return {"kind": "gpt", "layers": hf["n_layer"], "d_model": d, "heads": hf["n_head"],
                "d_ff": hf.get("n_inner") or 4 * d, "vocab": hf["vocab_size"],
                "seq_len": positions, "norm_eps": hf.get("layer_norm_epsilon", 1e-5),
                "tie_embeddings": True}
    if hf.get("hidden_act", "silu") != "silu":
        raise UserError(f"{where}: activation {hf['hidden_act']} is not SwiGLU's silu")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise UserError(f"{where}: {key} = true is not a layout plait's decoder has")
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    theta, scaling = _rope(hf, where)
    n = seq_len or min(hf.get("max_position_embeddings", DEFAULT_SEQ_LEN), DEFAULT_SEQ_LEN)
    window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
    if window and window < n:
        raise UserError(f"{where}: sliding-window attention ({window} tokens) is shorter than "
                        f"the sequence ({n}); plait attends the whole causal context, so "
                        f"pass --seq-len {window} or less")
    table: dict[str, Any] = {
        "kind": "llama", "layers": hf["num_hidden_layers"], "d_model": d, "heads": heads,
        "kv_heads": hf.get("num_key_value_heads") or heads, "d_ff": hf["intermediate_size"],
        "vocab": hf["vocab_size"], "seq_len": n, "norm_eps": hf.get("rms_norm_eps", 1e-6),
        "rope_theta": theta, "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "qkv_bias": arch == "Qwen2ForCausalLM" or (
            arch == "Qwen2MoeForCausalLM" and bool(hf.get("qkv_bias", True)))}
    head_dim = hf.get("head_dim")
    if head_dim and head_dim != d // heads:
        table["head_dim"] = head_dim
    if scaling:
        table["rope_scaling"] = scaling
    if arch == "MixtralForCausalLM":
        # Dropless, as transformers runs it; its training-time router noise is not kept.
        table["moe"] = {"experts": hf["num_local_experts"], "top_k": hf["num_experts_per_tok"],
                        "capacity_factor": 0.0,
                        "aux_weight": float(hf.get("router_aux_loss_coef", 0.001)),
                        "z_weight": 0.0}
    if arch == "Qwen2MoeForCausalLM":
        table["moe"] = _qwen_moe(hf, where)
    if arch == "OlmoeForCausalLM":
        if hf.get("clip_qkv") is not None:
            raise UserError(f"{where}: clip_qkv = {hf['clip_qkv']} clamps the query/key/value "
                            "projections, which plait's decoder does not; it imports OLMoE "
                            "with clip_qkv = null")
        table["qk_norm"] = True
        table["moe"] = {"experts": hf["num_experts"], "top_k": hf["num_experts_per_tok"],
                        "renormalize": bool(hf.get("norm_topk_prob", False)),
                        "capacity_factor": 0.0,
                        "aux_weight": float(hf.get("router_aux_loss_coef", 0.01)),
                        "z_weight": 0.0}
    return table


def _qwen_moe(hf: dict, where: str) -> dict[str, Any]:
    """A Qwen2-MoE's `[model.moe]`: dropless, as transformers runs it."""
    step, dense = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
    if step != 1 or dense:
        raise UserError(f"{where}: dense layers among the sparse ones (decoder_sparse_step = "
                        f"{step}, mlp_only_layers = {dense}) are not a layout plait imports; "
                        "it imports experts in every layer (step 1, no mlp_only_layers)")
    if not hf.get("shared_expert_intermediate_size"):
        raise UserError(f"{where}: shared_expert_intermediate_size = 0 leaves Qwen2-MoE's "
                        "shared expert gate nothing to gate; plait imports a shared expert")
    return {"experts": hf["num_experts"], "top_k": hf["num_experts_per_tok"],
            "d_ff": hf["moe_intermediate_size"],
            "shared_d_ff": hf["shared_expert_intermediate_size"], "shared_gate": True,
            "renormalize": bool(hf.get("norm_topk_prob", False)), "capacity_factor": 0.0,
            "aux_weight": float(hf.get("router_aux_loss_coef", 0.001)), "z_weight": 0.0}


def _family(cfg: GPTConfig) -> str:
    """Which Hugging Face layout holds this decoder, or a one-line refusal."""
    gpt2 = ("layernorm", "learned", "gelu", True, True, True)
    llama = ("rmsnorm", "rope", "swiglu", False)
    got = (cfg.norm, cfg.position, cfg.mlp, cfg.bias, cfg.fused_qkv, cfg.tie_embeddings)
    if cfg.qk_norm and cfg.moe is None:
        raise UserError("model.qk_norm without experts has no Hugging Face layout plait "
                        "writes (OLMoE, which it exports, has experts in every layer)")
    if got == gpt2 and not cfg.qkv_bias and not cfg.qk_norm:
        return "gpt2"
    if got[:4] == llama:
        return "llama"
    raise UserError("this decoder mixes GPT-2's and Llama's choices (model.norm, position, "
                    "mlp, bias), which no Hugging Face architecture holds; export GPT-2 "
                    "(layernorm, learned, gelu, biases, tied) or Llama layouts")


def hf_config(cfg: GPTConfig, dtype: str) -> dict[str, Any]:
    """config.json for `transformers` (GPT2LMHeadModel, or Qwen2ForCausalLM with q/k/v
    biases, else LlamaForCausalLM; with experts MixtralForCausalLM,
    Qwen2MoeForCausalLM with a gated shared expert, OlmoeForCausalLM with q/k norms)."""
    if _family(cfg) == "gpt2":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                "n_layer": cfg.layers, "n_embd": cfg.d_model, "n_head": cfg.heads,
                "n_inner": cfg.d_ff, "n_positions": cfg.seq_len, "n_ctx": cfg.seq_len,
                "vocab_size": cfg.vocab, "layer_norm_epsilon": cfg.norm_eps,
                "activation_function": "gelu_new", "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                "attn_pdrop": 0.0, "tie_word_embeddings": True, "torch_dtype": dtype}
    qwen, moe = cfg.qkv_bias, cfg.moe
    if moe is not None:
        arch, model_type = _moe_family(cfg)
    else:
        arch = "Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"
        model_type = "qwen2" if qwen else "llama"
    out: dict[str, Any] = {
        "architectures": [arch], "model_type": model_type,
        "num_hidden_layers": cfg.layers, "hidden_size": cfg.d_model,
        "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_size, "intermediate_size": cfg.d_ff, "vocab_size": cfg.vocab,
        "max_position_embeddings": cfg.seq_len, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "hidden_act": "silu",
        "tie_word_embeddings": cfg.tie_embeddings, "attention_dropout": 0.0,
        "torch_dtype": dtype}
    if model_type == "olmoe":
        out.update(num_experts=moe.experts, num_experts_per_tok=moe.top_k,
                   norm_topk_prob=moe.renormalize, router_aux_loss_coef=moe.aux_weight,
                   clip_qkv=None, attention_bias=False)
    elif moe is not None and model_type == "qwen2_moe":
        out.update(num_experts=moe.experts, num_experts_per_tok=moe.top_k,
                   moe_intermediate_size=cfg.expert_d_ff,
                   shared_expert_intermediate_size=moe.shared_d_ff,
                   norm_topk_prob=moe.renormalize, decoder_sparse_step=1, mlp_only_layers=[],
                   qkv_bias=qwen,
                   router_aux_loss_coef=moe.aux_weight, use_sliding_window=False,
                   sliding_window=None)
    elif moe is not None:
        out.update(num_local_experts=moe.experts, num_experts_per_tok=moe.top_k,
                   router_aux_loss_coef=moe.aux_weight, router_jitter_noise=0.0,
                   sliding_window=None)
    elif not qwen:
        out.update(attention_bias=False, mlp_bias=False)
    sc = cfg.rope_scaling
    if sc is not None:
        out["rope_scaling"] = {"rope_type": "llama3", "factor": sc.factor,
                               "low_freq_factor": sc.low_freq_factor,
                               "high_freq_factor": sc.high_freq_factor,
                               "original_max_position_embeddings": sc.original_context}
    return out


def _moe_family(cfg: GPTConfig) -> tuple[str, str]:
    """(architecture, model_type) of a mixture of experts, or a one-line refusal."""
    m = cfg.moe
    assert m is not None
    plain = m.every == 1 and not m.shared_d_ff and m.d_ff in (None, cfg.d_ff)
    if m.every == 1 and m.shared_d_ff and m.shared_gate and not cfg.qk_norm:
        return "Qwen2MoeForCausalLM", "qwen2_moe"
    if plain and cfg.qk_norm and not cfg.qkv_bias and cfg.heads * cfg.head_size == cfg.d_model:
        return "OlmoeForCausalLM", "olmoe"
    if plain and not cfg.qk_norm and not cfg.qkv_bias and m.renormalize:
        return "MixtralForCausalLM", "mixtral"
    raise UserError("Mixtral holds experts in every layer (moe.every = 1), no shared expert, "
                    "renormalised gates, moe.d_ff = d_ff and no q/k/v biases or q/k norms; "
                    "OLMoE the same with model.qk_norm and gates as they are or not; "
                    "Qwen2-MoE experts in every layer and a gated shared expert "
                    "(moe.shared_d_ff, moe.shared_gate = true); this mixture of experts is "
                    "none of them, so there is no Hugging Face layout plait writes")


def _pad(a: np.ndarray, rows: int, axis: int = 0) -> np.ndarray:
    """Zero rows (vocabulary padding) up to `rows` along `axis`."""
    extra = rows - a.shape[axis]
    if extra == 0:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, extra)
    return np.pad(a, widths)


def gpt2_prefix(names: set[str]) -> str:
    """GPT-2 checkpoints store their body with or without "transformer."."""
    return "transformer." if "transformer.wte.weight" in names else ""


def to_plait(cfg: GPTConfig, arch: str, read: Read, prefix: str = ""
             ) -> Iterator[tuple[Path, np.ndarray]]:
    """(plait path, array) for every parameter, reading one tensor at a time, in the
    stored dtype."""
    d, h, kv, hd, V = cfg.d_model, cfg.heads, cfg.n_kv_heads, cfg.head_size, cfg.padded_vocab
    if ARCHITECTURES[arch] == "gpt2":
        p = prefix
        yield ("tok_embed",), _pad(read(f"{p}wte.weight"), V)
        yield ("pos_embed",), read(f"{p}wpe.weight")
        for i in range(cfg.layers):
            b, blk = f"{p}h.{i}.", ("blocks", str(i))
            for hf_ln, ln in (("ln_1", "ln1"), ("ln_2", "ln2")):
                yield (*blk, ln, "scale"), read(f"{b}{hf_ln}.weight")
                yield (*blk, ln, "bias"), read(f"{b}{hf_ln}.bias")
            yield (*blk, "attn", "wqkv"), read(f"{b}attn.c_attn.weight").reshape(d, 3, h, hd)
            yield (*blk, "attn", "bqkv"), read(f"{b}attn.c_attn.bias").reshape(3, h, hd)
            yield (*blk, "attn", "wo"), read(f"{b}attn.c_proj.weight").reshape(h, hd, d)
            yield (*blk, "attn", "bo"), read(f"{b}attn.c_proj.bias")
            yield (*blk, "mlp", "w1"), read(f"{b}mlp.c_fc.weight")
            yield (*blk, "mlp", "b1"), read(f"{b}mlp.c_fc.bias")
            yield (*blk, "mlp", "w2"), read(f"{b}mlp.c_proj.weight")
            yield (*blk, "mlp", "b2"), read(f"{b}mlp.c_proj.bias")
        yield ("ln_f", "scale"), read(f"{p}ln_f.weight")
        yield ("ln_f", "bias"), read(f"{p}ln_f.bias")
        return
    yield ("tok_embed",), _pad(read("model.embed_tokens.weight"), V)
    for i in range(cfg.layers):
        b, blk = f"model.layers.{i}.", ("blocks", str(i))
        a = f"{b}self_attn."
        q = read(f"{a}q_proj.weight").T.reshape(d, h, hd)
        k, v = (read(f"{a}{n}_proj.weight").T.reshape(d, kv, hd) for n in ("k", "v"))
        if cfg.fused_qkv:
            yield (*blk, "attn", "wqkv"), np.stack([q, k, v], axis=1)
        else:
            yield (*blk, "attn", "wq"), q
            yield (*blk, "attn", "wkv"), np.stack([k, v], axis=1)
        del q, k, v
        if cfg.qkv_bias:
            bq = read(f"{a}q_proj.bias").reshape(h, hd)
            bk, bv = (read(f"{a}{n}_proj.bias").reshape(kv, hd) for n in ("k", "v"))
            if cfg.fused_qkv:
                yield (*blk, "attn", "bqkv"), np.stack([bq, bk, bv])
            else:
                yield (*blk, "attn", "bq"), bq
                yield (*blk, "attn", "bkv"), np.stack([bk, bv])
        yield (*blk, "attn", "wo"), read(f"{a}o_proj.weight").T.reshape(h, hd, d)
        if cfg.qk_norm:
            yield (*blk, "attn", "q_norm"), read(f"{a}q_norm.weight").reshape(h, hd)
            yield (*blk, "attn", "k_norm"), read(f"{a}k_norm.weight").reshape(kv, hd)
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
        yield ("head",), _pad(read("lm_head.weight").T, V, axis=1)


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

    if _family(cfg) == "gpt2":
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
            where, (g, u, dn) = MOE_NAMES[_moe_family(cfg)[0]]
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
