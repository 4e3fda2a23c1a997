"""The decoder's loss: mean token cross-entropy of the output head's logits, all at
once or in pieces of the tokens.

In pieces (`model.loss_chunks`), each piece's logits exist only inside one step of
a scan: its forward, its loss and the gradients the backward needs (of the
residual stream and of the head's weight) are computed together, so the
backward only scales them. The whole step then never holds more than one piece
of the [tokens, vocabulary] logits, nor their float32 copy, nor their gradient
(for a 128k vocabulary at 16k tokens: about 25 GB fewer at the peak), and it
runs the head's matmuls once each, as the unfused loss does (no recomputation).

Targets the loss leaves out (a prompt's tokens when fine-tuning on its response:
plait.loss_mask) are ~id in the targets. Inside `loss_mask.kept_targets(batch)`
each piece's loss is its sum over its kept targets, divided by its number of
targets, times (targets / kept) of the whole batch (a traced scalar): the means
of equal pieces that the step already averages come out normalized over the
batch, not piece by piece, and one loss is one loss on every mesh.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from plait.loss_mask import kept_scale, token_ids
from plait.parallel import loss_kernel
from plait.sharding import splits, varying_like


def _masked(logits: jax.Array, vocab: int | None) -> tuple[jax.Array, jax.Array]:
    """(float32 logits with the vocabulary's padding at -inf, the vocabulary ids)."""
    logits = logits.astype(jnp.float32)
    ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    if vocab is not None and vocab < logits.shape[-1]:
        logits = jnp.where(ids < vocab, logits, -jnp.inf)
    return logits, ids


def _kernel_here(kernel: str) -> bool:
    """Whether model.loss_kernel's kernels run in this trace: asked for, the vocabulary
    whole on each device, and not inside a pipeline's body (parallel.kernel_place)."""
    return kernel == "pallas" and not splits("act_vocab") and loss_kernel.usable()


def _ids(logits: jax.Array, vocab: int | None) -> int:
    """How many of the logits' columns are ids (the rest: the vocabulary's padding)."""
    return logits.shape[-1] if vocab is None else min(vocab, logits.shape[-1])


def _per_token(logits: jax.Array, targets: jax.Array, vocab: int | None,
               kernel: str = "xla"):
    """(each token's cross-entropy, the float32 masked logits, their log-sum-exp, where
    the label is): the label logit is picked with a masked sum rather than a gather, so
    a vocabulary sharded over devices costs one small all-reduce, not a gather of the
    logits. kernel "pallas" (model.loss_kernel): the log-sum-exp and the label's logit
    from one pass of parallel.loss_kernel's kernel where the vocabulary is whole on each
    device (XLA's reductions where it is split)."""
    masked, ids = _masked(logits, vocab)
    hit = ids == targets[..., None]
    if _kernel_here(kernel):
        lse, label = loss_kernel.lse_and_label(logits, targets, _ids(logits, vocab))
        return lse - label, masked, lse, hit
    lse = _logsumexp(masked)
    return lse - jnp.sum(jnp.where(hit, masked, 0.0), axis=-1), masked, lse, hit


def _combine(a, b):
    """Two (max, sum of exp(x - max)) pairs as one: one exponential per combination."""
    (m1, s1), (m2, s2) = a, b
    m = jnp.maximum(m1, m2)
    d = jnp.exp(-jnp.abs(jnp.where(m1 == m2, 0.0, m1 - m2)))
    return m, jnp.where(m1 >= m2, s1 + s2 * d, s1 * d + s2)


def _logsumexp(x: jax.Array) -> jax.Array:
    """log sum exp of float32 x over its last axis (the vocabulary). In one reduction
    where the vocabulary is whole on each device; where it is split, jax's (a max and a
    sum, each one all-reduce of a number per token, as Megatron's)."""
    if splits("act_vocab"):
        return jax.nn.logsumexp(x, axis=-1)
    return _logsumexp_one_pass(x)


@jax.custom_jvp
def _logsumexp_one_pass(x: jax.Array) -> jax.Array:
    """log sum exp over the last axis, reading x once (the running max and the sum
    rescaled to it, in one reduction), where jax.nn.logsumexp reads it twice. Its
    derivative is the softmax (a reduction with its own combiner has no JVP rule)."""
    m, s = jax.lax.reduce((x, jnp.ones_like(x)), (jnp.float32(-jnp.inf), jnp.float32(0)),
                          _combine, (x.ndim - 1,))
    return m + jnp.log(s)


@_logsumexp_one_pass.defjvp
def _logsumexp_one_pass_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    lse = _logsumexp_one_pass(x)
    return lse, jnp.sum(jnp.exp(x - lse[..., None]) * dx, axis=-1)


def cross_entropy(logits: jax.Array, targets: jax.Array, vocab: int | None = None,
                  kernel: str = "xla") -> jax.Array:
    """Mean token cross-entropy in float32. Logits at ids >= `vocab` (the padding of a
    vocabulary rounded up for sharding) are left out, so padding does not change the
    loss. Inside `kept_targets`, the mean over the kept targets of the whole batch.
    `kernel`: how the forward reduces over the vocabulary (`_per_token`)."""
    scale = kept_scale()
    mean = jnp.mean(_kept(_token_losses(logits, token_ids(targets), vocab, kernel), targets))
    return mean if scale is None else mean * scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _token_losses(logits: jax.Array, targets: jax.Array, vocab: int | None,
                  kernel: str) -> jax.Array:
    """Each token's cross-entropy. Its backward keeps only the logits in their own dtype
    and the log-sum-exp per token, and forms softmax - one-hot from them: autodiff kept
    three float32 and two boolean arrays of the logits' size (gpt2-124m at 32 x 1024:
    21.5 GiB against 3.1, docs/architecture.md "What a layer keeps for the backward"), and
    its backward repeats no reduction over the vocabulary (a collective when the
    vocabulary is split)."""
    return _per_token(logits, targets, vocab, kernel)[0]


def _token_losses_fwd(logits, targets, vocab, kernel):
    per_token, _, lse, _ = _per_token(logits, targets, vocab, kernel)
    return per_token, (logits, targets, lse)


def _token_losses_bwd(vocab, kernel, kept, g):
    logits, targets, lse = kept
    masked, ids = _masked(logits, vocab)
    grad = (jnp.exp(masked - lse[..., None]) - (ids == targets[..., None])) * g[..., None]
    return grad.astype(logits.dtype), None


_token_losses.defvjp(_token_losses_fwd, _token_losses_bwd)


def _sum_and_gradient(logits: jax.Array, targets: jax.Array, vocab: int | None,
                      scale: jax.Array | float, kernel: str) -> tuple[jax.Array, jax.Array]:
    """(the summed cross-entropy of these logits' kept targets, scale x its gradient in
    their dtype). kernel "pallas" where the vocabulary is whole on each device: both from
    one kernel that reads the logits twice and writes the gradient over them
    (parallel.loss_kernel.loss_and_gradient), where XLA's reduction and the gradient's
    elementwise pass each read them from memory."""
    if _kernel_here(kernel):
        weights = _kept(jnp.broadcast_to(jnp.asarray(scale, jnp.float32), targets.shape),
                        targets)
        per_token, grad = loss_kernel.loss_and_gradient(logits, token_ids(targets), weights,
                                                        _ids(logits, vocab))
        return jnp.sum(_kept(per_token, targets)), grad
    per_token, masked, lse, hit = _per_token(logits, token_ids(targets), vocab, kernel)
    grad = (jnp.exp(masked - lse[..., None]) - hit) * scale
    return (jnp.sum(_kept(per_token, targets)),
            _kept(grad, targets[..., None]).astype(logits.dtype))


def _summed(logits: jax.Array, targets: jax.Array, vocab: int | None,
            kernel: str) -> jax.Array:
    """The summed cross-entropy of these logits' kept targets."""
    return jnp.sum(_kept(_per_token(logits, token_ids(targets), vocab, kernel)[0], targets))


def _kept(values: jax.Array, targets: jax.Array) -> jax.Array:
    """values where the loss keeps their targets, 0 where it leaves them out (inside
    loss_mask.kept_targets; outside, values as they are and nothing traced)."""
    return values if kept_scale() is None else jnp.where(targets >= 0, values, 0.0)


def _pieces(a: jax.Array, n: int) -> jax.Array:
    """[batch, seq, ...] -> [n, batch, seq / n, ...]: position s = i n + j in piece j, so
    a sequence dimension sharded over devices stays sharded (on its major part)."""
    b, s = a.shape[:2]
    return jnp.moveaxis(a.reshape(b, s // n, n, *a.shape[2:]), 2, 0)


def _zeros(shape: tuple[int, ...], *like: jax.Array) -> jax.Array:
    """float32 zeros of the varying type of `like` (inside a pipeline's shard_map)."""
    return varying_like(jnp.zeros(shape, jnp.float32), *like)


def chunked_cross_entropy(project: Callable[[jax.Array, jax.Array], jax.Array],
                          h: jax.Array, w: jax.Array, targets: jax.Array,
                          vocab: int | None, chunks: int, weight_grad=None,
                          kernel: str = "xla") -> jax.Array:
    """cross_entropy(project(h, w), targets, vocab, kernel), in `chunks` pieces of the
    tokens.

    h [batch, seq, d] (the final norm's output), w the head's weight as `project`
    takes it, targets [batch, seq]; seq divisible by `chunks`. The gradients of h
    and w are those of the unfused loss, w's summed over the pieces in float32.
    `weight_grad` (parallel.ops.weight_grad_by_shard's (partial, total, shape)):
    w's gradient is summed per token shard inside the loop and across the shards
    once after it; without it, each piece's gradient of w is summed as its vjp
    gives it (across devices once per piece where the tokens are split).
    """
    tokens = targets.size
    h_pieces, t_pieces = _pieces(h, chunks), _pieces(targets, chunks)
    # Inside kept_targets: (targets / kept) of the whole batch, an argument of the fused
    # loss rather than a value its rules close over.
    batch_scale = kept_scale()
    scale = 1.0 if batch_scale is None else batch_scale

    def loss_only(h_pieces, w, t_pieces, scale):
        def body(total, xs):
            hc, tc = xs
            return total + _summed(project(hc, w), tc, vocab, kernel), None

        init = _zeros((), h_pieces, w, t_pieces)
        total, _ = jax.lax.scan(body, init, (h_pieces, t_pieces))
        return total / tokens * scale

    def with_gradients(h_pieces, w, t_pieces, scale):
        def body(carry, xs):
            total, dw = carry
            hc, tc = xs
            if weight_grad is None:
                logits, pull = jax.vjp(project, hc, w)
            else:
                logits, pull_h = jax.vjp(lambda hc: project(hc, w), hc)
            s, g = _sum_and_gradient(logits, tc, vocab, 1.0 / tokens * scale, kernel)
            if weight_grad is None:
                dh, dwc = pull(g)
                dw = dw + dwc.astype(jnp.float32)
            else:
                (dh,) = pull_h(g)
                dw = dw + weight_grad[0](hc, g)
            return (total + s, dw), dh

        shape = w.shape if weight_grad is None else weight_grad[2]
        init = (_zeros((), h_pieces, w, t_pieces), _zeros(shape, h_pieces, w, t_pieces))
        (total, dw), dh = jax.lax.scan(body, init, (h_pieces, t_pieces))
        if weight_grad is not None:
            dw = weight_grad[1](dw)
        return total / tokens * scale, (dh, dw.astype(w.dtype), scale)

    def backward(res, g):
        dh, dw, scale = res
        return (dh * g.astype(dh.dtype), dw * g.astype(dw.dtype), None,
                jnp.zeros_like(scale))

    fused = jax.custom_vjp(loss_only)
    fused.defvjp(with_gradients, backward)
    return fused(h_pieces, w, t_pieces, scale)
