"""Compile-only figures: the Megatron all-reduce count, FLOPs, and the JSON contract."""

import json
import math
import re

import jax
import pytest
from helpers import make_mesh, plait_cmd, tiny, write_experiment

from plait import analysis, hlo
from plait.inspect import inspect_step
from plait.models import build, gpt, gpt_counts


def _bsd_bytes(exp):
    t, m = exp.train, exp.model
    return t.global_batch // t.microbatches * m.seq_len * m.d_model * 4


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.parametrize("layers", [2, 3])
def test_tensor8_all_reduces_match_megatron(layers, scan):
    """One all-reduce of the [B,S,D] activations per attention and per MLP block, each way.

    Plus the vocabulary-parallel embedding (forward) and output head (backward):
    4 x layers + 2 of them; everything else is a few [B,S] softmax statistics.
    With scanned layers the block's all-reduces sit in a loop body and count once
    per layer.
    """
    exp = tiny(model={"layers": layers, "scan_layers": scan})
    r = inspect_step(exp, make_mesh("tensor=8"))
    b, s, d = exp.train.global_batch, exp.model.seq_len, exp.model.d_model
    act = [op for op in r["collective_ops"]
           if op["kind"] == "all-reduce" and re.fullmatch(rf"f32\[{b},{s},{d}\]\S*", op["shape"])]
    assert all(op["axes"] == ["tensor"] for op in act)
    assert sum(op["count"] for op in act) == 4 * layers + 2
    act_bytes = (4 * layers + 2) * _bsd_bytes(exp)
    assert sum(op["bytes"] for op in act) == act_bytes
    rest = r["collectives"]["all-reduce"] - act_bytes
    assert 0 <= rest <= 4 * b * s * 4 + 1024
    assert r["collectives"]["all-gather"] == r["collectives"]["reduce-scatter"] == 0


def test_hlo_flops_equal_model_flops_with_accumulation_loop():
    """Matmuls inside the gradient-accumulation loop are counted once per microbatch."""
    exp = tiny(train={"microbatches": 4})
    r = inspect_step(exp, make_mesh("tensor=8"))
    tokens = exp.train.global_batch * exp.model.seq_len
    expected = gpt_counts.flops_per_token(exp.model) * tokens / 8
    assert r["flops_per_device"] == pytest.approx(expected, rel=1e-9)
    per_micro = [op for op in r["collective_ops"] if op["kind"] == "all-reduce"
                 and op["shape"].startswith(f"f32[4,{exp.model.seq_len},{exp.model.d_model}]")]
    assert per_micro and per_micro[0]["count"] == 4 * (4 * exp.model.layers + 2)


def test_data_parallel_reduces_every_gradient_once():
    exp = tiny()
    r = inspect_step(exp, make_mesh("data=8"))
    param_bytes = 4 * build(gpt.GPT, exp.model).num_params()
    embed_bytes = 4 * exp.model.padded_vocab * exp.model.d_model
    assert {a for op in r["collective_ops"] for a in op["axes"]} == {"data"}
    # every gradient once, the tied embedding's two parts apart, and the loss (4 bytes)
    assert param_bytes <= r["collectives"]["all-reduce"] <= param_bytes + embed_bytes + 4
    assert r["collectives"]["all-gather"] == 0


def test_fsdp_gathers_sharded_weights():
    exp = tiny()
    r = inspect_step(exp, make_mesh("fsdp=8"))
    model = build(gpt.GPT, exp.model)
    sharded = sum(4 * math.prod(v.get_value().shape)
                  for v in jax.tree.leaves(model.variables(),
                                           is_leaf=lambda x: hasattr(x, "get_metadata"))
                  if "embed" in v.get_metadata()["logical_axes"])
    assert r["collectives"]["all-gather"] >= sharded
    assert {a for op in r["collective_ops"] for a in op["axes"]} == {"fsdp"}
    # Memory: each device holds an eighth of the sharded parameters and their moments.
    assert r["memory"]["argument_bytes"] < 3 * 4 * model.num_params() / 4


def test_hlo_parser_counts_loops_and_groups():
    text = """HloModule m
%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %ar = f32[8]{0} all-reduce(%x), replica_groups=[2,4]<=[8], to_apply=%add
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %ar)
}
ENTRY %main (a: f32[8]) -> f32[32] {
  %a = f32[8]{0} parameter(0)
  %w = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body, \
backend_config={"known_trip_count":{"n":"5"}}
  ROOT %ag = f32[32]{0} all-gather(%a), replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}
}
"""
    mod = hlo.parse_hlo(text)
    colls = analysis.collectives(mod, {"data": 2, "tensor": 4})
    ar = next(c for c in colls if c.kind == "all-reduce")
    ag = next(c for c in colls if c.kind == "all-gather")
    assert (ar.count, ar.bytes, ar.group_size, ar.axes) == (5, 32, 4, ["tensor"])
    assert (ag.count, ag.bytes, ag.group_size) == (1, 128, 4)
    assert ar.wire_bytes == pytest.approx(2 * 3 / 4 * 32)


def test_inspect_cli_json(tmp_path):
    path = write_experiment(tmp_path / "tiny.toml", tiny())
    proc = plait_cmd("inspect", str(path), "--mesh", "data=2,fsdp=2,tensor=2", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["flops_per_device"] > 0
    assert set(report["collectives"]) == set(analysis.COLLECTIVE_KINDS)
    assert {"argument_bytes", "output_bytes", "temp_bytes"} <= set(report["memory"])
    assert report["mesh"] == "data=2,fsdp=2,tensor=2"


def test_inspect_says_what_it_compiled_for_settings_this_device_cannot_run():
    """plait inspect on a CPU compiled model.attention = "cudnn" as XLA's attention and
    FP8 as its quantize-dequantize ops without a word (plait train refuses both there);
    its notes now say so, as plait train's start-up lines do (no compile here)."""
    from plait.inspect import _notes
    from plait.tasks import make_task

    exp = tiny(model={"attention": "cudnn"}, precision={"matmul": "fp8"})
    mesh = make_mesh("data=2")
    notes = _notes(make_task(exp, mesh), exp, mesh)
    assert notes[0].startswith('attention xla (model.attention = "cudnn", no cuDNN on cpu)')
    assert 'precision.matmul = "fp8" compiled for cpu, which has no FP8 matrix units' in \
        notes[-1]
