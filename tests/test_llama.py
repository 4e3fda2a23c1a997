"""The Llama layout of the decoder over the meshes: losses equal the one-device run on
data x fsdp x tensor (stacked, remat), with key/value heads split over tensor where they
divide and replicated where they do not, on a 2-D grid and through a ZB-H1 pipeline
(most of them with the loss formed in pieces);
FLOP and parameter formulas for GQA and SwiGLU against the built model and the
compiled step."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import losses, make_mesh, run, tiny

# 8 query heads over 2 key/value heads, Qwen2's q/k/v biases, OLMoE's q/k norms over
# the whole projections (an all-reduce where heads are split), Llama 3.1's rotary scaling.
LLAMA = {"kind": "llama", "layers": 2, "heads": 8, "kv_heads": 2, "d_ff": 96, "qkv_bias": True,
         "qk_norm": True,
         "rope_theta": 10000.0,
         "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_context": 16}}


def llama(**sections):
    model = {**LLAMA, **sections.pop("model", {})}
    return tiny(model=model, **sections)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return losses(run(llama(), "data=1", tmp_path_factory.mktemp("llama-ref")))


def test_reference_learns(reference):
    assert len(reference) == 12 and reference[-1] < reference[0] - 0.2


# Four of them also form the loss in pieces of the tokens (model.loss_chunks,
# tests/test_loss.py): against the reference's loss over all logits at once.
@pytest.mark.parametrize("spec,model,extra", [
    ("data=2,fsdp=2,tensor=2", {"scan_layers": True, "remat": "full", "loss_chunks": 2}, {}),
    ("tensor=4", {}, {}),  # 2 kv heads on 4 ranks: replicated
    ("tensor=2", {"loss_chunks": 4}, {}),  # 2 kv heads on 2 ranks: one each
    ("data=2,tensor_row=2,tensor_col=2", {"loss_chunks": 2}, {}),
    ("data=2,pipeline=2", {"loss_chunks": 2},
     {"pipeline": {"schedule": "zb-h1", "microbatches": 4}}),
    ("data=2@dcn,data=2,tensor=2", {}, {}),  # reduced within each host first
], ids=["dp-fsdp-tp-stacked-remat", "tp4-kv-replicated", "tp2-kv-split", "2d", "zb-h1",
        "dcn-hierarchical"])
def test_losses_equal_one_device(reference, tmp_path, spec, model, extra):
    got = losses(run(llama(model=model, **extra), spec, tmp_path))
    np.testing.assert_allclose(got, reference, rtol=1e-4)


# 4 query heads of 16 over 2 kv heads: the shapes at which GSPMD, left to itself, split
# ZB-H1's k/v pair over tensor (8 heads of 8 did not show it).
GROUPS_OF_2 = {"heads": 4}


# ZB-H1 on pipeline=2,tensor=2: test_zb_h1_trains_a_gqa_decoder_split_over_tensor trains
# that step, and plait train refuses one with a permute in a tick (train.loop._would_hang).
@pytest.mark.parametrize("spec,schedule", [
    ("pipeline=2,tensor=4", "zb-h1"), ("pipeline=2,tensor=4", "chimera")])
def test_no_collective_permute_in_a_tick(spec, schedule):
    """The pipeline's ranks run different branches of the per-tick switch at once, and
    XLA:CPU's collective-permute waits for every device: one inside a branch hangs the
    step (docs/architecture.md). ZB-H1's input-gradient branch of a GQA decoder had two:
    GSPMD split the k/v pair over tensor, and the transposes of k = kv[0], v = kv[1]
    became halo exchanges (the run aborted after 40 s, 'Expected 4 threads to join the
    rendezvous'); the pair is pinned whole now (models/gpt.py, KV_PAIR)."""
    from plait import hlo
    from plait.tasks.gpt import GPTTask

    pipeline = {"schedule": schedule, "microbatches": 4}
    task = GPTTask(llama(model=GROUPS_OF_2, pipeline=pipeline),
                   make_mesh(spec))
    mod = hlo.parse_hlo(task.compile().as_text())
    assert any(i.opcode == "conditional" for c in mod.computations.values() for i in c)
    assert not hlo.ops_in_branches(mod, "collective-permute")


def test_a_key_value_head_too_few_for_the_grid_trains_like_one_device():
    """One key/value head, replicated over the head axis of 2-D (tensor_col: its
    projection's product was typed as varying over the columns and shard_map refused
    the step, a traceback) and of 3-D (tensor_y: its tokens had been laid over y as
    well, and attention gathered its scores); through a pipeline too."""
    from helpers import step_in_process

    want, _ = step_in_process(llama(model={"kv_heads": 1}), "data=1", 3)
    for spec, pipeline in (("data=2,tensor_row=2,tensor_col=2", {}),
                           ("tensor_x=2,tensor_y=2,tensor_z=2", {}),
                           ("pipeline=2,tensor_row=2,tensor_col=2",
                            {"pipeline": {"schedule": "1f1b", "microbatches": 2}})):
        got, _ = step_in_process(llama(model={"kv_heads": 1}, **pipeline), spec, 3)
        np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=spec)


def test_zb_h1_trains_a_gqa_decoder_split_over_tensor(tmp_path):
    """What hung: ZB-H1 on pipeline=2,tensor=2 with the kv heads split; its losses equal
    one device's (and its step, compiled, has no permute in a tick, or plait train would
    refuse it: test_a_step_that_would_hang_ends_in_one_line_before_it_runs)."""
    short = {"train": {"steps": 4}}
    want = losses(run(llama(model=GROUPS_OF_2, **short), "data=1", tmp_path / "one"))
    got = losses(run(llama(model=GROUPS_OF_2, pipeline={"schedule": "zb-h1",
                                                        "microbatches": 4}, **short),
                     "pipeline=2,tensor=2", tmp_path / "zb"))
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_a_step_that_would_hang_ends_in_one_line_before_it_runs(tmp_path, monkeypatch):
    """Without the k/v pair pinned, and with the split backward handing W what it did
    then (the model and ZB-H1 as they were), ZB-H1's step has permutes in its switch:
    plait train says so after compiling instead of waiting 40 s for XLA to abort the
    process. (With the split backward as it is now, which recomputes in W from values
    it is handed anyway, the unpinned step has no permute in its switch.)"""
    from plait.errors import RunFailed
    from plait.models import gpt
    from plait.parallel import split_backward

    pin = gpt.constrain
    monkeypatch.setattr(gpt, "constrain",
                        lambda x, names: x if names is gpt.KV_PAIR else pin(x, names))
    monkeypatch.setattr(split_backward, "_handed", lambda *_: set())
    with pytest.raises(RunFailed, match=r"^the compiled step would hang on XLA:CPU: 2 "
                       r"collective-permute\(s\) inside the pipeline's per-tick switch "
                       r"\(the first from .*pad\).*plait bug"):
        run(llama(model=GROUPS_OF_2, pipeline={"schedule": "zb-h1", "microbatches": 4}),
            "pipeline=2,tensor=2", tmp_path)


def test_easgd_replicas_train_a_llama(tmp_path):
    """Sync EASGD over data with the kv heads split over tensor inside each replica."""
    got = losses(run(llama(sync={"method": "easgd", "period": 2}), "data=2,tensor=2",
                     tmp_path))
    assert np.all(np.isfinite(got)) and got[-1] < got[0] - 0.2


def test_kv_heads_split_where_they_divide_replicated_where_not():
    from jax.sharding import PartitionSpec as P

    from plait.tasks.gpt import GPTTask

    for spec, kv_spec in (("tensor=2", P(None, None, "tensor", None)),
                          ("tensor=4", P(None, None, None, None))):
        task = GPTTask(llama(), make_mesh(spec))
        attn = task.layout.params["blocks"]["0"]["attn"]
        assert attn["wq"].spec == P(None, "tensor", None)
        assert attn["wkv"].spec == kv_spec, spec


def test_formulas_count_gqa_and_swiglu():
    """param_count equals the built model's parameters; the compiled step's matmul FLOPs
    equal flops_per_token (no remat)."""
    from plait.inspect import inspect_step
    from plait.models import gpt_counts
    from plait.tasks.gpt import GPTTask

    for model in ({}, {"tie_embeddings": True, "qkv_bias": False, "kv_heads": 1},
                  {"kv_heads": 8}):  # fused q/k/v when every head has its own
        exp = llama(model=model)
        mesh = make_mesh("data=1")
        assert gpt_counts.param_count(exp.model) == GPTTask(exp, mesh).num_params(), model
        got = inspect_step(exp, mesh)["flops_per_device"]
        want = gpt_counts.flops_per_token(exp.model) * exp.train.global_batch * exp.model.seq_len
        assert got == pytest.approx(want, rel=1e-9), model


@pytest.mark.parametrize("spec,kv,remat", [
    ("tensor=2", 2, "none"), ("tensor=4", 2, "none"), ("tensor=4", 1, "none"),
    ("tensor_row=2,tensor_col=2", 2, "full"),
    ("tensor_depth=2,tensor_row=2,tensor_col=2", 1, "none"),
    ("tensor_x=2,tensor_y=2,tensor_z=2", 1, "full")],
    ids=["1d-split", "1d-replicated", "1d-mqa", "2d-remat", "2.5d-mqa", "3d-mqa-remat"])
def test_tensor_bytes_equal_the_formula_with_gqa(spec, kv, remat):
    """Compiled tensor-axis wire bytes against parallel.formulas: key/value heads split
    (the q and k/v projections' input gradients reduced apart; on a grid the k/v
    projection shares the queries' gathers of its input, remat's too) and replicated
    (their heads gathered forward, their gradients summed over the ranks sharing one;
    on a grid the one head's product laid out with the queries' tokens: 3-D had moved
    1.7x the formula, gathering attention's scores)."""
    from plait.inspect import inspect_step

    # The q/k norms' statistics add small all-reduces the papers' formulas do not count.
    exp = llama(model={"kv_heads": kv, "qkv_bias": False, "qk_norm": False, "remat": remat})
    r = inspect_step(exp, make_mesh(spec))
    assert r["tensor_wire_bytes"] == pytest.approx(r["tensor_formula_bytes"], rel=0.015)
