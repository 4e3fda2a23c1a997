"""Hugging Face models in and out: plait's decoder against `transformers`' own outputs on
tiny random-weight GPT-2, Llama 3 (GQA, rotary scaling), Mistral (multi-query) and Qwen2
(q/k/v biases, tied) models (fixtures written by tests/data/hf/make_fixtures.py), the
import -> train -> export -> import round trip, and import's one-line errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import plait_cmd

from plait.cli import main
from plait.sample import generator, load

FIXTURES = Path(__file__).parent / "data" / "hf"
NAMES = ("gpt2", "llama3", "mistral", "qwen2", "mixtral", "qwen2_moe", "olmoe")


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """Each fixture imported once into a run directory."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name in NAMES:
        assert main(["import", str(FIXTURES / name), "--run-dir", str(root / name)]) == 0
        out[name] = root / name
    return out


@pytest.mark.parametrize("name", NAMES)
def test_logits_and_greedy_continuation_equal_transformers(imported, name):
    expected = np.load(FIXTURES / name / "expected.npz")
    exp, mdef, params, step = load(imported[name], None)
    assert step == 0 and exp.precision.compute == "float32"
    logits = np.asarray(jax.jit(mdef.apply)(params, jnp.asarray(expected["ids"])))
    vocab = exp.model.vocab
    ref = expected["logits"]
    assert logits.shape[-1] == exp.model.padded_vocab > vocab == ref.shape[-1]
    err = np.abs(logits[..., :vocab] - ref).max()
    assert err <= 1e-4 * np.abs(ref).max(), (name, err)
    # greedy decoding over plait's KV cache continues the prompt as transformers' generate
    cont = expected["continuation"]
    out = generator(mdef, None, len(cont), 0.0, 0)(params, jnp.asarray(expected["prompt"]),
                                                   jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(out), cont)


def test_import_writes_the_experiment_and_a_params_only_checkpoint(imported):
    run = imported["qwen2"]
    text = (run / "config.toml").read_text()
    assert 'kind = "llama"' in text and "qkv_bias = true" in text
    assert "tie_embeddings = true" in text and "kv_heads = 2" in text
    gpt2 = (imported["gpt2"] / "config.toml").read_text()
    assert 'kind = "gpt"' in gpt2 and "vocab = 300" in gpt2
    llama = (imported["llama3"] / "config.toml").read_text()
    assert "original_context = 16" in llama and "rope_theta = 500000.0" in llama
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["0"]
    qmoe = (imported["qwen2_moe"] / "config.toml").read_text()
    for line in ("experts = 4", "d_ff = 48", "shared_d_ff = 40", "shared_gate = true",
                 "renormalize = false", "capacity_factor = 0.0", "qkv_bias = true"):
        assert line in qmoe, line
    olmoe = (imported["olmoe"] / "config.toml").read_text()
    assert "qk_norm = true" in olmoe and "renormalize = false" in olmoe


@pytest.mark.parametrize("name,arch", [("mixtral", "MixtralForCausalLM"),
                                       ("qwen2_moe", "Qwen2MoeForCausalLM"),
                                       ("olmoe", "OlmoeForCausalLM")])
def test_mixtures_of_experts_export_and_import_again_bit_for_bit(imported, tmp_path,
                                                                  name, arch):
    out = tmp_path / "hf-out"
    assert main(["export", str(imported[name]), "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == [arch]
    again = tmp_path / "again"
    assert main(["import", str(out), "--run-dir", str(again)]) == 0
    from plait.toml_files import read_toml

    def model(run: Path) -> dict:
        return read_toml(run / "config.toml", "run config")["model"]

    assert model(again) == model(imported[name])
    jax.tree.map(np.testing.assert_array_equal, _params(again), _params(imported[name]))


def _params(run_dir: Path, step: int | None = None) -> dict:
    return jax.tree.map(np.asarray, load(run_dir, step)[2])


def test_import_train_export_import_round_trips_bit_for_bit(imported, tmp_path, capsys):
    """Fine-tune an imported Llama 10 steps (the optimizer starts fresh from the imported
    weights), export it, import the export: the same weights, bit for bit."""
    run = tmp_path / "ft"
    shutil.copytree(imported["llama3"], run)
    before = _params(run)
    train = ["train", str(run / "config.toml"), "--run-dir", str(run), "--mesh", "data=2",
             "--steps", "10", "--set", 'data.source="synthetic"',
             "--set", "train.global_batch=4", "--set", "model.seq_len=16",
             "--set", "optimizer.lr=1e-3", "--set", "checkpoint.every_steps=10",
             "--set", "checkpoint.async_save=false"]
    assert main(train) == 0
    log = capsys.readouterr().out
    assert "imported from" in log and "optimizer state fresh" in log, log
    after = _params(run)
    moved = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), after, before)
    assert max(jax.tree.leaves(moved)) > 1e-4  # it trained from the imported weights
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["step"] == 1 and np.isfinite(records[-1]["loss"])

    out = tmp_path / "hf-out"
    assert main(["export", str(run), "--out", str(out)]) == 0
    hf = json.loads((out / "config.json").read_text())
    assert hf["architectures"] == ["LlamaForCausalLM"] and hf["num_key_value_heads"] == 2
    again = tmp_path / "again"
    capsys.readouterr()
    assert main(["import", str(out), "--run-dir", str(again), "--seq-len", "16"]) == 0
    assert "note:" not in capsys.readouterr().out
    jax.tree.map(np.testing.assert_array_equal, _params(again), after)
    # Longer than the 16 positions it was trained on (its config.json says so): noted.
    assert main(["import", str(out), "--run-dir", str(tmp_path / "longer"), "--seq-len",
                 "32"]) == 0
    assert "--seq-len 32 is past the 16 positions config.json says the model was trained " \
        "on" in capsys.readouterr().out


def test_export_loads_in_transformers_with_plaits_logits(imported, tmp_path):
    """Needs torch and transformers (not installed in CI: run by hand)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    for name in NAMES:
        out = tmp_path / name
        assert main(["export", str(imported[name]), "--out", str(out)]) == 0
        model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        ids = np.load(FIXTURES / name / "expected.npz")["ids"]
        with torch.no_grad():
            theirs = model(torch.as_tensor(ids)).logits.numpy()
        exp, mdef, params, _ = load(imported[name], None)
        ours = np.asarray(mdef.apply(params, jnp.asarray(ids)))[..., :exp.model.vocab]
        assert np.abs(ours - theirs).max() <= 1e-4 * np.abs(theirs).max(), name


def _broken(tmp_path: Path, edit, name: str = "mistral") -> Path:
    src = tmp_path / "model"
    shutil.copytree(FIXTURES / name, src)
    edit(src)
    return src


def _config_edit(**changes):
    def edit(d: Path):
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(changes)
        (d / "config.json").write_text(json.dumps(cfg))
    return edit


def _sharded_without_one(d: Path):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(d / "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    save_file({k: tensors[k] for k in names[:half]}, str(d / "a.safetensors"))
    weight_map = {k: "a.safetensors" for k in names[:half]}
    weight_map.update({k: "b.safetensors" for k in names[half:]})
    (d / "model.safetensors").unlink()
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _drop_tensor(d: Path):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(d / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(d / "model.safetensors"))


IMPORT_ERRORS = [
    (_config_edit(architectures=["BertForMaskedLM"]), "architecture BertForMaskedLM is not one"),
    (_config_edit(hidden_size=48), "the weights and config.json disagree"),
    (_config_edit(hidden_act="gelu"), "is not SwiGLU's silu"),
    (_config_edit(rope_parameters={"rope_type": "yarn", "factor": 4.0}),
     "rotary scaling 'yarn' is not one plait runs"),
    (_config_edit(sliding_window=16), "sliding-window attention (16 tokens)"),
    # values plait's schema refuses: pydantic's traceback
    (_config_edit(rms_norm_eps=0.0), "config key 'model.norm_eps' in "),
    (_config_edit(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                                   "high_freq_factor": 1.0, "rope_theta": 500000.0,
                                   "original_max_position_embeddings": 16}),
     "high_freq_factor = 1.0 must be above low_freq_factor = 4.0"),
    # values computed with before plait's schema saw them: TypeError, ZeroDivisionError,
    # numpy's reshape error, and a 10**12-layer model laid out until memory ran out
    (_config_edit(hidden_size="x"), 'hidden_size = "x" is not a number'),
    (_config_edit(num_attention_heads=0), "num_attention_heads = 0 is not a size (a whole "
                                          "number, at least 1)"),
    (_config_edit(hidden_size=None), "lacks hidden_size, which MistralForCausalLM needs"),
    (_config_edit(rope_theta="x"), 'rope_theta = "x" is not a number'),
    (_config_edit(head_dim=10**12), "does not take the shape config.json's sizes give it"),
    (_config_edit(num_hidden_layers=10**12), "gives 1000000000000 layers but the weights "
                                             "hold 2; the weights and config.json disagree"),
    (_config_edit(architectures="MistralForCausalLM"), "is not a list of names"),
    (_config_edit(rope_parameters="x"), 'rope_parameters = "x" is not a table of rotary'),
    (_config_edit(vocab_size=10**12), "(300 rows for a vocabulary of 1000000000000); the "
                                      "weights and config.json disagree"),
    (lambda d: (d / "config.json").write_text("[1, 2]"), "is not a JSON object of settings"),
    (_sharded_without_one, "lacks the shard b.safetensors"),
    (_drop_tensor, "has no tensor 'model.layers.1.mlp.up_proj.weight'"),
    (lambda d: (d / "config.json").unlink(), "has no config.json"),
    (lambda d: (d / "model.safetensors").write_bytes(b"not safetensors"),
     "is not a readable safetensors file"),
]


@pytest.mark.parametrize("edit,message", IMPORT_ERRORS,
                         ids=[m.split()[0] + str(i) for i, (_, m) in enumerate(IMPORT_ERRORS)])
def test_import_errors_are_one_line(tmp_path, capsys, edit, message):
    src = _broken(tmp_path, edit)
    run = tmp_path / "run"
    assert main(["import", str(src), "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not run.exists() and not any(tmp_path.glob(".run.partial"))


def test_an_import_written_in_small_chunks_reads_back_the_same(imported, tmp_path,
                                                               monkeypatch):
    """The import writes each array in chunks, a file each (TensorStore encodes a few at a
    time); chunks far smaller than the arrays read back as the same weights."""
    from plait.hf import convert

    monkeypatch.setattr(convert, "IMPORT_CHUNK_BYTES", 4096)
    run = tmp_path / "chunked"
    assert main(["import", str(FIXTURES / "llama3"), "--run-dir", str(run)]) == 0
    import tensorstore as ts

    state = run / "checkpoints" / "0" / "state"
    embed = ts.open({"driver": "zarr", "kvstore": f"file://{state}/params.tok_embed"}
                    ).result()
    chunk = embed.chunk_layout.write_chunk.shape
    assert np.prod(chunk) * 4 <= 4096 < embed.size * 4, chunk
    files = [p for p in (state / "params.tok_embed").rglob("*") if p.is_file()]
    assert len(files) > embed.size * 4 // 4096, len(files)  # a file per chunk
    jax.tree.map(np.testing.assert_array_equal, _params(run), _params(imported["llama3"]))


@pytest.mark.parametrize("name,edit,message", [
    ("qwen2_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step = 2"),
    ("olmoe", {"clip_qkv": 8.0}, "clip_qkv = 8.0 clamps")], ids=["qwen2_moe", "olmoe"])
def test_moe_layouts_plait_does_not_run_are_refused_in_one_line(tmp_path, capsys, name, edit,
                                                                message):
    src = _broken(tmp_path, _config_edit(**edit), name)
    assert main(["import", str(src), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_import_refuses_a_run_directory_in_use(imported, capsys, tmp_path):
    run = tmp_path / "busy"
    run.mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    assert main(["import", str(FIXTURES / "gpt2"), "--run-dir", str(run)]) == 2
    assert "already exists and is not empty" in capsys.readouterr().err
    assert (run / "metrics.jsonl").read_text() == "{}\n"
    # a file where a directory goes, either way: was "not found" / "is not empty"
    assert main(["import", str(run / "metrics.jsonl"), "--run-dir", str(tmp_path / "x")]) == 2
    assert f"model directory '{run / 'metrics.jsonl'}' is a file;" in capsys.readouterr().err
    assert main(["import", str(FIXTURES / "gpt2"), "--run-dir", str(run / "metrics.jsonl")]) \
        == 2
    assert f"--run-dir {run / 'metrics.jsonl'} is a file;" in capsys.readouterr().err


def test_import_and_export_from_the_command_line(tmp_path):
    """The console script end to end (one subprocess), a bfloat16 export."""
    run, out = tmp_path / "run", tmp_path / "out"
    plait_cmd("import", str(FIXTURES / "qwen2"), "--run-dir", str(run), check=True)
    r = plait_cmd("export", str(run), "--out", str(out), "--dtype", "bfloat16", check=True)
    assert "Qwen2ForCausalLM" in r.stdout
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="numpy") as f:
        assert f.get_slice("model.layers.0.self_attn.q_proj.bias").get_dtype() == "BF16"
        assert "lm_head.weight" not in f.keys()  # noqa: SIM118 - tied


def test_import_and_export_say_how_far_they_are_off_a_terminal(imported, tmp_path, capsys,
                                                                monkeypatch):
    """An 8B import converts for minutes: off a terminal (stderr not a tty, as under
    pytest) a line every progress.EVERY_S seconds, 0 here so every tensor says one."""
    from plait import progress

    monkeypatch.setattr(progress, "EVERY_S", 0.0)
    out = tmp_path / "hf"
    assert main(["export", str(imported["llama3"]), "--out", str(out)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert any(x.startswith("plait export: converting and writing: ") and " of " in x
               for x in err), err
    assert main(["import", str(out), "--run-dir", str(tmp_path / "again")]) == 0
    err = capsys.readouterr().err.splitlines()
    last = [x for x in err if x.startswith("plait import: converting: ")][-1]
    done, total = last.split(": ")[2].split(" (")[0].split(" of ")
    assert done == total, last  # the count reaches the parameters' whole size
    assert "plait import: writing the step-0 checkpoint ..." in err


def test_an_export_past_the_shard_size_is_shards_and_an_index_that_import_reads(
        imported, tmp_path, monkeypatch, capsys):
    """transformers writes at most 5 GB a file (one 140 GB file for a 70B model had been
    plait's); shards of at most convert.SHARD_BYTES, 100 kB here, each written as it
    fills, named and indexed as transformers names them: import reads them back
    bit for bit."""
    from plait.hf import convert

    monkeypatch.setattr(convert, "SHARD_BYTES", 100_000)
    out = tmp_path / "hf"
    assert main(["export", str(imported["llama3"]), "--out", str(out)]) == 0
    said = capsys.readouterr().out
    index = json.loads((out / convert.INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(p.name for p in out.glob("*.safetensors")) == files
    assert not (out / convert.SINGLE).exists() and f"in {len(files)} files" in said
    sizes = [(out / f).stat().st_size for f in files]
    assert index["metadata"]["total_size"] <= sum(sizes)
    assert main(["import", str(out), "--run-dir", str(tmp_path / "again")]) == 0
    jax.tree.map(np.testing.assert_array_equal, _params(tmp_path / "again"),
                 _params(imported["llama3"]))
