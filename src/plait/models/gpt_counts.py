"""Parameter and FLOP counts of the decoder (plait.models.gpt), from its config alone:
the sweep, the too-big-model check and MFU use them without building a model, and
the tests hold them equal to the built model and the compiled step."""

from __future__ import annotations

from plait.config import GPTConfig


def _matmul_params(cfg: GPTConfig) -> tuple[int, int]:
    """(attention, MLP) weights of one dense block: queries, keys and values (kv_heads of
    them), the output projection; two or three (SwiGLU) d_model x d_ff matrices."""
    d, f, hd = cfg.d_model, cfg.d_ff, cfg.head_size
    attn = d * (cfg.heads + 2 * cfg.n_kv_heads) * hd + cfg.heads * hd * d
    return attn, _mats(cfg) * d * f


def _mats(cfg: GPTConfig) -> int:
    return 3 if cfg.mlp == "swiglu" else 2


def _sparse_mlp(cfg: GPTConfig, experts: int) -> int:
    """Matmul weights of a sparse layer's MLP side with `experts` of its experts: theirs,
    the router's and the shared expert's (and its gate's)."""
    m = cfg.moe
    assert m is not None
    d = cfg.d_model
    return experts * _mats(cfg) * d * cfg.expert_d_ff + d * m.experts \
        + _mats(cfg) * d * m.shared_d_ff + (d if m.shared_gate else 0)


def _mlp_biases(cfg: GPTConfig, f: int) -> int:
    """Biases of a dense MLP of hidden size f (GPT-2 layout; SwiGLU has only the output's)."""
    if not cfg.bias or not f:
        return 0
    return cfg.d_model + (0 if cfg.mlp == "swiglu" else f)


def param_count(cfg: GPTConfig) -> int:
    """Parameters of the model, counted from the config without building anything."""
    d, L, v, hd = cfg.d_model, cfg.layers, cfg.padded_vocab, cfg.head_size
    attn, mlp = _matmul_params(cfg)
    norm_params = d * (2 if cfg.bias and cfg.norm == "layernorm" else 1)
    qkv_bias = (cfg.heads + 2 * cfg.n_kv_heads) * hd if cfg.bias or cfg.qkv_bias else 0
    qk_norm = (cfg.heads + cfg.n_kv_heads) * hd if cfg.qk_norm else 0
    attn_block = attn + qkv_bias + qk_norm + (d if cfg.bias else 0) + 2 * norm_params
    S = cfg.sparse_count
    total = L * attn_block + (L - S) * (mlp + _mlp_biases(cfg, cfg.d_ff))
    if cfg.moe is not None:
        total += S * (_sparse_mlp(cfg, cfg.moe.experts) + _mlp_biases(cfg, cfg.moe.shared_d_ff))
    head = 0 if cfg.tie_embeddings else d * v
    positions = cfg.seq_len * d if cfg.position == "learned" else 0
    return total + v * d + positions + norm_params + head


def active_matmul_params(cfg: GPTConfig) -> int:
    """Weights in the matrix multiplies one token passes through (head included): a
    sparse layer counts its router, its top_k experts and its shared expert."""
    attn, mlp = _matmul_params(cfg)
    L, S = cfg.layers, cfg.sparse_count
    sparse = S * _sparse_mlp(cfg, cfg.moe.top_k) if cfg.moe is not None else 0
    return L * attn + (L - S) * mlp + sparse + cfg.d_model * cfg.padded_vocab


def flops_per_token(cfg: GPTConfig) -> float:
    """Model FLOPs per trained token (forward + backward), PaLM-style.

    6 x (parameters in matrix multiplies, head included) + 12 x layers x seq x
    (heads x head size) for attention scores and values. Recomputation (remat) is not
    counted: this is model FLOPs, the numerator of MFU. Grouped-query attention counts
    its smaller key/value projections; the scores cost the same as with every head. A
    mixture of experts counts the active weights (active_matmul_params): the experts a
    token goes to, not the capacity's padding or the experts it skips.
    """
    return 6.0 * active_matmul_params(cfg) \
        + 12.0 * cfg.layers * cfg.seq_len * cfg.heads * cfg.head_size
