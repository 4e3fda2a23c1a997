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
LLAMA = {"kind": "llama", "heads": 8, "kv_heads": 2, "d_ff": 96, "qkv_bias": True,
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


@pytest.mark.parametrize("spec,kv", [("tensor=2", 2), ("tensor=4", 2), ("tensor=4", 1),
                                     ("tensor_row=2,tensor_col=2", 2)],
                         ids=["1d-split", "1d-replicated", "1d-mqa", "2d"])
def test_tensor_bytes_equal_the_formula_with_gqa(spec, kv):
    """Compiled tensor-axis wire bytes against parallel.formulas: key/value heads split
    (the q and k/v projections' input gradients reduced apart) and replicated (their
    heads gathered forward, their gradients summed over the ranks sharing one)."""
    from plait.inspect import inspect_step

    # The q/k norms' statistics add small all-reduces the papers' formulas do not count.
    exp = llama(model={"kv_heads": kv, "qkv_bias": False, "qk_norm": False})
    r = inspect_step(exp, make_mesh(spec))
    assert r["tensor_wire_bytes"] == pytest.approx(r["tensor_formula_bytes"], rel=0.015)
