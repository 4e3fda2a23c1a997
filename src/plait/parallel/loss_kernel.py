"""The loss's reductions over the vocabulary in Pallas (Triton) kernels on NVIDIA GPUs
(`model.loss_kernel`): each token's log-sum-exp and the logit of its label
(`lse_and_label`: evaluation, and the loss's forward where its weights come later), and
in training the loss and its gradient together (`loss_and_gradient`).

XLA:GPU's reduction of gpt2-124m's [32768, 50304] bf16 logits ran at 1.24 TB/s on an
H100, 37% of its bandwidth (2.67 ms of a 66 ms step; docs/benchmarks.md, "Without a
GPU: leads checked and left"): it splits each row into 128 pieces of 393 columns, an
odd width read one element at a time, and pays a rescaling per element for its running
maximum. Here one program reads one row in blocks of `CHUNK` columns (vector loads), takes
each block's maximum and its sum of exponentials against it, and rescales once per
block; the label's logit is one more load. On an H200 (2026-11-27) that read the logits
in 1.36 ms against XLA's 2.85, and the loss with its gradient (a second pass over the
row writing weight x (softmax - one-hot) over it) took 3.56 ms against XLA's 5.69.

The kernels see whole rows, so inside plait's step they run in a shard_map over the
mesh, each device on its own tokens; where the vocabulary is split (a sum across devices
per token) or inside a pipeline's body, models.loss keeps XLA's reductions. Off a GPU
the kernels run in Pallas's interpreter (tests; `plait train` refuses "pallas" there).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from plait.parallel.kernel_place import Placement, placement, pow2, usable

__all__ = ["lse_and_label", "loss_and_gradient", "usable"]

# Columns a program reads at once (Triton's blocks are powers of two) and the kernels'
# launch settings: the fastest of benchmarks/loss_kernel.py's on an H200 at gpt2-124m's
# logits (2026-11-27, benchmarks/results/h200-2026-11-27).
CHUNK = 2048
NUM_WARPS = 4
NUM_STAGES = 3  # 1.36 ms; 2 stages 1.51
# loss_and_gradient's programs, each taking rows p, p + programs, ...; None: one a row.
# Fewer programs were to keep the rows in flight in L2 for the second pass over them
# (~100 KB a row at gpt2's 50304 columns); measured, more programs ran faster all the
# way to one a row: 132 programs 7.43 ms, 264 4.84, 528 3.97, one a row 3.56 (XLA 5.69).
GRAD_PROGRAMS: int | None = None
GRAD_CHUNK = 4096
GRAD_NUM_WARPS = 8
GRAD_NUM_STAGES = 2
# The second pass over a row from its last block back (the blocks the first pass read
# last are the likeliest still in L2): not yet measured, so off.
GRAD_REVERSE = False


def _columns(x_ref, row, j, chunk: int, vocab: int) -> tuple[jax.Array, jax.Array]:
    """Block j of `chunk` columns of a row, float32, -inf past `vocab`; and their ids."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    cols = j * chunk + jnp.arange(chunk)
    return plt.load(x_ref.at[row, pl.ds(j * chunk, chunk)], mask=cols < vocab,
                    other=-jnp.inf).astype(jnp.float32), cols


def _row_stats(x_ref, t_ref, row, vocab: int, chunk: int):
    """One row's log-sum-exp over its first `vocab` logits (a running max, the sum
    rescaled once a block), its target [1] and the logit at its target [1], float32."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    def block(j, carry):
        m, s = carry
        x, _ = _columns(x_ref, row, j, chunk, vocab)
        new = jnp.maximum(m, jnp.max(x))
        return new, s * jnp.exp(m - new) + jnp.sum(jnp.exp(x - new))

    m, s = jax.lax.fori_loop(0, pl.cdiv(vocab, chunk), block,
                             (jnp.float32(-jnp.inf), jnp.float32(0.0)))
    target = plt.load(t_ref.at[pl.ds(row, 1)])
    label = plt.load(x_ref.at[row, pl.ds(target[0], 1)], mask=(target >= 0) & (target < vocab),
                     other=0).astype(jnp.float32)
    return m + jnp.log(s), target, label


def _kernel(vocab: int, chunk: int, x_ref, t_ref, lse_ref, label_ref):
    """One row: log-sum-exp of its first `vocab` logits, and the logit at its target."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    row = pl.program_id(0)
    lse, _, label = _row_stats(x_ref, t_ref, row, vocab, chunk)
    plt.store(lse_ref.at[pl.ds(row, 1)], lse[None])
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


def _grad_kernel(vocab: int, width: int, chunk: int, rows: int, programs: int,
                 reverse: bool, x_ref, t_ref, w_ref, loss_ref, g_ref):
    """Rows p, p + programs, ...: each row's log-sum-exp and label logit from a first
    pass, then its gradient w * (softmax - one-hot) over all `width` columns (0 past
    `vocab`) from a second (from the last block back if `reverse`), written over the
    logits (aliased: each block is read before it is written), and its loss lse - label."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    p = pl.program_id(0)
    blocks = pl.cdiv(width, chunk)

    def one(i, carry):
        row_at = p + i * programs
        live = row_at < rows
        row = jnp.minimum(row_at, rows - 1)  # past the end: the last row, nothing stored
        lse, target, label = _row_stats(x_ref, t_ref, row, vocab, chunk)
        weight = plt.load(w_ref.at[pl.ds(row, 1)])

        def down(i, c):
            j = blocks - 1 - i if reverse else i
            x, cols = _columns(x_ref, row, j, chunk, vocab)
            g = (jnp.exp(x - lse) - (cols == target).astype(jnp.float32)) * weight
            plt.store(g_ref.at[row, pl.ds(j * chunk, chunk)], g.astype(g_ref.dtype),
                      mask=(cols < width) & live)
            return c

        jax.lax.fori_loop(0, blocks, down, 0)
        plt.store(loss_ref.at[pl.ds(row, 1)], (lse - label), mask=live[None])
        return carry

    jax.lax.fori_loop(0, pl.cdiv(rows, programs), one, 0)


@functools.partial(jax.jit, static_argnames=("vocab", "chunk", "programs", "interpret",
                                             "num_warps", "num_stages", "reverse"))
def _rows_with_gradient(x: jax.Array, targets: jax.Array, weights: jax.Array, vocab: int,
                        chunk: int, programs: int | None, interpret: bool,
                        num_warps: int = GRAD_NUM_WARPS,
                        num_stages: int = GRAD_NUM_STAGES, reverse: bool = GRAD_REVERSE):
    """x [rows, width], targets, weights [rows] -> (loss [rows] float32, gradient [rows,
    width] in x's dtype, in x's buffer). programs None: one a row."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    rows, width = x.shape
    programs = rows if programs is None else min(programs, rows)
    anywhere = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        functools.partial(_grad_kernel, vocab, width, min(chunk, pow2(width)), rows,
                          programs, reverse),
        out_shape=(jax.ShapeDtypeStruct((rows,), jnp.float32),
                   jax.ShapeDtypeStruct(x.shape, x.dtype)),
        grid=(programs,), in_specs=[anywhere] * 3, out_specs=(anywhere, anywhere),
        input_output_aliases={0: 1},
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret)(x, targets.astype(jnp.int32), weights.astype(jnp.float32))


def _on_tokens(local, at: Placement, args: tuple, rows_out: tuple[bool, ...]):
    """local(logits [..., V], *per-token arrays [...]) run where `at` places it: as it is
    outside plait's step; inside it, in a shard_map over the mesh, each device on its own
    tokens (the layout the logits are pinned to: models.gpt's LOGITS). rows_out: which
    outputs are [..., V] like the logits (the others: one value a token)."""
    if at.mesh is None:
        return local(*args)
    if args[1].ndim > 2:
        raise ValueError(f"targets of {args[1].ndim} dimensions: [batch, seq] or [tokens] "
                         "expected")
    rows, tokens = P(*at.tokens, None), at.tokens
    # check_vma off: Pallas's interpreter mistypes its loop's carry inside a shard_map
    # that checks it (JAX's own error message says so)
    return jax.shard_map(local, mesh=at.mesh, in_specs=(rows,) + (tokens,) * (len(args) - 1),
                         out_specs=tuple(rows if r else tokens for r in rows_out),
                         check_vma=False)(*args)


def loss_and_gradient(logits: jax.Array, targets: jax.Array, weights: jax.Array,
                      vocab: int, chunk: int = GRAD_CHUNK,
                      programs: int | None = GRAD_PROGRAMS, reverse: bool = GRAD_REVERSE
                      ) -> tuple[jax.Array, jax.Array]:
    """logits [..., V] (whole on each device), targets and weights [...] -> (each
    token's cross-entropy over the first `vocab` logits, float32 [...]; the gradient
    weights x (softmax - one-hot) [..., V] in the logits' dtype, 0 past `vocab`).

    For a loss whose weight per token is known before its backward (models.loss's
    pieces): the logits are read twice in one kernel (the second time partly from L2)
    and the gradient written over them, where XLA's loss and gradient apart take 1.6x
    as long (an H200, gpt2-124m's logits).
    Placed as lse_and_label (`_on_tokens`)."""
    at = placement(logits.ndim)

    def local(x, t, w):
        loss, grad = _rows_with_gradient(x.reshape(-1, x.shape[-1]), t.reshape(-1),
                                         w.reshape(-1), vocab, chunk, programs,
                                         at.interpret, reverse=reverse)
        return loss.reshape(t.shape), grad.reshape(x.shape)

    return _on_tokens(local, at, (logits, targets, weights), rows_out=(False, True))


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

    return _on_tokens(local, at, (logits, targets), rows_out=(False, False))
