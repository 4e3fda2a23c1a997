"""A layer's backward cut into its input-gradient and weight-gradient halves.

Zero-bubble schedules run a microbatch's backward as two actions: Bx (the
input gradient, which the previous stage waits for) and W (the weight
gradients, which may wait). Calling one `jax.vjp` function twice and keeping
half of its result each time is correct but not cheap: the weight gradients of
a layer's lower matmuls need the gradients flowing into its upper ones, so the
second call recomputes the input-gradient chain (1.35x the matmul FLOPs of
1F1B on an 8-layer GPT).

Here the layer's traced backward is split at the equation level: Bx runs the
equations its input gradient needs and returns, besides it, every value of its
own that the weight gradients read (the gradients at the matmul outputs, the
"frontier"); W runs only the rest (the weight-gradient matmuls and sums), from
the frontier and the forward residuals. Together they run each matmul of the
backward once.

Two more things are read off the traced forward. Residuals that do not depend
on the layer's input (the parameters themselves, their casts, masks) are not
stashed per microbatch: the backward recomputes them from the parameters,
which every rank holds anyway. And each stashed residual is marked as read by
Bx, by W, or both, so a schedule can free what only Bx reads once Bx is done.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
from jax._src import source_info_util  # eqn name scopes (no public API)
from jax.extend import core as jcore

# Primitives whose body is inlined before the split: calls that only group
# equations (jit) or mark them for rematerialisation, which the backward has
# already applied.
_INLINE = frozenset({"jit", "pjit", "closed_call", "core_call", "checkpoint", "remat",
                     "remat2"})


def _body(eqn) -> tuple[jcore.Jaxpr, Sequence] | None:
    if eqn.primitive.name not in _INLINE:
        return None
    sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    if isinstance(sub, jcore.ClosedJaxpr):
        return sub.jaxpr, sub.consts
    if isinstance(sub, jcore.Jaxpr):
        return sub, ()
    return None


def _read(env: dict, a):
    return a.val if isinstance(a, jcore.Literal) else env[a]


def _bind(eqn, ins: list) -> list:
    """`eqn` run again on `ins`, under its own name scopes (as jax.core.eval_jaxpr runs
    one): the compiled program's op names keep them, and the FLOPs count reads one
    (`hlo.SIZED_BY_DATA`: without it a replayed dropless layer priced every spill
    size, 8x its FLOPs on a two-layer MoE on pipeline=2)."""
    names = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with source_info_util.user_context(eqn.source_info.traceback, name_stack=names):
        sub = _body(eqn)
        if sub is not None:
            return _eval(sub[0], sub[1], ins)
        params, subfuns = eqn.primitive.get_bind_params(eqn.params), ()
        if isinstance(params, tuple):  # older JAX: (subfuns, params)
            subfuns, params = params
        with eqn.ctx.manager:
            out = eqn.primitive.bind(*subfuns, *ins, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _eval(jaxpr: jcore.Jaxpr, consts: Sequence, args: Sequence, eqns=None,
          env: dict | None = None, outs=None) -> list:
    """Evaluate `jaxpr` (or only `eqns` of it, indices in order) in the current trace."""
    env = dict(env or {})
    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update((v, x) for v, x in zip(jaxpr.invars, args, strict=True) if x is not None)
    for i in (range(len(jaxpr.eqns)) if eqns is None else eqns):
        e = jaxpr.eqns[i]
        for v, x in zip(e.outvars, _bind(e, [_read(env, a) for a in e.invars]), strict=True):
            if not isinstance(v, jcore.DropVar):
                env[v] = x
    return [_read(env, a) for a in (jaxpr.outvars if outs is None else outs)]


def _flat(fn: Callable, *args) -> jcore.ClosedJaxpr:
    """`fn` traced with every call inlined: one flat list of equations to cut."""
    closed = jax.make_jaxpr(fn)(*args)
    return jax.make_jaxpr(lambda *a: _eval(closed.jaxpr, closed.consts, a))(*args)


def _is_var(a) -> bool:
    return isinstance(a, jcore.Var) and not isinstance(a, jcore.Literal)


def _needed(jaxpr: jcore.Jaxpr, outs: Sequence, skip: frozenset = frozenset()) -> list[int]:
    """Indices (in order) of the equations `outs` depend on, not entering `skip`."""
    producer = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
    seen: set[int] = set()
    stack = [a for a in outs if _is_var(a)]
    while stack:
        i = producer.get(stack.pop())
        if i is None or i in seen or i in skip:
            continue
        seen.add(i)
        stack += [a for a in jaxpr.eqns[i].invars if _is_var(a)]
    return sorted(seen)


def _depends_on(jaxpr: jcore.Jaxpr, roots: set) -> set:
    """Every variable computed from `roots`."""
    dep = set(roots)
    for e in jaxpr.eqns:
        if any(_is_var(a) and a in dep for a in e.invars):
            dep.update(e.outvars)
    return dep


# Primitives W may run again rather than receive their result from Bx: elementwise
# arithmetic and layout, no matmul, no reduction (over a split dimension, a collective),
# no sharding change.
_CHEAP = frozenset({
    "convert_element_type", "mul", "add", "add_any", "sub", "div", "neg", "max", "min",
    "exp", "log", "tanh", "logistic", "rsqrt", "sqrt", "integer_pow", "square", "abs",
    "sign", "erf", "select_n", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not",
    "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "reduce_precision", "copy",
    "copy_p", "name"})


def _nbytes(v) -> int:
    return int(v.aval.size) * v.aval.dtype.itemsize


def _handed(jaxpr: jcore.Jaxpr, w_eqns: list[int], producer: dict, in_b: set[int]) -> set:
    """The values of Bx that W reads as they are: handed over whatever else W recomputes,
    so recomputing from them costs the frontier nothing."""
    return {a for i in w_eqns for a in jaxpr.eqns[i].invars
            if _is_var(a) and producer.get(a) in in_b}


def _cheap_for_w(jaxpr: jcore.Jaxpr, w_eqns: list[int], b_eqns: list[int]) -> list[int]:
    """Equations of Bx to run again in W, where that hands W fewer bytes: a value W reads
    that Bx made by cheap steps (`_CHEAP`) from residuals (which W may read itself) and
    from Bx's other values (the leaves, handed over instead) is made again in W when the
    leaves are smaller than it (none: a norm's normalised input, from the norm's input
    and statistics; one of half its size: a float32 gradient cast from bf16). A leaf W
    reads from Bx anyway costs nothing more (a gradient that W reads both flattened and
    in heads: add_bias's reshapes)."""
    producer = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
    cotangent = jaxpr.invars[-1]
    in_b = set(b_eqns)
    chosen: set[int] = set()
    handed = _handed(jaxpr, w_eqns, producer, in_b)

    def walk(v, acc: set[int], leaves: dict, root) -> None:
        """v's cheap Bx equations into acc, the Bx values they start from into leaves."""
        i = producer.get(v)
        if i is None:  # an input: a residual (W reads it itself) or the cotangent
            if v is cotangent:
                leaves[v] = None
            return
        if i not in in_b or i in acc or i in chosen:
            return  # made in W already, or on this walk or an earlier one
        if jaxpr.eqns[i].primitive.name not in _CHEAP or (v in handed and v is not root):
            leaves[v] = None
            return
        acc.add(i)
        for a in jaxpr.eqns[i].invars:
            if _is_var(a):
                walk(a, acc, leaves, root)

    for i in w_eqns:
        for a in jaxpr.eqns[i].invars:
            if _is_var(a) and producer.get(a) in in_b:
                acc: set[int] = set()
                leaves: dict = {}
                walk(a, acc, leaves, a)
                if acc and sum(_nbytes(x) for x in leaves if x not in handed) < _nbytes(a):
                    chosen |= acc
    return sorted(chosen)


@dataclass
class LayerGrad:
    """The forward, the whole backward, and the two halves of the backward of one layer
    `layer(params, h) -> h'`, traced once at the example values (inside shard_map:
    the traced values carry how they vary over the mesh). With `extra_example`, the
    layer is `layer(params, h, extra)`: an input of the microbatch that takes no
    gradient (packed documents' segments); every method then takes it last, and the
    residuals made from it and the parameters alone are recomputed, not stashed."""

    layer: Callable
    p_example: object
    h_example: jax.Array
    extra_example: jax.Array | None = None

    def _bound(self, extra):
        return self.layer if extra is None else (lambda p, h: self.layer(p, h, extra))

    def __post_init__(self):
        p_leaves, self.p_tree = jax.tree.flatten(self.p_example)
        n_p = len(p_leaves)
        extra = [] if self.extra_example is None else [self.extra_example]
        y, vjp_fn = jax.vjp(self._bound(self.extra_example), self.p_example, self.h_example)
        res, self.vjp_tree = jax.tree.flatten(vjp_fn)

        def fwd(*args):
            p = jax.tree.unflatten(self.p_tree, args[:n_p])
            out, f = jax.vjp(self._bound(args[n_p + 1] if extra else None), p, args[n_p])
            return [out, *jax.tree.leaves(f)]

        self.fwd = _flat(fwd, *p_leaves, self.h_example, *extra)
        fj = self.fwd.jaxpr
        from_h = _depends_on(fj, {fj.invars[n_p]})
        res_vars = fj.outvars[1:]
        # Residuals computed from the parameters alone are recomputed, not stashed.
        self.stashed = [i for i, v in enumerate(res_vars) if _is_var(v) and v in from_h]
        self.static = [i for i in range(len(res_vars)) if i not in self.stashed]
        self._fwd_eqns = _needed(fj, [fj.outvars[0]] + [res_vars[i] for i in self.stashed])
        self._static_eqns = _needed(fj, [res_vars[i] for i in self.static])

        def bwd(*args):
            return jax.tree.leaves(jax.tree.unflatten(self.vjp_tree, args[:-1])(args[-1]))

        self.bwd = _flat(bwd, *res, y)
        bj = self.bwd.jaxpr
        dp_vars, dh_var = bj.outvars[:-1], bj.outvars[-1]
        b_eqns = _needed(bj, [dh_var])
        w_eqns = _needed(bj, dp_vars, skip=frozenset(b_eqns))
        # What W reads of Bx's values that Bx made by cheap elementwise steps from
        # residuals and smaller values of its own (a norm's normalised input, which the
        # norm no longer keeps; a float32 gradient cast from bf16), W computes again
        # from those instead of Bx handing it over: the frontier is held from Bx to W,
        # often for several microbatches.
        w_eqns = sorted(set(w_eqns) | set(_cheap_for_w(bj, w_eqns, b_eqns)))
        made_in_b = {v for i in b_eqns for v in bj.eqns[i].outvars} | {bj.invars[-1]}
        w_reads = [a for i in w_eqns for a in bj.eqns[i].invars if _is_var(a)]
        w_reads += [a for a in dp_vars if _is_var(a)]
        made_in_w = {v for i in w_eqns for v in bj.eqns[i].outvars}
        self.frontier = list(dict.fromkeys(a for a in w_reads
                                           if a in made_in_b and a not in made_in_w))
        res_in = {v: i for i, v in enumerate(bj.invars[:-1])}
        b_reads = {a for i in b_eqns for a in bj.eqns[i].invars if _is_var(a)} | {dh_var}
        w_read_set = set(w_reads)
        stashed = set(self.stashed)
        # Stashed residuals, by who reads them: Bx only, or W (and maybe Bx too).
        self.res_w = [i for v, i in res_in.items() if i in stashed and v in w_read_set]
        self.res_b = [i for v, i in res_in.items() if i in stashed and v in b_reads
                      and i not in self.res_w]
        self._b_eqns, self._w_eqns = b_eqns, w_eqns

    # --- pieces --------------------------------------------------------------------
    def _args(self, p, h, extra) -> list:
        """The flat forward's inputs (h None: not needed)."""
        return [*jax.tree.leaves(p), h, *([] if self.extra_example is None else [extra])]

    def _residuals(self, p, stashed: dict[int, jax.Array], extra=None) -> list:
        """Every residual of the vjp: the stashed ones given, the rest from `p` (and
        `extra`)."""
        fj = self.fwd.jaxpr
        static = _eval(fj, self.fwd.consts, self._args(p, None, extra),
                       eqns=self._static_eqns, outs=[fj.outvars[1 + i] for i in self.static])
        full = dict(zip(self.static, static, strict=True)) | stashed
        return [full.get(i) for i in range(len(fj.outvars) - 1)]

    def forward(self, p, h, extra=None) -> tuple[jax.Array, list]:
        """(layer output, the residuals to stash: `self.stashed`, in order)."""
        fj = self.fwd.jaxpr
        outs = _eval(fj, self.fwd.consts, self._args(p, h, extra), eqns=self._fwd_eqns,
                     outs=[fj.outvars[0]] + [fj.outvars[1 + i] for i in self.stashed])
        return outs[0], outs[1:]

    def backward(self, p, stashed: list, g, extra=None) -> tuple[object, jax.Array]:
        """(parameter gradients, input gradient): the whole backward."""
        res = self._residuals(p, dict(zip(self.stashed, stashed, strict=True)), extra)
        outs = _eval(self.bwd.jaxpr, self.bwd.consts, [*res, g])
        return jax.tree.unflatten(self.p_tree, outs[:-1]), outs[-1]

    def backward_input(self, p, res_b: list, res_w: list, g, extra=None
                       ) -> tuple[jax.Array, list]:
        """(input gradient, frontier): the Bx half. res_b / res_w: the stashed
        residuals listed in `self.res_b` / `self.res_w`."""
        stashed = dict(zip(self.res_b, res_b, strict=True))
        stashed |= dict(zip(self.res_w, res_w, strict=True))
        res = self._residuals(p, stashed, extra)
        bj = self.bwd.jaxpr
        outs = _eval(bj, self.bwd.consts, [*res, g], eqns=self._b_eqns,
                     outs=[bj.outvars[-1], *self.frontier])
        return outs[0], outs[1:]

    def backward_weight(self, p, res_w: list, frontier: list, extra=None):
        """Parameter gradients: the W half, from what Bx kept."""
        res = self._residuals(p, dict(zip(self.res_w, res_w, strict=True)), extra)
        bj = self.bwd.jaxpr
        env = dict(zip(self.frontier, frontier, strict=True))
        outs = _eval(bj, self.bwd.consts, [*res, None], eqns=self._w_eqns, env=env,
                     outs=bj.outvars[:-1])
        return jax.tree.unflatten(self.p_tree, outs)

    # --- what the executor allocates ----------------------------------------------
    def examples(self) -> dict[str, list]:
        """Example values (shapes, dtypes) of the stashed residuals and the frontier."""
        fj = self.fwd.jaxpr
        res = [fj.outvars[1 + i].aval for i in range(len(fj.outvars) - 1)]
        return {"stashed": [res[i] for i in self.stashed], "res_b": [res[i] for i in self.res_b],
                "res_w": [res[i] for i in self.res_w], "frontier": [v.aval for v in self.frontier]}
