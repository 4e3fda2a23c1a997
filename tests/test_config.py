import pytest
from helpers import ROOT

from plait.config import Experiment
from plait.config_files import apply_override, load_experiment, parse_value, validate
from plait.errors import UserError


def test_every_shipped_experiment_loads():
    names = sorted(p.stem for p in (ROOT / "experiments").glob("*.toml"))
    assert {"quickstart", "gpt2-124m", "gpt2-350m", "gpt2-1.3b"} <= set(names)
    for name in names:
        exp = load_experiment(ROOT / "experiments" / f"{name}.toml")
        assert exp.name == name


def test_required_keys_are_spelled_as_documented():
    exp = load_experiment(ROOT / "experiments/quickstart.toml", [
        "seed=3", "train.steps=5", "train.global_batch=8", "train.microbatches=2",
        "model.kind='gpt'", "model.layers=1", "model.d_model=32", "model.heads=2",
        "model.d_ff=64", "model.vocab=100", "model.seq_len=16", "optimizer.lr=1e-3",
        'precision.compute="bfloat16"', "checkpoint.every_steps=2", "checkpoint.keep=1",
        "log.every_steps=1"])
    assert (exp.seed, exp.train.steps, exp.train.microbatches, exp.model.vocab) == (3, 5, 2, 100)
    assert exp.precision.compute == "bfloat16" and exp.optimizer.lr == 1e-3


def test_set_values_are_toml():
    assert parse_value("3") == 3 and parse_value("1e-3") == 1e-3
    assert parse_value("true") is True and parse_value('"x"') == "x"
    assert parse_value("bfloat16") == "bfloat16" and parse_value("[1, 2]") == [1, 2]
    raw = {}
    apply_override(raw, "model.layers=4")
    assert raw == {"model": {"layers": 4}}
    for wrong in ("model.layers", "=3", " =3"):  # '=3' was "unknown config key ''"
        with pytest.raises(UserError, match=f"--set expects key=value, got '{wrong}'"):
            apply_override(raw, wrong)


def test_unknown_key_suggests_the_closest():
    with pytest.raises(UserError, match=r"unknown config key 'optimizer.lrr'.*'optimizer.lr'"):
        validate({"optimizer": {"lrr": 1.0}}, "x.toml")
    with pytest.raises(UserError, match=r"unknown config key 'trian'.*'train"):
        validate({"trian": {"steps": 1}}, "x.toml")
    # Inside a table that may be left out ([model.moe]): named and matched, not pydantic's
    # "extra inputs are not permitted".
    with pytest.raises(UserError, match=r"'model.moe.expert'.*did you mean 'model.moe.experts'"):
        validate({"model": {"kind": "llama", "moe": {"expert": 4}}}, "x.toml")
    # Another model kind's key is said to be one, and never suggested: a DLRM was asked
    # "did you mean 'model.attention'?", a key it does not have.
    with pytest.raises(UserError, match=r"'model.attention' \(a dlrm model\).*it is a key of "
                       r"gpt and llama models, not of this one"):
        validate({"model": {"kind": "dlrm", "attention": "xla"}}, "x.toml")
    with pytest.raises(UserError) as e:
        validate({"model": {"kind": "dlrm", "interaction": "cat"}}, "x.toml")
    assert "attention" not in str(e.value), e.value


def test_wrong_type_names_key_value_and_type():
    with pytest.raises(UserError, match=r"'train.steps'.*'ten' \(string\)"):
        validate({"train": {"steps": "ten"}}, "x.toml")
    with pytest.raises(UserError, match=r"'precision.compute'.*'fp8'"):
        validate({"precision": {"compute": "fp8"}}, "x.toml")
    with pytest.raises(UserError, match=r"'model.layers'.*greater than 0"):
        validate({"model": {"layers": 0}}, "x.toml")


def test_resolved_config_round_trips_through_toml(tmp_path):
    exp = load_experiment(ROOT / "experiments/quickstart.toml", ["train.steps=7"])
    path = tmp_path / "config.toml"
    path.write_text(exp.to_toml())
    assert load_experiment(path) == exp
    assert isinstance(exp, Experiment)


def test_docs_list_every_key():
    from plait.config_files import all_keys

    text = (ROOT / "docs" / "config.md").read_text()
    missing = [k for k in all_keys() if f"`{k}`" not in text]
    assert not missing, f"docs/config.md does not document {missing}"
