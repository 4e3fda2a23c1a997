"""Hugging Face `config.json` <-> plait's `[model]` table: which architectures map onto
plait's one decoder (plait.hf.layout lists them and their tensors), the table for a
config.json with a one-line refusal for what the decoder does not run, and the
config.json an export writes.
"""

from __future__ import annotations

import json
from typing import Any

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


def architecture(hf: dict, where: str) -> str:
    archs = hf.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise UserError(f"{where}: \"architectures\" = {json.dumps(archs)} is not a list of "
                        f"names; plait imports {', '.join(ARCHITECTURES)}")
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
    for key in ("rope_parameters", "rope_scaling"):
        if hf.get(key) and not isinstance(hf[key], dict):
            raise UserError(f"{where}: {key} = {json.dumps(hf[key])} is not a table of rotary "
                            "settings (rope_type, rope_theta, ...)")
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


# The sizes and numbers model_table computes with before plait's schema sees them: a
# string, null, a boolean or (for a size) zero there was a TypeError or ZeroDivisionError.
SIZES = ("n_embd", "n_positions", "n_layer", "n_head", "n_inner", "vocab_size", "hidden_size",
         "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
         "sliding_window", "num_hidden_layers", "intermediate_size", "head_dim",
         "num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
         "shared_expert_intermediate_size", "decoder_sparse_step",
         "original_max_position_embeddings")
MAY_BE_ZERO = ("sliding_window", "shared_expert_intermediate_size")  # 0: none
NUMBERS = ("rope_theta", "rms_norm_eps", "layer_norm_epsilon", "router_aux_loss_coef",
           "factor", "low_freq_factor", "high_freq_factor")


def _check_values(hf: dict, where: str) -> None:
    """Each size a whole number >= 1 and each number a number, where given (null is
    "not given" for those transformers leaves optional), in config.json and in its rope
    scaling table: one line naming the key."""
    tables = [("", hf)] + [(f"{k}.", hf[k]) for k in ("rope_scaling", "rope_parameters")
                           if isinstance(hf.get(k), dict)]
    for prefix, table in tables:
        for key, value in table.items():
            # (a null is left only in the rope tables: model_table drops config.json's)
            if value is None or (key not in SIZES and key not in NUMBERS):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise UserError(f"{where}: {prefix}{key} = {json.dumps(value)} is not a number")
            least = 0 if key in MAY_BE_ZERO else 1
            if key in SIZES and (value != int(value) or value < least):
                raise UserError(f"{where}: {prefix}{key} = {json.dumps(value)} is not a size "
                                f"(a whole number, at least {least})")


def model_table(hf: dict, where: str, seq_len: int | None = None) -> dict[str, Any]:
    """plait's `[model]` table for a Hugging Face config.json (one-line errors for what
    plait's decoder does not run)."""
    arch = architecture(hf, where)
    hf = {k: v for k, v in hf.items() if v is not None}  # null: not given (optional keys)
    _check_values(hf, where)
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


def family(cfg: GPTConfig) -> str:
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
    if family(cfg) == "gpt2":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                "n_layer": cfg.layers, "n_embd": cfg.d_model, "n_head": cfg.heads,
                "n_inner": cfg.d_ff, "n_positions": cfg.seq_len, "n_ctx": cfg.seq_len,
                "vocab_size": cfg.vocab, "layer_norm_epsilon": cfg.norm_eps,
                "activation_function": "gelu_new", "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                "attn_pdrop": 0.0, "tie_word_embeddings": True, "torch_dtype": dtype}
    qwen, moe = cfg.qkv_bias, cfg.moe
    if moe is not None:
        arch, model_type = moe_family(cfg)
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


def moe_family(cfg: GPTConfig) -> tuple[str, str]:
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
