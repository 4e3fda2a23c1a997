"""Held-out evaluation of a GPT: the logged loss equals a hand computation on the same
held-out batches, on one device and on a 3-D mesh."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import run, tiny

from plait.data.tokens import TokenFile, write_tokens


def _softmax_xent(logits: np.ndarray, targets: np.ndarray) -> float:
    logits = logits.astype(np.float64)
    top = logits.max(-1, keepdims=True)
    lse = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
    picked = np.take_along_axis(logits, targets[..., None], -1)[..., 0]
    return float((lse - picked).mean())


@pytest.mark.parametrize("mesh", ["data=1", "data=2,fsdp=2,tensor=2"])
def test_held_out_loss_equals_a_hand_computation(mesh, tmp_path):
    import jax
    import orbax.checkpoint as ocp
    from helpers import make_mesh

    from plait.tasks import make_task

    rng = np.random.default_rng(7)
    held_out = tmp_path / "val.bin"
    write_tokens(rng.integers(0, 256, 5000), held_out, "uint16")
    exp = tiny(data={"eval_path": str(held_out), "eval_batches": 2, "eval_every_steps": 4},
               checkpoint={"enabled": True, "every_steps": 4, "keep": 5, "async_save": False},
               train={"steps": 8, "global_batch": 16, "microbatches": 2})
    run_dir = tmp_path / "r"
    summary = run(exp, mesh, run_dir)
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evaluated = {r["step"]: r for r in records if "eval_loss" in r}
    assert sorted(evaluated) == [4, 8]
    assert summary["records"][-1]["eval_perplexity"] == pytest.approx(
        np.exp(summary["records"][-1]["eval_loss"]))
    # By hand: the step-8 parameters, the model applied on one device, numpy's xent.
    with ocp.StandardCheckpointer() as reader:
        params = reader.restore(run_dir / "checkpoints" / "8" / "state")["params"]
    task = make_task(exp, make_mesh("data=1"))
    source = TokenFile(held_out, "uint16", exp.model.seq_len, exp.seed, exp.model.vocab)
    losses = []
    for k in range(2):
        tokens = source.rows(k, 0, exp.train.global_batch)
        logits = np.asarray(jax.jit(task.model.apply)(params, tokens[:, :-1]))
        losses.append(_softmax_xent(logits[..., : exp.model.vocab], tokens[:, 1:]))
    np.testing.assert_allclose(evaluated[8]["eval_loss"], np.mean(losses), rtol=2e-5)
