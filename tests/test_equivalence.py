"""The same experiment gives the same losses on every mesh (float32, 12 steps)."""

import collections
import contextlib
import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import losses, run, tiny

MESHES = ["data=8", "fsdp=8", "tensor=8", "data=2,fsdp=2,tensor=2"]


def test_reference_learns(tiny_reference):
    assert len(tiny_reference) == 12
    assert tiny_reference[-1] < tiny_reference[0] - 0.2


@pytest.mark.parametrize("spec", MESHES)
def test_losses_equal_one_device(spec, tiny_reference, tmp_path):
    got = losses(run(tiny(), spec, tmp_path))
    np.testing.assert_allclose(got, tiny_reference, rtol=1e-4)


def test_gradient_accumulation_equals_full_batch(tiny_reference, tmp_path):
    exp = tiny(train={"microbatches": 4})
    got = losses(run(exp, "data=2,fsdp=2,tensor=2", tmp_path))
    np.testing.assert_allclose(got, tiny_reference, rtol=1e-4)


@pytest.mark.parametrize("model", [{"scan_layers": True, "layers": 2},
                                   {"scan_layers": True, "remat": True, "layers": 3}])
def test_scanned_layers_equal_the_unrolled_loop(model, tmp_path):
    ref = losses(run(tiny(model={"layers": model["layers"]}), "data=1", tmp_path / "a"))
    got = losses(run(tiny(model=model), "data=2,fsdp=2,tensor=2", tmp_path / "b"))
    np.testing.assert_allclose(got, ref, rtol=1e-4)


def test_remat_policies_train_equally(tmp_path):
    """save_dots keeps matmul outputs and recomputes the rest, save_attention keeps the
    attention block's and recomputes the MLP: same losses as no remat, scanned or not,
    split over tensor; the old boolean spelling still reads."""
    from plait.config import GPTConfig

    assert GPTConfig(remat=True).remat == "full" and GPTConfig(remat=False).remat == "none"
    ref = losses(run(tiny(model={"layers": 3}), "data=1", tmp_path / "a"))
    got = losses(run(tiny(model={"layers": 3, "remat": "save_dots", "scan_layers": True}),
                     "data=2,fsdp=2,tensor=2", tmp_path / "b"))
    np.testing.assert_allclose(got, ref, rtol=1e-4)
    got = losses(run(tiny(model={"layers": 3, "remat": "save_attention"}), "fsdp=2,tensor=4",
                     tmp_path / "c"))
    np.testing.assert_allclose(got, ref, rtol=1e-4)


def test_remat_policies_keep_less_and_recompute_more_in_order():
    """From the compiled step (one device, a 4x-wide MLP): each policy in the order none,
    save_dots, save_attention, save_qkv, full keeps less memory, and from save_dots on
    recomputes more FLOPs (save_dots recomputes no matmul)."""
    from plait import sweep

    exp = tiny(model={"layers": 4, "d_ff": 512, "seq_len": 64}, train={"global_batch": 8})
    order = ["none", "save_dots", "save_attention", "save_qkv", "full"]
    got = {r: sweep.measure(sweep.Candidate({"data": 1}, {"model.remat": r}).experiment(exp),
                            sweep.Candidate({"data": 1}), 1) for r in order}
    memory = [got[r]["memory"] for r in order]
    flops = [got[r]["flops"] for r in order]
    assert memory == sorted(memory, reverse=True) and len(set(memory)) == 5, memory
    assert flops[0] == pytest.approx(flops[1], rel=1e-3), flops
    assert flops[1:] == sorted(flops[1:]) and len(set(flops[1:])) == 4, flops


def test_untied_head_and_remat_train_equally(tmp_path):
    base = losses(run(tiny(model={"tie_embeddings": False}), "data=1", tmp_path / "a"))
    remat = losses(run(tiny(model={"tie_embeddings": False, "remat": True}), "fsdp=2,tensor=4",
                       tmp_path / "b"))
    np.testing.assert_allclose(remat, base, rtol=1e-4)


def test_bfloat16_compute_keeps_float32_state(tmp_path):
    from helpers import make_mesh

    from plait.tasks.gpt import GPTTask as Job

    exp = tiny(precision={"compute": "bfloat16"})
    got = losses(run(exp, "data=2,fsdp=2,tensor=2", tmp_path))
    ref = losses(run(tiny(), "data=2,fsdp=2,tensor=2", tmp_path / "f32"))
    assert np.all(np.isfinite(got)) and got[-1] < got[0] - 0.2
    # bf16 rounding moves the curve a little, not a lot.
    np.testing.assert_allclose(got, ref, rtol=3e-2)
    job = Job(exp, make_mesh("data=2,fsdp=2,tensor=2"))
    dtypes = {x.dtype for x in jax.tree.leaves(job.layout.shapes)}
    assert dtypes <= {np.dtype("float32"), np.dtype("int32")}


def test_state_is_born_sharded(tmp_path):
    """Parameters and optimizer moments carry the rule-set shardings from creation."""
    from helpers import make_mesh

    from plait.tasks.gpt import GPTTask as Job

    job = Job(tiny(), make_mesh("data=2,fsdp=2,tensor=2"))
    state = job.init_state()
    w1 = state["params"]["blocks"]["0"]["mlp"]["w1"]
    assert w1.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
    assert w1.addressable_shards[0].data.shape == (32, 64)
    mu = jax.tree.leaves(state["opt_state"])
    assert any(x.ndim == 2 and x.sharding.spec == w1.sharding.spec for x in mu)


@pytest.mark.parametrize("tied", [True, False])
def test_vocabulary_padding_leaves_losses_unchanged(tied, tmp_path):
    """vocab 200 padded to 256 (for sharding) trains exactly like vocab 200 unpadded: the
    padded rows start at zero, are never looked up, and their logits leave the loss."""
    model = {"vocab": 200, "tie_embeddings": tied}
    exact = losses(run(tiny(model={**model, "vocab_multiple": 1}), "data=1", tmp_path / "a"))
    padded = losses(run(tiny(model={**model, "vocab_multiple": 128}), "data=1", tmp_path / "b"))
    np.testing.assert_allclose(padded, exact, rtol=1e-5)


@pytest.mark.parametrize("spec,products", [(None, 3), ("data=2,fsdp=2", 3), ("tensor=2", 1)])
def test_fused_projection_parts_equal_the_fused_products_slices(spec, products):
    """parallel.ops.dense_parts (a fused q/k/v projection as one product per part, so
    that a GPU copies no slice of it) computes the fused product's slices, values and
    gradients; where the heads are split across devices (1-D tensor) it is the fused
    product itself (three products' input gradients were three all-reduces)."""
    from flax import nnx
    from helpers import make_mesh

    from plait import sharding
    from plait.parallel.ops import dense, dense_parts
    from plait.tasks.gpt import GPTTask

    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (4, 8, 16))
    value = jax.random.normal(kw, (16, 3, 4, 8))
    cot = jax.random.normal(kg, (3, 4, 8, 4, 8))
    mesh = make_mesh(spec) if spec else None
    rules = GPTTask(tiny(), mesh).rules if mesh else None

    def weighted(parts_of):
        def f(x, value):
            with sharding.use(mesh, rules) if mesh else contextlib.nullcontext():
                w = nnx.Param(value, logical_axes=("embed", "qkv", "heads", "head_dim"),
                              fan_in=("embed",))
                return sum(jnp.sum(p * c) for p, c in zip(parts_of(x, w), cot, strict=True))
        return f

    parts = weighted(lambda x, w: dense_parts(x, w, "qkv"))
    sliced = weighted(lambda x, w: [dense(x, w)[:, :, i] for i in range(3)])
    got, want = (jax.jit(jax.value_and_grad(f, (0, 1)))(x, value) for f in (parts, sliced))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), got, want)
    counts = _primitives(jax.make_jaxpr(parts)(x, value).jaxpr)
    assert counts["dot_general"] == products, counts


def test_the_parts_input_gradients_are_summed_newest_first():
    """dense_parts' products read x through parallel.ops.fan_out, which sums their input
    gradients as g2 + (g1 + g0): each sum's left operand is a product, the form XLA:GPU
    folds into the product as its addend (autodiff's own (g0 + g1) + g2 left one add
    kernel per layer on an H100). The same gradient either way."""
    from plait.parallel.ops import fan_out

    x = jax.random.normal(jax.random.key(0), (6, 4))
    ws = jax.random.normal(jax.random.key(1), (3, 4, 5))

    def products(x, reader):
        return sum(jnp.sum(jnp.sin(xi @ w)) for xi, w in zip(reader(x), ws, strict=True))

    ours = jax.grad(lambda x: products(x, lambda x: fan_out(x, 3)))
    np.testing.assert_allclose(ours(x), jax.grad(lambda x: products(x, lambda x: (x,) * 3))(x),
                               rtol=1e-6)
    eqns = jax.make_jaxpr(ours)(x).jaxpr.eqns
    made_by = {v: e.primitive.name for e in eqns for v in e.outvars}
    adds = [e for e in eqns if e.primitive.name in ("add", "add_any")
            and e.outvars[0].aval.shape == x.shape]
    assert len(adds) == 2, adds
    for e in adds:  # the newest product on the left, the running sum on the right
        assert made_by[e.invars[0]] == "dot_general", e


@pytest.mark.parametrize("bias_shape", [(8,), (4, 8), (2, 4, 8)])
def test_a_bias_of_several_dimensions_is_added_as_one_vector(bias_shape):
    """parallel.ops.add_bias adds a [heads, head] (or [2, kv_heads, head]) bias over the
    output's trailing dimensions flattened, so that XLA:GPU fuses it into the product
    (cuBLASLt's BIAS epilogue) rather than writing its broadcast out: the same values,
    bit for bit, and a broadcast of a vector."""
    from plait.parallel.ops import add_bias

    y = jax.random.normal(jax.random.key(0), (3, 5, *bias_shape))
    b = jax.random.normal(jax.random.key(1), bias_shape)
    np.testing.assert_array_equal(add_bias(y, b), y + b)
    jaxpr = jax.make_jaxpr(add_bias)(y, b).jaxpr
    broadcast = [e for e in jaxpr.eqns if e.primitive.name == "broadcast_in_dim"]
    assert [e.invars[0].aval.ndim for e in broadcast] == [1], jaxpr
    g = jax.random.normal(jax.random.key(2), y.shape)
    got, want = (jax.vjp(f, y, b)[1](g) for f in (add_bias, jnp.add))
    jax.tree.map(np.testing.assert_array_equal, got, want)


@pytest.mark.parametrize("eq", ["...ecd,edgf->...ecgf", "ecf,efd->ecd"])
def test_a_weight_product_gives_autodiffs_gradients_in_the_weights_order(eq):
    """parallel.products.weight_product: the value and both gradients of jnp.einsum's
    autodiff, the weight's from one dot_general whose output is already in the
    weight's order (autodiff's ends in a transpose, which XLA:GPU made the gradient's
    layout: AdamW then read the experts' gate-up gradient through a transpose)."""
    from plait.parallel.products import weight_product

    ins, _ = eq.split("->")
    sizes = {"e": 2, "c": 3, "d": 4, "g": 2, "f": 5, ".": 0}
    xs, ws = (s.replace("...", "") for s in ins.split(","))
    lead = (3,) if "..." in eq else ()
    x = jax.random.normal(jax.random.key(0), lead + tuple(sizes[c] for c in xs))
    w = jax.random.normal(jax.random.key(1), tuple(sizes[c] for c in ws))
    g = jax.random.normal(jax.random.key(2), jax.eval_shape(
        lambda x, w: jnp.einsum(eq, x, w), x, w).shape)
    got, want = (jax.vjp(f, x, w) for f in (functools.partial(weight_product, eq),
                                            functools.partial(jnp.einsum, eq)))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    for a, b in zip(got[1](g), want[1](g), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for f, last in ((functools.partial(weight_product, eq), "dot_general"),
                    (functools.partial(jnp.einsum, eq), "transpose")):
        jaxpr = jax.make_jaxpr(lambda x, w, f=f: jax.vjp(f, x, w)[1](g)[1])(x, w).jaxpr
        assert _made_by(jaxpr, jaxpr.outvars[0]) == last, jaxpr


def _made_by(jaxpr, v) -> str:
    """The primitive that made v, looking through casts and into calls."""
    for eqn in jaxpr.eqns:
        if v in eqn.outvars:
            if eqn.primitive.name == "convert_element_type":
                return _made_by(jaxpr, eqn.invars[0])
            subs = list(jax.extend.core.jaxprs_in_params(eqn.params))
            if subs and len(subs[0].outvars) == len(eqn.outvars):
                return _made_by(subs[0], subs[0].outvars[eqn.outvars.index(v)])
            return eqn.primitive.name
    return "input"


def _primitives(jaxpr, counts=None) -> collections.Counter:
    """How many times each primitive occurs in a jaxpr, its sub-jaxprs included."""
    counts = collections.Counter() if counts is None else counts
    for eqn in jaxpr.eqns:
        counts[eqn.primitive.name] += 1
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            _primitives(sub, counts)
    return counts
