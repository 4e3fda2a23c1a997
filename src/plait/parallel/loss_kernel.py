"""The loss's two reductions over the vocabulary -- each token's log-sum-exp of its
logits and the logit of its label -- in one pass of a Pallas (Triton) kernel on NVIDIA
GPUs (`model.loss_kernel = "pallas"`).

XLA:GPU's reduction of gpt2-124m's [32768, 50304] bf16 logits ran at 1.24 TB/s on an
H100, 37% of its bandwidth (2.67 ms of a 66 ms step; docs/benchmarks.md, "Without a
GPU: leads checked and left"): it splits each row into 128 pieces of 393 columns, an
odd width read one element at a time, and pays a rescaling per element for its running
maximum. Here one program reads one row in blocks of `CHUNK` columns (vector loads), takes
each block's maximum and its sum of exponentials against it, and rescales once per
block; the label's logit is one more load. Only the forward's reductions: the backward
(softmax minus one-hot, from the logits and the log-sum-exp) stays XLA's elementwise
pass (models.loss).

The kernel sees whole rows, so inside plait's step it runs in a shard_map over the mesh,
each device on its own tokens; where the vocabulary is split (a sum across devices per
token) or inside a pipeline's body, models.loss keeps XLA's reductions. Off a GPU the
kernel runs in Pallas's interpreter (tests; `plait train` refuses the setting there).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from plait.parallel.kernel_place import placement, usable

__all__ = ["lse_and_label", "usable"]

# Columns a program reads at once (Triton's blocks are powers of two), and the kernel's
# launch settings; not yet tuned on a GPU.
CHUNK = 2048
NUM_WARPS = 4
NUM_STAGES = 2


def _kernel(vocab: int, chunk: int, x_ref, t_ref, lse_ref, label_ref):
    """One row: log-sum-exp of its first `vocab` logits, and the logit at its target."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    row = pl.program_id(0)

    def block(i, carry):
        m, s = carry
        cols = i * chunk + jnp.arange(chunk)
        x = plt.load(x_ref.at[row, pl.ds(i * chunk, chunk)], mask=cols < vocab,
                     other=-jnp.inf).astype(jnp.float32)
        new = jnp.maximum(m, jnp.max(x))
        return new, s * jnp.exp(m - new) + jnp.sum(jnp.exp(x - new))

    m, s = jax.lax.fori_loop(0, pl.cdiv(vocab, chunk), block,
                             (jnp.float32(-jnp.inf), jnp.float32(0.0)))
    target = plt.load(t_ref.at[pl.ds(row, 1)])
    label = plt.load(x_ref.at[row, pl.ds(target[0], 1)], mask=(target >= 0) & (target < vocab),
                     other=0).astype(jnp.float32)
    plt.store(lse_ref.at[pl.ds(row, 1)], (m + jnp.log(s))[None])
    plt.store(label_ref.at[pl.ds(row, 1)], label)


@functools.partial(jax.jit, static_argnames=("vocab", "chunk", "interpret", "num_warps",
                                             "num_stages"))
def _rows(x: jax.Array, targets: jax.Array, vocab: int, chunk: int, interpret: bool,
          num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES):
    """x [rows, V], targets [rows] -> (log-sum-exp [rows], label logit [rows]), float32."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    rows = x.shape[0]
    out = jax.ShapeDtypeStruct((rows,), jnp.float32)
    anywhere = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        functools.partial(_kernel, vocab, chunk), out_shape=(out, out), grid=(rows,),
        in_specs=[anywhere, anywhere], out_specs=(anywhere, anywhere),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret)(x, targets.astype(jnp.int32))


def lse_and_label(logits: jax.Array, targets: jax.Array, vocab: int,
                  chunk: int = CHUNK) -> tuple[jax.Array, jax.Array]:
    """logits [..., V] (the vocabulary whole on each device), targets [...] ->
    (log-sum-exp over the first `vocab` logits, the target's logit), float32 [...].
    Not differentiable: models.loss's rules give the derivatives. Inside plait's step
    (sharding.use) it runs in a shard_map over the mesh, each device on its own tokens
    (replicated over the axes that split neither the batch nor the sequence)."""
    at = placement(logits.ndim)

    def local(x, t):
        lse, label = _rows(x.reshape(-1, x.shape[-1]), t.reshape(-1), vocab, chunk,
                           at.interpret)
        return lse.reshape(t.shape), label.reshape(t.shape)

    if at.mesh is None:
        return local(logits, targets)
    if targets.ndim > 2:
        raise ValueError(f"targets of {targets.ndim} dimensions: [batch, seq] or [tokens] "
                         "expected")
    # the tokens' layout as the logits are pinned to it (models.gpt's LOGITS);
    # check_vma off: Pallas's interpreter mistypes its loop's carry inside a shard_map
    # that checks it (JAX's own error message says so)
    return jax.shard_map(local, mesh=at.mesh, in_specs=(P(*at.tokens, None), at.tokens),
                         out_specs=(at.tokens, at.tokens), check_vma=False)(logits, targets)
