"""Stacked layers (`model.scan_layers`): programs that do not grow with depth, the same
losses as the per-layer layout, and checkpoints that move between the two."""

import collections
import re
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import AS_TRAINED, losses, make_mesh, run, tiny

from plait.models import build, gpt, unstack
from plait.tasks.gpt import GPTTask

FIXTURE = Path(__file__).parent / "data" / "run-before-stacked"
# seq_len 16 so no stacked [layers, 64] shape coincides with pos_embed's [seq_len, 64]
# (JAX shares one broadcast constant between equal shapes, which changes the count).
SHAPE = {"seq_len": 16}


def _instructions(hlo: str) -> int:
    return sum(1 for line in hlo.splitlines() if re.match(r"\s*(ROOT )?%?[\w.\-]+ = ", line))


def _ops(hlo: str) -> collections.Counter:
    return collections.Counter(m.group(1) for m in re.finditer(r"= \S+ ([\w-]+)\(", hlo))


def _run_as_trained(fn):
    """`fn()` compiled as outside the tests: the legacy emitters the tests use for
    compile speed (helpers.TEST_XLA_FLAGS) round the truncated normal's transcendentals
    by loop shape, 1 ulp apart between two programs."""
    return jax.jit(fn).lower().compile(AS_TRAINED)()


def _step(layers: int, spec: str = "data=1", scan: bool = True):
    task = GPTTask(tiny(model={"layers": layers, "scan_layers": scan, **SHAPE}), make_mesh(spec))
    return task, task.step_fn.lower(task.layout.abstract(), task.abstract_batch())


@pytest.mark.parametrize("scan", [True, False])
def test_init_program_does_not_grow_with_depth(scan):
    """Stacked: the whole init program. Per-layer: its random numbers (each layer kind's
    init is vmapped over its layers; only the slices handing out layers grow), each
    parameter's behind an optimization barrier, so that no slice fuses the random
    program in: XLA:GPU did, one multi-output kernel per parameter holding every
    layer's slice, and compiled gpt2-1.3b's unrolled init in 4 minutes on an H100."""
    sizes, xors = {}, {}
    for layers in (4, 32):
        model = build(gpt.GPT, tiny(model={"layers": layers, "scan_layers": scan, **SHAPE}).model)
        lowered = jax.jit(lambda m=model: m.init(0)).lower()
        hlo = lowered.as_text(dialect="hlo")
        xors[layers] = _ops(hlo)["xor"]
        if scan:
            sizes[layers] = (_instructions(hlo), _instructions(lowered.compile().as_text()))
        else:
            per_layer = len(jax.tree.leaves(model.init(0)["blocks"]["0"]))
            assert _ops(hlo)["opt-barrier"] == per_layer, (_ops(hlo)["opt-barrier"], per_layer)
    assert xors[4] == xors[32] > 0, xors
    if scan:
        assert sizes[4][0] == sizes[32][0], sizes
        # XLA's CPU backend fuses a few random-number ops differently by size.
        assert abs(sizes[4][1] - sizes[32][1]) <= 0.01 * sizes[4][1], sizes


def test_per_layer_init_equals_layers_built_one_after_another():
    """layer_list's vmapped init draws each layer's keys as sequential construction does:
    sparse layers 0 and 2 share a vmapped init, dense layer 1 is built alone."""
    from plait.models import layer_list, module_values
    from plait.models.keys import ParamKeys

    cfg = tiny(model={"layers": 3, "moe": {"experts": 2, "top_k": 1, "every": 2,
                                           "capacity_factor": 2.0}}).model
    kinds = [cfg.is_sparse(i) for i in range(cfg.layers)]
    assert kinds == [True, False, True]

    def values(vmapped: bool):
        keys = ParamKeys(7, 5)  # a start past 0, as after the embeddings
        if vmapped:
            blocks = layer_list(lambda k, sparse: gpt.Block(cfg, k, sparse), keys, kinds)
        else:
            blocks = [gpt.Block(cfg, keys, sparse) for sparse in kinds]
        return [module_values(b) for b in blocks], keys.count

    (got, got_count), (want, want_count) = (_run_as_trained(lambda: values(True)),
                                            _run_as_trained(lambda: values(False)))
    assert got_count == want_count
    jax.tree.map(np.testing.assert_array_equal, got, want)


@pytest.mark.parametrize("spec", ["data=1", "data=2,fsdp=2,tensor=2"])
def test_step_program_does_not_grow_with_depth(spec):
    sizes = {}
    for layers in (4, 32):
        _, lowered = _step(layers, spec)
        sizes[layers] = (_instructions(lowered.as_text(dialect="hlo")),
                         _instructions(lowered.compile().as_text()))
    assert sizes[4][0] == sizes[32][0], sizes
    assert abs(sizes[4][1] - sizes[32][1]) <= 0.01 * sizes[4][1], sizes
    if spec == "data=1":  # the per-layer layout's program grows with depth
        _, unrolled = _step(32, spec, scan=False)
        assert _instructions(unrolled.as_text(dialect="hlo")) > 5 * sizes[32][0]


def test_step_neither_stacks_nor_copies_the_parameters():
    """No concatenate builds a stacked parameter, and no copy takes one: the only
    full-stack copies are the zero-initialised gradient buffers of the scan. (The
    gradient norm stacks like gradients of several parameters, train.step.stacked_norm:
    [k, layers, ...], not a parameter's shape.)"""
    task, lowered = _step(32)
    hlo = lowered.compile(AS_TRAINED).as_text()
    stacked = {tuple(s.shape) for s in jax.tree.leaves(task.layout.shapes["params"]["blocks"])}
    assert all(s[0] == 32 for s in stacked)
    built = [tuple(int(d) for d in m.group(1).split(","))
             for m in re.finditer(r"= \w+\[([\d,]+)\]\S* concatenate\(", hlo)]
    assert not [s for s in built if s in stacked], built
    for line in hlo.splitlines():
        m = re.search(r"= f32\[([\d,]+)\]\S* copy\((%[\w.\-]+)\)", line)
        if m and tuple(int(d) for d in m.group(1).split(",")) in stacked:
            source = next(x for x in hlo.splitlines() if x.strip().startswith(m.group(2) + " "))
            assert "broadcast" in source, line.strip()


def test_stacked_init_equals_the_per_layer_init():
    exp = tiny(model={"layers": 4})
    per_layer_model = build(gpt.GPT, exp.model)
    per_layer = _run_as_trained(lambda: per_layer_model.init(0))
    stacked_model = build(gpt.GPT, exp.model.model_copy(update={"scan_layers": True}))
    stacked = _run_as_trained(lambda: stacked_model.init(0))
    assert stacked["blocks"]["attn"]["wqkv"].shape[0] == 4
    jax.tree.map(np.testing.assert_array_equal, unstack(stacked, "blocks"), per_layer)


# data=2,fsdp=2,tensor=2: test_checkpoints_move_between_stacked_and_per_layer's first
# four steps.
@pytest.mark.parametrize("spec,extra", [
    ("data=1", {}),
    ("data=2,pipeline=2", {"schedule": "1f1b", "microbatches": 4}),
    ("pipeline=2", {"schedule": "interleaved", "virtual_stages": 2}),
])
def test_stacked_losses_equal_the_per_layer_run(spec, extra, four_layer_reference, tmp_path):
    got = losses(run(tiny(model={"layers": 4, "scan_layers": True}, pipeline=extra), spec,
                     tmp_path))
    np.testing.assert_allclose(got, four_layer_reference, rtol=1e-5)


def test_checkpoints_move_between_stacked_and_per_layer(four_layer_reference, tmp_path):
    """Stacked on data=2,fsdp=2,tensor=2 (equal to the per-layer run from its first
    step), per-layer on fsdp=2, stacked on a pipeline: one curve."""
    ckpt = {"enabled": True, "every_steps": 4, "keep": 3, "async_save": False}
    run(tiny(model={"layers": 4, "scan_layers": True}, checkpoint=ckpt, train={"steps": 4}),
        "data=2,fsdp=2,tensor=2", tmp_path)
    run(tiny(model={"layers": 4}, checkpoint=ckpt, train={"steps": 8}), "fsdp=2", tmp_path)
    resumed = run(tiny(model={"layers": 4, "scan_layers": True}, checkpoint=ckpt,
                       pipeline={"schedule": "gpipe"}), "pipeline=2", tmp_path)
    assert resumed["records"][0]["step"] == 9
    np.testing.assert_allclose(losses(tmp_path), four_layer_reference, rtol=1e-5)


def test_resume_from_a_run_directory_written_before_stacking(tmp_path):
    """tests/data/run-before-stacked was written (fsdp=2, 4 scanned layers, a checkpoint
    at step 4) when parameters were one entry per layer in memory too."""
    exp = tiny(model={"layers": 4, "scan_layers": True, "d_model": 32, "heads": 4, "d_ff": 64,
                      "vocab": 128, "seq_len": 16},
               train={"steps": 8, "global_batch": 8},
               checkpoint={"enabled": True, "every_steps": 4, "keep": 1, "async_save": False})
    old = tmp_path / "old"
    shutil.copytree(FIXTURE, old)
    before = losses(old)
    resumed = run(exp, "data=2,fsdp=2,tensor=2", old)
    assert resumed["records"][0]["step"] == 5
    fresh = losses(run(exp, "data=2,fsdp=2,tensor=2", tmp_path / "fresh"))
    # The old layout's first four losses are the new layout's; the resume continues them.
    np.testing.assert_allclose(fresh[:4], before, rtol=1e-5)
    np.testing.assert_allclose(losses(old), fresh, rtol=1e-5)
