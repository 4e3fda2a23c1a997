"""The `[model]` tables of the model kinds, and the base every config section shares.

This is the bottom floor of the configuration: it imports no other plait module,
so the kind registry (`plait.kinds`) can sit on top of it and `plait.config`
(the whole experiment) on top of that.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

PosInt = Annotated[int, Field(gt=0)]
NonNegInt = Annotated[int, Field(ge=0)]
PosFloat = Annotated[float, Field(gt=0)]
NonNegFloat = Annotated[float, Field(ge=0)]
# A count of steps: JAX counts them in int32 (the optimizer's count, the schedule's
# argument, the step in the state), so one past 2**31 - 1 fails inside a jitted call.
Steps = Annotated[int, Field(gt=0, le=2**31 - 1)]
NonNegSteps = Annotated[int, Field(ge=0, le=2**31 - 1)]


class Section(BaseModel):
    # No key takes an infinite or NaN float: `inf` and `nan` are valid TOML, and an
    # infinite rate or decay trains to NaN (or, as sync.alpha, aborts XLA) steps later.
    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True,
                              allow_inf_nan=False)


class ModelSection(Section):
    """The `[model]` table. Each model kind has its own subclass, chosen by `kind`
    through the task registry (`plait.tasks`); `shape_keys` are the keys that change
    parameter shapes (a checkpoint of another shape is refused)."""

    kind: str = "gpt"
    shape_keys: ClassVar[tuple[str, ...]] = ()
    data_sources: ClassVar[tuple[str, ...]] = ("synthetic",)

    def shape_keys_now(self) -> tuple[str, ...]:
        """The keys that change parameter shapes for this config's choices."""
        return self.shape_keys


class RopeScaling(Section):
    """Llama 3.1's rotary frequency scaling: wavelengths longer than
    original_context / low_freq_factor are stretched by `factor`, those shorter than
    original_context / high_freq_factor kept, the band between interpolated."""

    factor: Annotated[float, Field(ge=1)] = 8.0
    low_freq_factor: PosFloat = 1.0
    high_freq_factor: PosFloat = 4.0
    original_context: PosInt = 8192

    @model_validator(mode="after")
    def _a_band(self) -> RopeScaling:
        """The band between is interpolated over high_freq_factor - low_freq_factor (a
        division by zero at equal factors; Hugging Face's llama3 check asks the same)."""
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"model.rope_scaling.high_freq_factor = {self.high_freq_factor} "
                             f"must be above low_freq_factor = {self.low_freq_factor}")
        return self


class MoEConfig(Section):
    """A mixture of experts in place of the dense MLP (`[model.moe]`): `experts` MLPs of
    hidden size `d_ff` (unset = model.d_ff), each token through `top_k` of them chosen
    by a softmax router (the chosen probabilities renormalised to sum to 1 unless
    `renormalize` is false, as OLMoE), in every `every`-th layer (layers 0, every,
    2 x every, ...); an optional shared expert every token passes through
    (`shared_d_ff`, 0 = none), its output scaled per token by a sigmoid gate if
    `shared_gate` (Qwen-MoE). `capacity_factor` > 0 caps each expert's assignments
    per sequence (the rest dropped and counted); 0 = dropless. The router's
    load-balancing loss (Switch) and z-loss join the gradient with their weights."""

    experts: Annotated[int, Field(ge=2)] = 8
    top_k: PosInt = 2
    every: PosInt = 1
    d_ff: PosInt | None = None
    shared_d_ff: NonNegInt = 0
    shared_gate: bool = False
    renormalize: bool = True
    capacity_factor: NonNegFloat = 0.0
    # Dropless's grouped MLPs: plait's tiles (a balanced share of each expert's rows
    # batched, the rest in a loop over tiles of one expert; the routed FLOPs anywhere),
    # JAX's Pallas grouped GEMM kernels (Hopper GPUs only, no expert axis), "auto" (the
    # kernels where they run, the tiles elsewhere), or jax.lax.ragged_dot's grouped
    # matmuls (whatever the backend makes of them).
    grouped: Literal["auto", "tiles", "pallas", "ragged_dot"] = "auto"
    # tiles: the rows batched, as a multiple of a balanced expert's share (bulk), then
    # tiles of the rows past it batched with their experts' weights gathered, as many
    # as a layer needs, up to a share of all rows (spill: 1.25 holds any routing on one
    # device); the rest in a loop over tiles (small products in sequence, each waiting
    # for the host on a GPU). Both 0: every row in the loop.
    bulk: NonNegFloat = 1.0
    spill: NonNegFloat = 1.25
    aux_weight: NonNegFloat = 0.01
    z_weight: NonNegFloat = 0.0

    @model_validator(mode="after")
    def _k_fits(self) -> MoEConfig:
        if self.top_k > self.experts:
            raise ValueError(f"model.moe.top_k = {self.top_k} exceeds model.moe.experts = "
                             f"{self.experts}; choose top_k <= experts")
        if self.shared_gate and not self.shared_d_ff:
            raise ValueError("model.moe.shared_gate = true gates a shared expert, and "
                             "model.moe.shared_d_ff = 0 makes none; set shared_d_ff")
        return self


class GPTConfig(ModelSection):
    """A decoder-only transformer (`kind = "gpt"`, GPT-2's layout by default). The same
    decoder is a Llama-family model (`kind = "llama"`: RMSNorm, rotary positions, a
    SwiGLU MLP, grouped-query attention, no biases) and any mix of the two: every
    choice is a key here, and there is one decoder (plait.models.gpt)."""

    kind: Literal["gpt"] = "gpt"
    layers: PosInt = 2
    d_model: PosInt = 64
    heads: PosInt = 4
    # Key/value heads (grouped-query attention): a divisor of heads; 1 = multi-query;
    # unset = heads (every query head has its own).
    kv_heads: PosInt | None = None
    # Size of one head; unset = d_model / heads.
    head_dim: PosInt | None = None
    d_ff: PosInt = 256
    vocab: PosInt = 256
    seq_len: PosInt = 64
    tie_embeddings: bool = True
    # Embedding rows are padded to a multiple of this (GPT-2's 50257 -> 50304),
    # so vocabulary-parallel sharding divides and matmuls stay aligned.
    vocab_multiple: PosInt = 128
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    norm_eps: PosFloat = 1e-5
    # Positions: a learned table of seq_len rows (GPT-2) or rotary embeddings of q, k.
    position: Literal["learned", "rope"] = "learned"
    rope_theta: PosFloat = 10000.0
    rope_scaling: RopeScaling | None = None
    mlp: Literal["gelu", "swiglu"] = "gelu"
    # Biases of every linear layer and norm (GPT-2); without them, qkv_bias still
    # gives the query/key/value projections theirs (Qwen2).
    bias: bool = True
    qkv_bias: bool = False
    # An RMS norm over the whole query projection and one over the whole key projection
    # (every head's values together), before rotary positions (OLMoE).
    qk_norm: bool = False
    attention: Literal["auto", "xla", "cudnn"] = "auto"
    # Recompute activations in the backward: none, full (keep each block's input only),
    # save_dots (keep the matmul outputs, recompute the rest), save_attention (keep the
    # attention block's q/k/v, output and projection; recompute the MLP and the norms)
    # or save_qkv (keep q/k/v only); true/false read as full/none.
    remat: Literal["none", "full", "save_dots", "save_attention", "save_qkv"] = "none"
    # The output head and the loss over the tokens in this many pieces, each piece's
    # logits, loss and gradients computed together and freed before the next
    # (models.loss): only one piece of the [tokens, vocabulary] logits is ever held.
    # 1 = all at once. Divides seq_len.
    loss_chunks: PosInt = 1
    # How the loss reduces over the vocabulary (each token's log-sum-exp, its label's
    # logit, and in training the gradient with them): "xla", XLA's own fusions; "pallas",
    # Pallas (Triton) kernels (parallel.loss_kernel), on NVIDIA GPUs only; "auto" (the
    # default), the kernels on a Hopper GPU, where they were measured faster, XLA's
    # elsewhere (tasks.gpt_runtime.kernels_for). Where the vocabulary is split across
    # devices, XLA's either way.
    loss_kernel: Literal["auto", "xla", "pallas"] = "auto"
    # How a LayerNorm runs: "xla", XLA's fusions; "pallas", one pass each way of a
    # Pallas (Triton) kernel (parallel.norm_kernel), the attention's residual add folded
    # into the norm after it, on NVIDIA GPUs only; "auto" (the default) as for
    # loss_kernel. Where the embedding is split across devices, inside a pipeline's body,
    # and for RMSNorm, XLA's either way.
    norm_kernel: Literal["auto", "xla", "pallas"] = "auto"
    # How an FP8 matmul (precision.matmul = "fp8") quantises its operands: "xla", the
    # quantize-dequantize pattern, XLA's fusions, amax reductions and transposes;
    # "pallas", one pass of a Pallas (Triton) kernel per operand writing it quantised
    # both ways round with its amax (parallel.fp8_cast), on NVIDIA GPUs only; "auto"
    # as for loss_kernel. Under the 2-D / 3-D tensor modes, where a weight is split by
    # tensor, and inside a pipeline's body, XLA's either way.
    fp8_kernel: Literal["auto", "xla", "pallas"] = "auto"
    # Keep the blocks stacked [layers, ...] and run them as one lax.scan body (same
    # parameters, same results): compile time no longer grows with the number of
    # layers. "auto": tasks.gpt_runtime.scan_for's rule (unrolled on GPUs up to 64 layers).
    scan_layers: bool | Literal["auto"] = False
    # A mixture of experts in place of the MLP (of every `moe.every`-th layer).
    moe: MoEConfig | None = None
    # FP8 scaling state per dense matmul, `fp8_history` steps of amax each; 0 = none.
    # Not written here: a run sets it from precision.matmul / precision.fp8_history.
    fp8_history: NonNegInt = 0

    data_sources: ClassVar[tuple[str, ...]] = ("synthetic", "tokens")
    shape_keys: ClassVar[tuple[str, ...]] = (
        "layers", "d_model", "heads", "kv_heads", "head_dim", "d_ff", "vocab", "seq_len",
        "tie_embeddings", "vocab_multiple", "norm", "position", "mlp", "bias", "qkv_bias",
        "qk_norm",
        "moe.experts", "moe.every", "moe.d_ff", "moe.shared_d_ff",
        "moe.shared_gate")

    @field_validator("remat", mode="before")
    @classmethod
    def _remat_from_bool(cls, value: Any) -> Any:
        return {True: "full", False: "none"}.get(value, value) if isinstance(value, bool) \
            else value

    @model_validator(mode="after")
    def _heads_fit(self) -> GPTConfig:
        if self.heads % self.n_kv_heads:
            raise ValueError(f"model.kv_heads = {self.kv_heads} does not divide model.heads = "
                             f"{self.heads}; use a divisor of heads (1 = multi-query)")
        if self.head_dim is None and self.d_model % self.heads:
            raise ValueError(f"model.d_model = {self.d_model} is not divisible by model.heads "
                             f"= {self.heads}; pick d_model a multiple of heads, or set "
                             "model.head_dim")
        if self.seq_len % self.loss_chunks:
            raise ValueError(f"model.loss_chunks = {self.loss_chunks} does not divide "
                             f"model.seq_len = {self.seq_len}; use a divisor of seq_len")
        if self.position == "rope" and self.head_size % 2:
            raise ValueError(f"rotary positions need an even head size, not {self.head_size}")
        if self.moe is not None and self.moe.every > 1 and self.scan_layers is True:
            raise ValueError(f"model.moe.every = {self.moe.every} mixes dense and expert "
                             "layers, which stacked layers cannot hold; set model.scan_layers"
                             " = false (or moe.every = 1)")
        return self

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer` has experts in place of its MLP."""
        return self.moe is not None and layer % self.moe.every == 0

    @property
    def sparse_count(self) -> int:
        """How many layers have experts (layers 0, every, 2 x every, ...)."""
        if self.moe is None or self.layers == 0:
            return 0
        return (self.layers - 1) // self.moe.every + 1

    @property
    def expert_d_ff(self) -> int:
        return (self.moe.d_ff if self.moe is not None and self.moe.d_ff else self.d_ff)

    @property
    def padded_vocab(self) -> int:
        m = self.vocab_multiple
        return (self.vocab + m - 1) // m * m

    def shape_keys_now(self) -> tuple[str, ...]:
        """seq_len sizes the learned position table; rotary positions have none, so a
        RoPE model moves to another sequence length (fine-tuning a longer context)."""
        keys = self.shape_keys
        return keys if self.position == "learned" else tuple(k for k in keys if k != "seq_len")

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.d_model // self.heads

    @property
    def fused_qkv(self) -> bool:
        """One [d, 3, heads, head] projection (every head has its own keys and values);
        grouped-query attention projects queries and keys/values apart."""
        return self.n_kv_heads == self.heads


class LlamaConfig(GPTConfig):
    """The Llama family (`kind = "llama"`): Llama 2/3/3.1/3.2, Mistral, Qwen2 (with
    qkv_bias), SmolLM. The same decoder as `gpt` with Llama's choices as defaults."""

    kind: Literal["llama"] = "llama"  # type: ignore[assignment]
    tie_embeddings: bool = False
    norm: Literal["layernorm", "rmsnorm"] = "rmsnorm"
    position: Literal["learned", "rope"] = "rope"
    rope_theta: PosFloat = 500000.0
    mlp: Literal["gelu", "swiglu"] = "swiglu"
    bias: bool = False


class DLRMConfig(ModelSection):
    """A DLRM recommender (`kind = "dlrm"`): one entry per embedding table (its rows),
    their common dimension, the MLP widths (the bottom MLP's last width is
    embedding_dim), the number of dense features, the pooling of each bag, and DCNv2
    cross layers (0 = the original dot interaction)."""

    kind: Literal["dlrm"] = "dlrm"
    embedding_rows: Annotated[list[PosInt], Field(min_length=1)] = [1000, 1000]
    embedding_dim: PosInt = 16
    bottom_mlp: Annotated[list[PosInt], Field(min_length=1)] = [64, 16]
    top_mlp: Annotated[list[PosInt], Field(min_length=1)] = [64, 1]
    dense_features: PosInt = 13
    pooling: Literal["sum", "mean"] = "sum"
    cross_layers: NonNegInt = 0
    # Cap every table at this many rows (ids are taken modulo the capped size), so a
    # large benchmark shape fits a given memory; 0 = no cap.
    max_embedding_rows: NonNegInt = 0

    data_sources: ClassVar[tuple[str, ...]] = ("clicks", "criteo", "criteo_bin")
    shape_keys: ClassVar[tuple[str, ...]] = (
        "embedding_rows", "embedding_dim", "bottom_mlp", "top_mlp", "dense_features",
        "cross_layers", "max_embedding_rows")

    @property
    def table_rows(self) -> list[int]:
        cap = self.max_embedding_rows
        return [min(r, cap) if cap else r for r in self.embedding_rows]
