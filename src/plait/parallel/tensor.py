"""2-D, 2.5-D and 3-D tensor-parallel linear layers and embedding lookups.

GSPMD partitions a matmul whose operands are split over a grid by gathering
whole operands, not by the SUMMA / 3-D patterns of the papers (see
docs/architecture.md for the HLO evidence), so these layers say the pattern
explicitly with `shard_map`. One routine serves every mode: from the layouts
of the input, the weight and the wanted output it derives which axes to
all-gather the input over, which to all-gather the weight over, and which
partial sums to reduce-scatter:

- 2-D / 2.5-D: input [T/q, k/q] gathered over col, weight [k/q, n/q] gathered
  over row, product [T/q, n/q] complete (Optimus / Tesseract).
- 3-D: input [T/q^2, k/q] gathered over one axis, weight [k/q^2, n/q] over
  x, partial product [T/q, n/q] reduce-scattered over the third axis
  (Bian et al. 2021).

Autodiff turns every all-gather into a reduce-scatter and back, so the
backward pass moves the same volumes. A weight replicated over the batch axes
(data, fsdp, depth) is cast to varying *before* its gather, so its gradient is
summed over those axes on the small local block rather than the gathered one.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from plait.sharding import vary_over

try:
    from jax.lax import all_gather_invariant
except ImportError:  # jax 0.10 has it, not yet under jax.lax
    from jax._src.lax.parallel import all_gather_invariant


def _dims(spec: P, ndim: int) -> list[tuple[str, ...]]:
    out = []
    for i in range(ndim):
        a = spec[i] if i < len(spec) else None
        out.append(() if a is None else (a,) if isinstance(a, str) else tuple(a))
    return out


def _spec(dims: Sequence[tuple[str, ...]]) -> P:
    return P(*(None if not d else d[0] if len(d) == 1 else tuple(d) for d in dims))


def _gather(x: jax.Array, dims: list[tuple[str, ...]], axis: str, dim: int,
            invariant: frozenset[str] = frozenset()) -> jax.Array:
    """all_gather `axis` on `dim`; it must be the dimension's minor axis (tiled order).
    Over an axis in `invariant` the gathered value is typed the same on every rank of
    it (its gradient is then the rank's slice, no reduction): what the product makes of
    it is replicated there."""
    if dims[dim][-1] != axis:
        raise AssertionError(f"cannot gather {axis} from {dims[dim]}: not the minor axis")
    dims[dim] = dims[dim][:-1]
    gather = all_gather_invariant if axis in invariant else jax.lax.all_gather
    return gather(x, axis, axis=dim, tiled=True)


def _nested() -> bool:
    """Whether this runs inside another shard_map (the pipeline's, manual over it)."""
    ctx = jax.sharding.get_abstract_mesh()
    return not ctx.empty and bool(ctx.manual_axes)


def _shard_map(body, mesh: Mesh, in_specs, out_specs, n_diff: int):
    """shard_map(body) over the mesh's free axes, differentiable in its first `n_diff`
    arguments.

    Inside the pipeline's shard_map, this JAX's Shardy lowering rejects the
    derivative of a nested shard_map (its linearised form names the outer manual
    axis). So there the derivative is spelled with custom_vjp: the backward is
    two more forward-only shard_maps, one per differentiated argument, each
    taking the vjp of `body` inside, so a zero-bubble backward can still run the
    input gradient and the weight gradient apart. They re-gather what the
    forward gathered instead of keeping it (the forward's gather volume once more
    per matmul); outside a pipeline, autodiff of the plain shard_map keeps it.
    """
    if not _nested():
        return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    ctx = jax.sharding.get_abstract_mesh()
    free = set(ctx.axis_names) - set(ctx.manual_axes)

    def smap(fn, ins, outs):
        return jax.shard_map(fn, mesh=ctx, in_specs=ins, out_specs=outs, axis_names=free)

    @jax.custom_vjp
    def f(*args):
        return smap(body, in_specs, out_specs)(*args)

    def fwd(*args):
        return f(*args), args

    def bwd(args, dy):
        grads = []
        for i in range(len(args)):
            if i >= n_diff:
                grads.append(np.zeros(args[i].shape, jax.dtypes.float0))
                continue

            def one(*a_and_dy, i=i):
                *a, g = a_and_dy
                fn = (lambda ai: body(*a[:i], ai, *a[i + 1:]))
                return jax.vjp(fn, a[i])[1](g)[0]

            grads.append(smap(one, (*in_specs, out_specs), in_specs[i])(*args, dy))
        return tuple(grads)

    f.defvjp(fwd, bwd)
    return f


def gathered_matmul(eq: str, x: jax.Array, w: jax.Array, *, mesh: Mesh, x_spec: P, w_spec: P,
                    out_spec: P, x_contracted: Sequence[int], w_contracted: Sequence[int]
                    ) -> jax.Array:
    """einsum(eq, x, w) with x, w and the result laid out as the three specs say.

    x's leading (non-contracted) dimensions come first in the output, then w's
    output dimensions, as `eq` spells.
    """
    xd, wd = _dims(x_spec, x.ndim), _dims(w_spec, w.ndim)
    x_lead = [i for i in range(x.ndim) if i not in x_contracted]
    w_out = [i for i in range(w.ndim) if i not in w_contracted]
    ax_c = {a for i in x_contracted for a in xd[i]}
    aw_c = {a for i in w_contracted for a in wd[i]}
    aw_o = {a for i in w_out for a in wd[i]}
    partial = sorted(ax_c & aw_c)

    # The layout the body produces, for shard_map's out_specs.
    xd_after = [tuple(a for a in xd[i] if a not in aw_o) for i in x_lead]
    res = xd_after + [wd[i] for i in w_out]
    for axis in partial:
        target = [i for i, d in enumerate(_dims(out_spec, len(res))) if axis in d]
        if len(target) != 1:
            raise AssertionError(f"output spec {out_spec} does not place partial axis {axis}")
        res[target[0]] = res[target[0]] + (axis,)
    if _spec(res) != _spec(_dims(out_spec, len(res))):
        raise AssertionError(f"gathered matmul makes {_spec(res)}, wanted {out_spec}")
    # An operand's contracted axis the other lacks and the product is replicated over
    # (a weight's output not split over the axis its input's features are: key/value
    # heads too few for tensor_col) is gathered invariant, or the product would be
    # typed varying over it.
    in_res = {a for d in res for a in d}
    invariant = frozenset(ax_c ^ aw_c) - in_res
    vary = {a for d in xd for a in d} - {a for d in wd for a in d} - invariant

    def body(xb: jax.Array, wb: jax.Array) -> jax.Array:
        xdims, wdims = list(xd), list(wd)
        for i in x_contracted:
            for a in reversed(xd[i]):
                if a not in aw_c:
                    xb = _gather(xb, xdims, a, i, invariant)
        for i in x_lead:
            for a in reversed(xd[i]):
                if a in aw_o:
                    xb = _gather(xb, xdims, a, i)
        wb = vary_over(wb, vary)
        for i in w_contracted:
            for a in reversed(wd[i]):
                if a not in ax_c:
                    wb = _gather(wb, wdims, a, i, invariant)
        y = jnp.einsum(eq, xb, wb)
        for axis in partial:
            dim = next(i for i, d in enumerate(res) if axis in d)
            y = jax.lax.psum_scatter(y, axis, scatter_dimension=dim, tiled=True)
        return y

    return _shard_map(body, mesh, (x_spec, w_spec), out_spec, n_diff=2)(x, w)


def sharded_lookup(table: jax.Array, ids: jax.Array, *, mesh: Mesh, table_spec: P,
                   out_spec: P) -> jax.Array:
    """table[ids] for a table [vocab, embed] split over the grid, result laid out as `out_spec`.

    The lookup is the matmul one_hot(ids) @ table with the one-hot never built:
    each device gathers its table block over the axes the output does not keep
    on the embedding dimension, looks up the ids that fall in its vocabulary
    block (the others give zeros), and reduce-scatters the partial rows over
    the vocabulary axis.
    """
    vocab_axes, embed_axes = _dims(table_spec, 2)
    od = _dims(out_spec, ids.ndim + 1)
    if len(vocab_axes) > 1:
        raise AssertionError(f"vocabulary split over several axes {vocab_axes}")
    vaxis = vocab_axes[0] if vocab_axes else None
    ids_dims = [tuple(a for a in d if a != vaxis) for d in od[:-1]]
    ids_spec = _spec(ids_dims)
    vary = {a for d in ids_dims for a in d} - set(vocab_axes) - set(embed_axes)

    def body(tb: jax.Array, ib: jax.Array) -> jax.Array:
        tdims = [vocab_axes, embed_axes]
        tb = vary_over(tb, vary)
        for a in reversed(embed_axes):
            if a not in od[-1]:
                tb = _gather(tb, tdims, a, 1)
        if vaxis is None:
            return jnp.take(tb, ib, axis=0)
        rows = tb.shape[0]
        local = ib - jax.lax.axis_index(vaxis) * rows
        hit = (local >= 0) & (local < rows)
        found = jnp.take(tb, jnp.where(hit, local, 0), axis=0)
        found = jnp.where(hit[..., None], found, jnp.zeros((), found.dtype))
        dim = next(i for i, d in enumerate(od) if vaxis in d)
        return jax.lax.psum_scatter(found, vaxis, scatter_dimension=dim, tiled=True)

    return _shard_map(body, mesh, (table_spec, ids_spec), out_spec, n_diff=1)(table, ids)
