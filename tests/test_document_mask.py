"""data.document_mask: documents packed into one row do not attend to each other. A
rotary model gives a document the logits it gives the document alone; the losses are
the same on every mesh (the context ring sends each key block's documents round with
it; gathered keys carry them too; a pipeline gives every stage's layers their
microbatch's documents); a file without a document index is refused in one line."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
from helpers import losses, run, tiny, write_experiment

from plait.cli import main

LLAMA = {"kind": "llama", "heads": 8, "kv_heads": 2, "d_ff": 96, "rope_theta": 10000.0}
DOCS = [f"doc {i}: " + "abcdefgh"[i % 8] * (3 + (7 * i) % 23) + "." for i in range(200)]


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """A byte-level token file of 200 documents of 10 to 35 tokens, with its index."""
    root = tmp_path_factory.mktemp("docs")
    with (root / "docs.jsonl").open("w") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in DOCS)
    assert main(["data", str(root / "docs.jsonl"), str(root / "docs.bin")]) == 0
    return root / "docs.bin"


def _exp(path, base=LLAMA, **sections):
    # two layers: the pipelines' cases compare with the same one-device reference
    model = {"layers": 2, **base, **sections.pop("model", {})}
    data = {"source": "tokens", "path": str(path), "document_mask": True,
            **sections.pop("data", {})}
    train = {"steps": 6, "microbatches": 2, **sections.pop("train", {})}
    return tiny(model=model, data=data, train=train, **sections)


@pytest.mark.parametrize("base", [LLAMA, {}], ids=["rotary", "learned-positions"])
def test_a_packed_document_sees_only_itself(packed, base):
    """The logits of the second and third documents of a row equal those of each
    document run alone: a rotary model's (only distances matter) and a GPT-2's, whose
    learned positions restart at each document; without the mask they do not, nor
    the GPT-2's with positions running on across the row."""
    import jax
    from helpers import make_mesh

    from plait import loss_mask
    from plait.data.tokens import TokenFile
    from plait.parallel import context
    from plait.tasks import make_task

    exp = _exp(packed, base)
    task = make_task(exp, make_mesh("data=1"))
    params = task.init_state()["params"]
    starts = np.fromfile(str(packed) + ".documents", "<i8")
    source = TokenFile(packed, "uint16", 32, 0, 256, document_mask=True)
    # A row from document j's start that holds documents j + 1 and (part of) j + 2.
    j = next(j for j in range(len(starts) - 3) if starts[j + 2] - starts[j] < 30)
    first = int(starts[j])
    row = source.window(first, 33)[None]

    @functools.partial(jax.jit, static_argnums=2)
    def logits(params, row, restart=True):
        with loss_mask.flagged():
            within = context.document_positions(row) if restart else None
            with loss_mask.documents(context.document_segments(row), within):
                return task.model.apply(params, loss_mask.token_ids(row[:, :-1]))

    @jax.jit
    def plain(params, ids):
        return task.model.apply(params, ids)

    packed_logits = np.asarray(logits(params, row))[0]
    unmasked = np.asarray(plain(params, np.asarray(source.tokens[first:first + 32])[None]
                                .astype(np.int32)))[0]
    for doc in (j + 1, j + 2):
        a, b = int(starts[doc]) - first, min(int(starts[doc + 1]) - first, 32)
        alone = np.asarray(plain(params, np.asarray(source.tokens[first + a:first + b],
                                                    np.int32)[None]))[0]
        np.testing.assert_allclose(packed_logits[a:b], alone, rtol=2e-4, atol=2e-5)
        assert not np.allclose(unmasked[a:b], alone, rtol=2e-4, atol=2e-5)
        if not base:
            running_on = np.asarray(logits(params, row, False))[0]
            assert not np.allclose(running_on[a:b], alone, rtol=2e-4, atol=2e-5)


@pytest.fixture(scope="module")
def reference(packed, tmp_path_factory):
    return losses(run(_exp(packed), "data=1", tmp_path_factory.mktemp("ref")))


PIPE = {"train": {"microbatches": 1}}


@pytest.mark.parametrize("spec,sections", [
    ("data=2,fsdp=2,tensor=2", {"train": {"microbatches": 1}, "model": {"loss_chunks": 2}}),
    ("data=2,context=2", {}),  # the ring: each key block's documents travel with it
    ("context=4", {"context": {"attention": "allgather"}}),
    ("data=2,tensor_row=2,tensor_col=2", {}),
    # every stage's layers are given their microbatch's documents: the whole backward
    # (1F1B, with remat), the split one (ZB-H1), and the stage recomputed from its input
    ("pipeline=2,data=2", {**PIPE, "pipeline": {"schedule": "1f1b", "microbatches": 4},
                           "model": {"remat": "full"}}),
    ("pipeline=2", {**PIPE, "pipeline": {"schedule": "zb-h1", "microbatches": 2}}),
    ("pipeline=2,tensor=2", {**PIPE, "pipeline": {"schedule": "gpipe", "microbatches": 2,
                                                  "recompute": True}}),
], ids=["3d", "context-ring", "context-allgather", "2d", "1f1b-remat", "zb-h1",
        "gpipe-recompute"])
def test_masked_losses_equal_the_one_device_run(packed, reference, tmp_path, spec, sections,
                                                capsys):
    got = losses(run(_exp(packed, **sections), spec, tmp_path))
    np.testing.assert_allclose(got, reference, rtol=1e-4)


def test_learned_positions_restart_per_document_on_a_ring_and_a_pipeline(packed, tmp_path):
    """A GPT-2's per-document positions, in the order a context axis stores a sequence,
    and made by a pipeline's first stage from its microbatch: its losses on
    data=2,context=2 and on pipeline=2 (1F1B) equal one device's."""
    exp = _exp(packed, {}, train={"steps": 4})
    want = losses(run(exp, "data=1", tmp_path / "one"))
    np.testing.assert_allclose(losses(run(exp, "data=2,context=2", tmp_path / "ring")),
                               want, rtol=1e-4)
    piped = _exp(packed, {}, train={"steps": 4, "microbatches": 1},
                 pipeline={"schedule": "1f1b", "microbatches": 2})
    np.testing.assert_allclose(losses(run(piped, "pipeline=2", tmp_path / "pipe")), want,
                               rtol=1e-4)


def test_the_mask_changes_the_loss(packed, reference, tmp_path):
    unmasked = losses(run(_exp(packed, data={"document_mask": False}), "data=1", tmp_path))
    assert np.max(np.abs(unmasked - reference)) > 1e-3


@pytest.mark.parametrize("spec,data,message", [
    ("data=1", {"path": "{text}"}, "data.document_mask needs the document index beside"),
])
def test_document_mask_mistakes_are_one_line(packed, tmp_path, capsys, spec, data, message):
    text = tmp_path / "t.bin"
    np.frombuffer(b"plain text " * 50, np.uint8).astype(np.uint16).tofile(text)
    data = {k: v.format(text=text) for k, v in data.items()}
    exp = _exp(packed, data=data, pipeline={"microbatches": 2}, train={"microbatches": 1})
    cfg = write_experiment(tmp_path / "e.toml", exp)
    assert main(["train", str(cfg), "--run-dir", str(tmp_path / "r"), "--mesh", spec]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
