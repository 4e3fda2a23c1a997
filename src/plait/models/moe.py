"""A mixture-of-experts MLP (Mixtral, OLMoE, Qwen-MoE, DeepSeek's shared expert).

The router picks each token's top-k experts from a softmax over all of them; the
chosen probabilities weight the experts' outputs. Where the tokens go and how they
come back (capacity or dropless, an `expert` mesh axis or none) is
`plait.parallel.experts`' business; this module knows only logical axis names.

The router's two auxiliary losses, per layer:
- load balancing (Switch Transformer, as Hugging Face's Mixtral computes it):
  E x sum_e f_e x P_e, f_e the share of the layer's token-choices that went to expert e
  (over tokens and their k choices, divided by the tokens), P_e the mean router
  probability of e; 1 x top_k when perfectly balanced.
- z-loss (ST-MoE): the mean over tokens of logsumexp(router logits)^2.
Both are averaged over the sparse layers and weighted by moe.aux_weight / z_weight;
their gradients join the model's where they are computed
(`parallel.router_grad.add_aux_gradient`), their values are reported as metrics.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from plait.config import GPTConfig
from plait.models.keys import ParamKeys
from plait.models.params import param as _param
from plait.parallel import experts, router_grad
from plait.parallel.ops import expert_weight, small_dense
from plait.sharding import constrain

BATCH_SEQ_EMBED = ("act_batch", "act_seq", "act_embed")
ROUTER_LOGITS = ("act_batch", "act_seq", None)
# Per-layer figures a sparse layer reports (summed over layers by the model).
STAT_KEYS = ("aux_loss", "z_loss", "tokens_max", "tokens_mean", "dropped", "assigned")


def sparse_layers(cfg: GPTConfig) -> int:
    return cfg.sparse_count


def router_stats(logits: jax.Array, idx: jax.Array, experts_n: int) -> dict[str, jax.Array]:
    """The load-balancing loss, the z-loss and the tokens per expert of one layer's
    router logits [..., E] (float32) and choices idx [..., k]."""
    # Reduced over the leading dimensions as they are (a flattening reshape of rows
    # split over devices would gather them).
    lead = tuple(range(logits.ndim - 1))
    probs = jax.nn.softmax(logits, axis=-1)
    tokens = math.prod(logits.shape[:-1])
    counts = jnp.sum(jax.nn.one_hot(idx, experts_n, dtype=jnp.float32), axis=(*lead, -2))
    aux = experts_n * jnp.sum(counts / tokens * jnp.mean(probs, axis=lead))
    z = jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
    return {"aux_loss": aux, "z_loss": z, "tokens_max": jnp.max(counts),
            "tokens_mean": jnp.mean(counts), "assigned": jnp.sum(counts)}


class MoE(nnx.Module):
    """`experts` MLPs (the model's activation: SwiGLU or GELU, no biases), a router
    [d, E], and the optional shared expert (a dense MLP every token passes through,
    optionally gated per token)."""

    def __init__(self, cfg: GPTConfig, rngs: ParamKeys, shared=None):
        m = cfg.moe
        assert m is not None
        d, f, E = cfg.d_model, cfg.expert_d_ff, m.experts
        self.router = _param(rngs, (d, E), ("embed", "router"), 0.02, fan_in=("embed",))
        self.swiglu = cfg.mlp == "swiglu"
        if self.swiglu:
            self.w13 = _param(rngs, (E, d, 2, f), ("experts", "embed", "gate_up", "mlp"), 0.02,
                              fan_in=("embed",))
        else:
            self.w1 = _param(rngs, (E, d, f), ("experts", "embed", "mlp"), 0.02,
                             fan_in=("embed",))
        self.w2 = _param(rngs, (E, f, d), ("experts", "mlp", "embed"),
                         0.02 / math.sqrt(2 * cfg.layers), fan_in=("mlp",))
        if shared is not None:
            self.shared = shared
            if m.shared_gate:  # Qwen-MoE: sigmoid(x . g) scales the shared expert per token
                self.shared_gate = _param(rngs, (d,), ("norm",), 0.02)
        self.top_k, self.renormalize = m.top_k, m.renormalize
        self.capacity_factor, self.grouped = m.capacity_factor, m.grouped
        self.bulk, self.spill = m.bulk, m.spill
        n = sparse_layers(cfg)
        self.aux_weight, self.z_weight = m.aux_weight / n, m.z_weight / n

    def __call__(self, x: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        """x [batch, seq, d] -> (output [batch, seq, d], this layer's router figures)."""
        E = self.router.shape[-1]
        # The router's and the shared gate's weight gradients are summed by each token
        # shard first (parallel.ops.small_dense), the router whole on every device and
        # the logits laid out as the tokens are: left to itself, GSPMD moved the tokens,
        # the logits' gradient and the router's fsdp shards between the fsdp and tensor
        # axes by collective-permutes, which hang inside a pipeline's per-tick switch.
        x = constrain(x, BATCH_SEQ_EMBED)
        router = constrain(self.router[...].astype(jnp.float32), (None, None))
        logits = constrain(small_dense(x.astype(jnp.float32), self.router, router),
                           ROUTER_LOGITS)
        probs = jax.nn.softmax(logits, axis=-1)
        gate, idx = jax.lax.top_k(probs, self.top_k)
        if self.renormalize:
            gate = gate / jnp.sum(gate, axis=-1, keepdims=True)
        stats = router_stats(logits, idx, E)
        weights = {k: expert_weight(getattr(self, k))
                   for k in (("w13", "w2") if self.swiglu else ("w1", "w2"))}
        activation = "swiglu" if self.swiglu else "gelu"
        if self.capacity_factor > 0:
            y, dropped = experts.with_capacity(x, idx, gate, weights, activation,
                                               self.capacity_factor)
        else:
            y, dropped = experts.dropless(x, idx, gate, weights, activation, self.grouped,
                                          self.bulk, self.spill)
        y = router_grad.add_aux_gradient(
            y, self.aux_weight * stats["aux_loss"] + self.z_weight * stats["z_loss"])
        if hasattr(self, "shared"):
            shared = self.shared(x)
            if hasattr(self, "shared_gate"):
                gate_w = self.shared_gate[...].astype(x.dtype)
                g = constrain(small_dense(x, self.shared_gate, gate_w, fan_in=("norm",)),
                              ("act_batch", "act_seq"))
                shared = shared * jax.nn.sigmoid(g)[..., None].astype(shared.dtype)
            y = y + shared
        return constrain(y, BATCH_SEQ_EMBED), {**stats, "dropped": dropped.astype(jnp.float32)}


def no_stats() -> dict[str, jax.Array]:
    """The figures of a dense layer (nothing routed), to sum with sparse ones."""
    return {k: jnp.zeros((), jnp.float32) for k in STAT_KEYS}


def summarize(total: dict[str, jax.Array], layers: int) -> dict[str, jax.Array]:
    """Per-layer sums of router figures -> the metrics of a step: the auxiliary losses
    and tokens per expert averaged over the sparse layers, the dropped share of every
    token-choice."""
    return {"moe_aux_loss": total["aux_loss"] / layers, "moe_z_loss": total["z_loss"] / layers,
            "moe_tokens_max": total["tokens_max"] / layers,
            "moe_tokens_mean": total["tokens_mean"] / layers,
            "moe_dropped_fraction": total["dropped"] / jnp.maximum(total["assigned"], 1.0)}
