"""Mixture of experts: with room for every token, loss and gradients on expert-parallel
meshes equal the one-device run (the router losses' gradients included), through a
pipeline too; dropless equals capacity without drops, over an expert axis too; a small
capacity drops what a NumPy dispatch of the same routing drops; the router losses equal
their formulas; the compiled bytes over the expert axis equal the formula; the metrics
reach metrics.jsonl."""

from __future__ import annotations

import functools
import json

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import losses, make_mesh, run, tiny

# Llama layout, 4 experts, 2 per token, a shared expert behind its gate (Qwen-MoE's);
# capacity factor 2 = E / k gives every expert room for every token of a sequence, so
# nothing is dropped.
MOE = {"experts": 4, "top_k": 2, "capacity_factor": 2.0, "shared_d_ff": 32,
       "shared_gate": True, "aux_weight": 0.1, "z_weight": 0.01}
UNSHARED = {"shared_d_ff": 0, "shared_gate": False}
MODEL = {"kind": "llama", "heads": 8, "kv_heads": 2, "d_ff": 64, "rope_theta": 10000.0}
TWO_LAYERS = {"layers": 2}  # a layer per stage of pipeline=2


def experiment(moe: dict | None = None, **sections):
    model = {**MODEL, "moe": {**MOE, **(moe or {})}, **sections.pop("model", {})}
    return tiny(model=model, **sections)


def _tokens(exp, rows=None):
    rng = np.random.default_rng(0)
    return jnp.asarray(rng.integers(0, exp.model.vocab, (rows or exp.train.global_batch,
                                                         exp.model.seq_len + 1)), jnp.int32)


@functools.cache
def compiled_grads(spec: str, moe: tuple = (), model: tuple = (), compute: str = "float32"):
    """(task, params, tokens, compiled value-and-gradient of one batch) on `spec`."""
    from plait.tasks.gpt import GPTTask

    exp = experiment(dict(moe), model={"layers": 1, **dict(model)},  # one block shows it all
                     precision={"compute": compute})
    task = GPTTask(exp, make_mesh(spec))
    params = task.init_state()["params"]
    grad_fn = jax.jit(jax.value_and_grad(task.loss_and_metrics, has_aux=True))
    return task, params, _tokens(exp), grad_fn.lower(params, _tokens(exp)).compile()


@functools.cache
def loss_and_grads(spec: str, moe: tuple = (), model: tuple = (), compute: str = "float32"):
    """(loss, gradients, router metrics) of one batch on `spec`, gradients per layer."""
    task, params, tokens, compiled = compiled_grads(spec, moe, model, compute)
    (loss, metrics), grads = compiled(params, tokens)
    if task.stacked:
        from plait import models

        grads = models.unstack(grads, "blocks")
    return float(loss), jax.tree.map(np.asarray, grads), jax.tree.map(float, metrics)


def assert_trees_close(got, want, rtol=1e-5):
    for path, g in jax.tree_util.tree_leaves_with_path(got):
        w = want
        for k in path:
            w = w[k.key]
        # rtol of each gradient's scale (elements near 0 have no relative precision)
        np.testing.assert_allclose(g, w, atol=rtol * np.abs(w).max(), rtol=rtol,
                                   err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("spec,model", [
    ("expert=4", ()),
    ("data=2,expert=4", (("scan_layers", True), ("remat", "full"))),
    ("expert=2,tensor=2,fsdp=2", ()),
], ids=["expert4", "data2-expert4-stacked-remat", "expert2-tensor2-fsdp2"])
def test_loss_and_gradients_equal_one_device(spec, model):
    want_loss, want, want_metrics = loss_and_grads("data=1")
    got_loss, got, got_metrics = loss_and_grads(spec, (), model)
    assert want_metrics["moe_dropped_fraction"] == 0.0
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    assert_trees_close(got, want)
    for key, value in want_metrics.items():
        np.testing.assert_allclose(got_metrics[key], value, rtol=1e-5, err_msg=key)


@pytest.mark.parametrize("spec,moe", [("data=2,expert=4", ()),
                                      ("data=2,expert=2,tensor=2",
                                       (("capacity_factor", 0.0),))],
                         ids=["capacity", "dropless"])
def test_bfloat16_experts_beside_a_data_axis_compile_and_train_like_one_device(spec, moe):
    """The expert weights' gradient sum over data (and fsdp) runs in float32, and so do
    dropless's sums over `expert` (all-to-all, then added) and over `tensor` (the
    experts' hidden slices' outputs and the tokens' gradients): JAX's bfloat16
    all-reduce and reduce-scatter abort XLA:CPU's compiler (parallel.expert_sums: per_rank,
    sum_scatter, all_sum)."""
    want_loss, want, _ = loss_and_grads("data=1", compute="bfloat16")
    got_loss, got, _ = loss_and_grads(spec, moe, compute="bfloat16")
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-2)
    assert_trees_close(got, want, rtol=5e-2)


# data x 2-D tensor: each device's rows (over data x tensor_row) sorted apart, every
# expert on every device, each tensor_col rank its slice of their hidden units;
# expert x tensor x fsdp: the tokens all-gathered over `expert`, each rank's own
# experts (split over tensor inside) run on them, the outputs reduce-scattered back.
# data x expert, stacked and rematerialised: the grouped matmuls' custom VJP under
# jax.checkpoint inside the layers' scan.
@pytest.mark.parametrize("spec,model", [
    ("data=2,tensor_row=2,tensor_col=2", ()), ("expert=2,tensor=2,fsdp=2", ()),
    ("data=2,expert=4", (("scan_layers", True), ("remat", "full")))])
def test_dropless_equals_capacity_without_drops(spec, model):
    """Dropless equals capacity without drops, and no collective runs inside the
    grouped MLP's switch: the hidden slices' sums are outside it (XLA:CPU ordered
    those inside differently on different devices against the attention's, and plait
    train refused such a step as one that would hang; parallel.experts.split_axes)."""
    from plait import hlo

    dropless = (("capacity_factor", 0.0),)
    want_loss, want, _ = loss_and_grads("data=1")
    got_loss, got, metrics = loss_and_grads(spec, dropless, model)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    assert_trees_close(got, want)
    assert metrics["moe_dropped_fraction"] == 0.0
    mod = hlo.parse_hlo(compiled_grads(spec, dropless, model)[3].as_text())
    for kind in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                 "collective-permute"):
        assert not hlo.ops_in_branches(mod, kind), kind


def test_router_losses_join_the_gradient_with_their_weights():
    """The gradient the layers add for the router losses equals the gradient of
    aux_weight x moe_aux_loss + z_weight x moe_z_loss, taken through the metrics."""
    from plait.tasks.gpt import GPTTask

    grads = {}
    for name, moe in (("none", {"aux_weight": 0.0, "z_weight": 0.0}), ("with", {})):
        exp = experiment(moe, model={"layers": 1})
        task = GPTTask(exp, make_mesh("data=1"))
        params = task.init_state()["params"]
        grads[name] = jax.jit(jax.grad(task.loss))(params, _tokens(exp))
        if name == "none":
            def explicit(p, tokens, task=task):
                loss, metrics = task.loss_and_metrics(p, tokens)
                return loss + MOE["aux_weight"] * metrics["moe_aux_loss"] \
                    + MOE["z_weight"] * metrics["moe_z_loss"]
            grads["none+explicit"] = jax.jit(jax.grad(explicit))(params, _tokens(exp))
    injected = jax.tree.map(jnp.subtract, grads["with"], grads["none"])
    by_formula = jax.tree.map(jnp.subtract, grads["none+explicit"], grads["none"])
    router = injected["blocks"]["0"]["mlp"]["router"]
    assert float(jnp.abs(router).max()) > 0
    assert_trees_close(jax.tree.map(np.asarray, injected),
                       jax.tree.map(np.asarray, by_formula), rtol=1e-4)


def test_pipelines_train_like_one_device(tmp_path):
    """expert=2 x pipeline=2 and fsdp x tensor inside the stages (1F1B, 4 microbatches):
    losses equal the one-device run's, whose gradient has the router losses' of every
    microbatch; so do dropless experts inside pipeline stages (ZB-H1, whose split
    backward replays the layer's jaxpr), against the same run (dropless equals capacity
    without drops: test_dropless_equals_capacity_without_drops). The one-device run's
    router metrics reach metrics.jsonl and TensorBoard."""
    sections = {"train": {"microbatches": 4, "steps": 6}, "log": {"tensorboard": True},
                "model": TWO_LAYERS}
    want = losses(run(experiment(**sections), "data=1", tmp_path / "one"))
    got = losses(run(experiment(pipeline={"schedule": "1f1b", "microbatches": 4},
                                train={"steps": 6}, model=TWO_LAYERS),
                     "expert=2,pipeline=2", tmp_path / "pp"))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    # fsdp x tensor inside the stages: the router's shards and its logits' gradient
    # were moved between the two axes by permutes inside the tick's switch, and the
    # step was refused as one that would hang (models/moe.py pins both)
    got = losses(run(experiment(pipeline={"schedule": "1f1b", "microbatches": 4},
                                train={"steps": 6}, model=TWO_LAYERS),
                     "pipeline=2,fsdp=2,tensor=2", tmp_path / "pp-fsdp-tensor"))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert want[-1] < want[0] - 0.1
    # Dropless: the replay binds the sort's custom VJPs with the types it traced them
    # with; argsort's permutation came out typed as not varying over `pipeline` and the
    # replayed backward failed its varying-axes check (parallel/experts.py). ZB-H1 runs
    # 1F1B's forwards and input gradients too (1F1B had a run of its own until
    # 2026-11-28). data and tensor beside the pipeline: the layer's shard_map over them
    # has a backward of its own that recomputes the forward (autodiff's residuals could
    # not be laid out: such meshes were refused), and the tensor axis's sums sit
    # outside the grouped MLP's switch (plait train refused the step as one that would
    # hang on XLA:CPU).
    dropless = experiment({"capacity_factor": 0.0},
                          pipeline={"schedule": "zb-h1", "microbatches": 4},
                          train={"steps": 4}, model=TWO_LAYERS)
    got = losses(run(dropless, "data=2,pipeline=2,tensor=2", tmp_path / "dropless"))
    np.testing.assert_allclose(got, want[:4], rtol=1e-5)
    from plait.tasks import make_task
    from plait.tasks.gpt_runtime import start_up_lines

    (line,) = [x for x in start_up_lines(make_task(dropless, make_mesh(
        "data=2,pipeline=2,tensor=2"))) if "mixture of experts" in x]
    assert "backward runs the experts' forward again (data, tensor beside" in line, line

    rec = [json.loads(line)
           for line in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    for key in ("moe_aux_loss", "moe_z_loss", "moe_tokens_max", "moe_tokens_mean",
                "moe_dropped_fraction"):
        assert all(np.isfinite(r[key]) for r in rec), key
    # 16 rows / 4 microbatches x 32 tokens x 2 choices over 4 experts
    assert rec[0]["moe_tokens_mean"] == 4 * 32 * 2 / 4
    assert rec[0]["moe_dropped_fraction"] == 0.0
    assert list((tmp_path / "one" / "tensorboard").iterdir())


@pytest.mark.parametrize("spec,schedule,microbatches", [
    ("pipeline=2,tensor_row=2,tensor_col=2", "zb-h1", 2),
    ("pipeline=2,fsdp=2,tensor=2", "chimera", 2),
    ("pipeline=2,tensor_row=2,tensor_col=2", "1f1b", 4),  # one row per device
    ("pipeline=2,fsdp=2,tensor=2", "chimera", 4)])
def test_no_collective_permute_in_a_tick(spec, schedule, microbatches):
    """What hung moe-tiny's sweep --run: GSPMD moved the router (fsdp-sharded, d x E) and
    its logits' gradient between the fsdp and tensor / 2-D grid axes by collective-
    permutes inside the per-tick switch, which ranks on the other stage never reach; with
    one row per device, the tokens around the experts' weights likewise (they are
    gathered before use now: parallel.ops.expert_weight)."""
    from plait import hlo
    from plait.tasks.gpt import GPTTask

    # moe-tiny's 8 unshared experts (4 with a shared one did not show the 2-D case)
    task = GPTTask(experiment({"experts": 8, **UNSHARED},
                              pipeline={"schedule": schedule, "microbatches": microbatches},
                              train={"global_batch": 8}, model=TWO_LAYERS), make_mesh(spec))
    mod = hlo.parse_hlo(task.compile().as_text())
    assert any(i.opcode == "conditional" for c in mod.computations.values() for i in c)
    assert not hlo.ops_in_branches(mod, "collective-permute")


def test_router_losses_equal_their_formulas():
    from plait.models.moe import router_stats

    rng = np.random.default_rng(1)
    logits = rng.normal(size=(3, 5, 6)).astype(np.float32)
    idx = np.argsort(-logits, axis=-1)[..., :2]
    got = jax.tree.map(float, router_stats(jnp.asarray(logits), jnp.asarray(idx), 6))
    flat = logits.reshape(-1, 6)
    p = np.exp(flat - flat.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    counts = np.bincount(idx.reshape(-1), minlength=6)
    np.testing.assert_allclose(got["aux_loss"], 6 * np.sum(counts / 15 * p.mean(0)), rtol=1e-6)
    lse = np.log(np.exp(flat).sum(-1))
    np.testing.assert_allclose(got["z_loss"], np.mean(lse ** 2), rtol=1e-6)
    assert got["tokens_max"] == counts.max() and got["assigned"] == 30


def numpy_capacity(x, idx, gate, w1, w2, cap):
    """Capacity dispatch of a GELU mixture, written out: per sequence, first choices
    before second ones, earlier tokens first; an expert past `cap` drops the rest."""
    B, T, k = idx.shape
    y = np.zeros_like(x)
    dropped = 0
    for b in range(B):
        taken = np.zeros(w1.shape[0], int)
        for j in range(k):
            for t in range(T):
                e = idx[b, t, j]
                if taken[e] >= cap:
                    dropped += 1
                    continue
                taken[e] += 1
                h = x[b, t] @ w1[e]
                h = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3)))
                y[b, t] += gate[b, t, j] * (h @ w2[e])
    return y, dropped


@pytest.mark.parametrize("spec", ["data=1", "expert=4"])
def test_small_capacity_drops_what_numpy_drops(spec):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from plait import sharding
    from plait.parallel import experts

    rng = np.random.default_rng(2)
    B, T, d, f, E, k = 4, 12, 8, 16, 4, 2
    x = rng.normal(size=(B, T, d)).astype(np.float32)
    # Skewed routing: expert 0 is everyone's first choice.
    idx = np.stack([np.zeros((B, T), int), rng.integers(1, E, (B, T))], -1).astype(np.int32)
    gate = rng.uniform(size=(B, T, k)).astype(np.float32)
    w = {"w1": rng.normal(size=(E, d, f)).astype(np.float32) / 3,
         "w2": rng.normal(size=(E, f, d)).astype(np.float32) / 4}
    factor = 1.0  # 6 places per expert and sequence for 12 first choices of expert 0
    cap = experts.capacity(T, k, E, factor)
    want_y, want_dropped = numpy_capacity(x, idx, gate, w["w1"], w["w2"], cap)
    assert want_dropped >= B * (T - cap)
    mesh = make_mesh(spec)
    rules = sharding.rules_for(mesh)
    rows = NamedSharding(mesh, sharding.spec(["act_batch", None, None], rules, mesh))
    ws = {n: NamedSharding(mesh, P("expert" if "expert" in mesh.shape else None))
          for n in w}

    def dispatch(x, idx, gate, w):
        with sharding.use(mesh, rules):
            return experts.with_capacity(x, idx, gate, w, "gelu", factor)

    y, dropped = jax.jit(dispatch)(jax.device_put(x, rows), jax.device_put(idx, rows),
                                   jax.device_put(gate, rows), jax.device_put(w, ws))
    assert int(dropped) == want_dropped
    np.testing.assert_allclose(np.asarray(y), want_y, rtol=1e-5, atol=1e-5)


# (bulk, spill): how grouped_mlp splits the rows between its batched bulk, its batched
# spill tiles and its loop over tiles (parallel/grouped.py)
SPLITS = pytest.mark.parametrize("bulk,spill", [(1.0, 1.25), (1.0, 0.125), (1.0, 0.0),
                                                (0.0, 0.0), (0.0, 2.0), (0.5, 0.25)],
                                 ids=["bulk-spill", "bulk-spill-loop", "bulk-loop",
                                      "loop-only", "spill-only", "all-three"])


@SPLITS
@pytest.mark.parametrize("expected", [None, 24], ids=["all-rows", "a-quarter"])
@pytest.mark.parametrize("sizes", [[10, 0, 50, 30], [10, 0, 30, 60], [0, 0, 64, 0], [1, 2, 3, 4]])
def test_tiled_grouped_matmul_equals_ragged_dot(sizes, expected, bulk, spill):
    """Dropless's grouped matmuls, a share of each group batched (bulk), tiles of the
    rows past it batched with their groups' weights gathered (spill), the rest in a loop
    over tiles: the values and both gradients of jax.lax.ragged_dot, empty groups and
    rows past the groups (another rank's, zeros) included; whether the routed rows fit
    the batched parts (sized by `expected`, the rows of a balanced routing) or spill
    past them into the loop."""
    from plait.parallel.grouped import grouped_mlp

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((100, 16)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((4, 16, 24)), jnp.float32)
    s = jnp.asarray(sizes, jnp.int32)

    def f(x, w, how):  # activation None: the one product
        y = (grouped_mlp(x, {"w": w}, s, None, expected, bulk, spill) if how == "tiles"
             else jax.lax.ragged_dot(x, w, s))
        return jnp.sum(jnp.sin(y)), y

    (_, got), got_g = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(x, w, "tiles")
    (_, want), want_g = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(x, w, "ragged_dot")
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    assert not np.asarray(got[sum(sizes):]).any()
    for a, b in zip(got_g, want_g, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-5)
    if (bulk, spill) == (0.0, 2.0):  # the spill's tiles, several a group: no scatter-add
        jaxpr = jax.make_jaxpr(jax.grad(lambda x, w: f(x, w, "tiles")[0], (0, 1)))(x, w)
        assert _scatter_add_slices(jaxpr.jaxpr) <= {1}  # the loop's one tile at a time


def _scatter_add_slices(jaxpr) -> set[int]:
    """How many slices each scatter-add of a jaxpr (its sub-jaxprs included) adds."""
    out = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scatter-add":
            out.add(eqn.invars[2].aval.shape[0])
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            out |= _scatter_add_slices(sub)
    return out


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@SPLITS
def test_grouped_mlp_equals_its_products_through_ragged_dot(bulk, spill, activation):
    """Dropless's whole expert MLP on the tiles (hidden activations kept in the batched
    layout, each loop tile's forward recomputed in the backward): the values and the
    gradients of the rows and every weight of the same MLP written with ragged_dot,
    with groups over their share, under it, empty, and rows past the groups."""
    from helpers import ragged_dot_mlp

    from plait.parallel.grouped import grouped_mlp

    rng = np.random.default_rng(1)
    G, K, F = 4, 16, 12
    x = jnp.asarray(rng.standard_normal((100, K)), jnp.float32)
    w = {"w2": jnp.asarray(rng.standard_normal((G, F, K)) / 4, jnp.float32)}
    if activation == "swiglu":
        w["w13"] = jnp.asarray(rng.standard_normal((G, K, 2, F)) / 4, jnp.float32)
    else:
        w["w1"] = jnp.asarray(rng.standard_normal((G, K, F)) / 4, jnp.float32)
    s = jnp.asarray([5, 0, 61, 24], jnp.int32)

    def f(fn):
        def loss(x, w):
            y = fn(x, w)
            return jnp.sum(jnp.sin(y)), y
        return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, w)

    (_, got), got_g = f(lambda x, w: grouped_mlp(x, w, s, activation, 40, bulk, spill))
    (_, want), want_g = f(lambda x, w: ragged_dot_mlp(x, w, s, activation))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    assert not np.asarray(got[90:]).any()
    for a, b in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("moe,says", [
    ({"capacity_factor": 0.0}, "dropless, 1 x a balanced expert's rows batched, the tiles "
     "past them batched as a layer needs them (up to 1.25 x all rows) with their experts' "
     "weights gathered, the rest through the loop over tiles (auto: not a Hopper GPU)"),
    ({"capacity_factor": 0.0, "spill": 0, "grouped": "tiles"}, "dropless, 1 x a balanced "
     "expert's rows batched, the rest through the loop over tiles"),
    ({"capacity_factor": 0.0, "bulk": 0, "spill": 1.5, "grouped": "tiles"}, "dropless, tiles "
     "batched as a layer needs them (up to 1.5 x all rows) with their experts' weights "
     "gathered, the rest through the loop over tiles"),
    ({"capacity_factor": 0.0, "bulk": 0, "spill": 0, "grouped": "pallas"},
     "dropless, every row through the loop over tiles (pallas traced as the tiles here)"),
    ({"capacity_factor": 0.0, "grouped": "ragged_dot"}, "dropless through jax.lax.ragged_dot"),
    ({"capacity_factor": 1.25}, "capacity factor 1.25"),
])
def test_the_run_says_how_its_experts_are_dispatched(moe, says):
    """The start-up line names the dispatch a run's figures come from."""
    from helpers import make_mesh

    from plait.tasks import make_task
    from plait.tasks.gpt_runtime import start_up_lines

    lines = start_up_lines(make_task(experiment(moe), make_mesh("data=1")))
    (line,) = [x for x in lines if "mixture of experts" in x]
    assert f"2 per token, {says};" in line, line


def test_dropless_tiles_compile_to_the_routed_flops():
    """The compiled step's matmul FLOPs: tiles are the active weights' (flops_per_token)
    plus at most the tiles' padding; XLA:CPU's ragged_dot multiplies every expert."""
    from plait.inspect import inspect_step
    from plait.models.gpt_counts import flops_per_token

    flops = {}
    for how, spill in (("tiles", 1.25), ("tiles", 0.0), ("ragged_dot", 1.25)):
        exp = experiment({"capacity_factor": 0.0, "grouped": how, "spill": spill,
                          **UNSHARED}, model={"layers": 1})
        flops[how, spill] = inspect_step(exp, make_mesh("data=1"))["flops_per_device"]
    model = flops_per_token(exp.model) * exp.train.global_batch * exp.model.seq_len
    # the spill's sizes are a switch priced at its first, 0 tiles (hlo.SIZED_BY_DATA:
    # counting every size, 2.7x the model's); without spill the loop counts one tile
    assert model <= flops["tiles", 1.25] <= flops["tiles", 0.0] <= 1.25 * model
    assert flops["ragged_dot", 1.25] > 1.8 * model


def test_the_spill_takes_the_fewest_tiles_that_hold_the_overflow():
    """The spill's sizes are 0, powers of two and its largest; a call takes the smallest
    that holds the tiles its routing overflows (fewer than twice as many), or the
    largest, past which the loop runs."""
    from plait.parallel.grouped import spill_size_index, spill_sizes

    assert spill_sizes(0) == (0,) and spill_sizes(1) == (0, 1)
    assert spill_sizes(8) == (0, 1, 2, 4, 8)
    sizes = spill_sizes(72)
    assert sizes == (0, 1, 2, 4, 8, 16, 32, 64, 72)
    for occupied, want in [(0, 0), (1, 1), (3, 4), (5, 8), (8, 8), (9, 16), (65, 72),
                           (72, 72), (90, 72)]:
        assert sizes[int(spill_size_index(jnp.int32(occupied), sizes))] == want, occupied


@pytest.mark.parametrize("spec", ["expert=4", "data=2,expert=2,tensor=2"])
def test_dropless_over_an_expert_axis_compiles_to_each_ranks_share(spec):
    """Over an expert axis of X each rank's buffer holds every choice of its X-rank group
    (the all-gather dispatch), but its loop over tiles runs only those routed to its own
    experts: the compiled matmul FLOPs per device are the model's share (a balanced
    routing's), not X times the experts' (the whole step's were 2.78x and 1.67x the
    model's share before, 1.12x and 1.06x now: docs/architecture.md). With tensor
    beside, each rank runs its slice of the experts' hidden units and the partial
    outputs are summed after the grouped MLPs: no collective inside their switch, which
    XLA:CPU ordered differently on different devices against the attention's
    all-reduces (plait train refused the step as one that would hang)."""
    from plait import analysis, hlo, hosts
    from plait.models.gpt_counts import flops_per_token
    from plait.tasks import make_task
    from plait.train.loop import _would_hang

    exp = experiment({"capacity_factor": 0.0, **UNSHARED}, model={"layers": 1})
    mesh = make_mesh(spec)
    task = make_task(exp, mesh)
    compiled = task.compile()
    got = analysis.analyze(compiled, dict(mesh.shape), task.branch_weights(),
                           hosts.host_layout(mesh).ravel())["flops_per_device"]
    model = flops_per_token(exp.model) * exp.train.global_batch * exp.model.seq_len
    assert model / mesh.size <= got <= 1.25 * model / mesh.size
    mod = hlo.parse_hlo(compiled.as_text())
    assert "conditional" in {i.opcode for c in mod.computations.values() for i in c}
    for kind in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all"):
        assert not hlo.ops_in_branches(mod, kind), kind
    assert _would_hang(task, compiled) is None


def test_all_to_all_bytes_equal_the_formula():
    """The compiled step's all-to-alls over `expert`: rows x seq x experts' places x
    d_model x bytes x (X - 1) / X per all-to-all, two forward and two backward per
    sparse layer. Dropless: the all-gathers and reduce-scatters of the tokens and
    their routing (formulas.expert_bytes), rematerialised too."""
    from plait.inspect import inspect_step
    from plait.parallel import formulas

    dropless = {"capacity_factor": 0.0}
    for spec, moe, model, compute in (
            ("expert=4", {}, {}, "float32"), ("data=2,expert=2", {}, {}, "float32"),
            ("data=2,expert=2", dropless, {}, "float32"),
            ("data=2,expert=2", dropless, {"remat": "full"}, "float32"),
            ("data=2,expert=2", dropless, {}, "bfloat16")):  # sums by all-to-all
        exp = experiment(moe, model={"layers": 1, **model},  # bytes are per sparse layer
                         precision={"compute": compute})
        sizes = dict(make_mesh(spec).shape)
        report = inspect_step(exp, make_mesh(spec))
        got = report["experts"]
        want = formulas.expert_bytes(exp, sizes, "cpu")
        assert got["wire_bytes"] == pytest.approx(want, rel=1e-6), (spec, moe, model)
        assert got["formula_bytes"] == pytest.approx(want, rel=1e-6)
        assert got["dispatch"] == ("all-gather" if moe else "all-to-all")


@pytest.mark.parametrize("spec,moe,message", [
    ("expert=2", None, "has none"),
    ("expert=2,tensor_row=2,tensor_col=2", {}, "1-D tensor"),
    ("expert=8", {}, "model.moe.experts = 4 is not divisible"),
])
def test_mesh_mistakes_are_one_line(spec, moe, message):
    from plait.errors import UserError
    from plait.tasks.gpt import GPTTask

    exp = tiny(model=MODEL) if moe is None else experiment(moe)
    with pytest.raises(UserError, match=message):
        GPTTask(exp, make_mesh(spec))


def test_across_hosts_the_gradients_reduce_flat_unless_hierarchical_is_asked_for():
    """sync.reduce = "auto" is hierarchical only where that runs (not for a mixture of
    experts): a data axis across and within hosts then reduces flat, as a 64-device
    sweep's data=16 shapes need; "hierarchical" said outright is still refused."""
    from plait.errors import UserError
    from plait.tasks.gpt import GPTTask

    assert GPTTask(experiment(), make_mesh("data=2@dcn,data=2,expert=2")).data_split is None
    exp = experiment()
    exp = exp.model_copy(update={"sync": exp.sync.model_copy(update={"reduce": "hierarchical"})})
    with pytest.raises(UserError, match="one flat gradient all-reduce"):
        GPTTask(exp, make_mesh("data=2@dcn,data=2,expert=2"))


def test_the_tensor_formulas_say_they_do_not_model_experts(capsys):
    """The tensor modes' formulas count a dense decoder's traffic: for a mixture they gave
    2-4.5x less than its compiled step moved (moe-tiny's --compare-tensor-modes), shown as
    a ratio as if a mode misbehaved. The report gives no formula and says why; the
    comparison's table shows none and prints the reason once (no compile here: the
    analysis is a stand-in)."""
    from plait.tasks import make_task
    from plait.views.inspect import render_comparison

    rows = []
    for spec in ("tensor=2", "tensor_row=2,tensor_col=2"):
        r = make_task(experiment(), make_mesh(spec)).report({"wire_by_axes": {"tensor": 8.0}})
        assert r["tensor_formula_bytes"] is None, r
        assert r["tensor_formula_unmodelled"] == "mixture-of-experts layers", r
        rows.append({"mode": r["tensor_mode"], "mesh": spec, "wire_bytes": 8.0,
                     "temp_bytes": 0, "compile_s": 1.0, **r})
    dense = make_task(tiny(), make_mesh("tensor=2")).report({"wire_by_axes": {}})
    assert dense["tensor_formula_bytes"] > 0 and dense["tensor_formula_unmodelled"] is None
    render_comparison("moe", rows)
    out = capsys.readouterr().out
    assert out.count("no formula: the tensor modes' formulas do not model mixture-of-experts "
                     "layers") == 1, out
    assert "nan" not in out and "inf" not in out, out


def test_parameter_and_flop_formulas():
    """param_count equals the built model for the Llama and GPT-2 layouts, sparse in every
    layer or every other one, with and without a shared expert (gated or not); the FLOPs count a
    token's top_k experts, not all of them."""
    from plait.models import gpt_counts
    from plait.tasks.gpt import GPTTask

    mesh = make_mesh("data=1")
    for model, moe in (({}, {}), ({"kind": "gpt", "layers": 3}, {"every": 2, "d_ff": 48}),
                       ({"kind": "gpt"}, UNSHARED), ({}, {"shared_gate": False})):
        exp = experiment(moe, model=model)
        assert gpt_counts.param_count(exp.model) == GPTTask(exp, mesh).num_params(), (model, moe)
    exp = experiment(UNSHARED)
    m, d = exp.model, exp.model.d_model
    dense = exp.model.model_copy(update={"moe": None})
    per_layer_extra = (2 - 1) * 3 * d * 64 + d * 4  # a second expert and the router
    assert gpt_counts.flops_per_token(m) == \
        gpt_counts.flops_per_token(dense) + 6 * m.layers * per_layer_extra


def test_the_sweep_enumerates_the_expert_axis_for_a_mixture_of_experts():
    from plait.tasks.gpt import GPTTask

    assert "expert" in GPTTask.sweep_axes_for(experiment())
    assert "expert" in GPTTask.sweep_axes_for(experiment({"capacity_factor": 0.0}))
    assert "expert" not in GPTTask.sweep_axes_for(tiny(model=MODEL))
    assert GPTTask.sweep_variants(experiment(), {"expert": 4, "data": 2}) == [{}]


def test_a_pipelines_expert_and_context_traffic_has_no_formula():
    """plait inspect of a mixture on expert x pipeline ended in ZeroDivisionError: the
    formula divided by pipeline.microbatches, 0 for the schedule's choice. A stage holds
    some of the layers and runs the schedule's microbatches, which expert_bytes and
    context_bytes do not model: no formula, as for the tensor modes (no compile here:
    the report of an empty program)."""
    from plait.tasks import make_task

    for spec in ("data=2,expert=2,pipeline=2", "context=2,expert=2,pipeline=2"):
        task = make_task(experiment(model=TWO_LAYERS), make_mesh(spec))
        report = task.report({"collective_ops": [], "wire_by_axes": {}})
        assert report["experts"]["formula_bytes"] is None, spec
        if "context" in spec:
            assert report["context"]["formula_bytes"] is None
