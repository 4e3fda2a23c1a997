"""Reading an experiment: TOML files, `--set` overrides, and validation against the
schema (plait.config) with one-line errors: unknown keys get a "did you mean"
suggestion and a wrong type names the key, the value and the expected type."""

from __future__ import annotations

import difflib
import sys
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from plait import kinds
from plait.config import Experiment, ModelSection, model_class
from plait.errors import UserError
from plait.toml_files import read_toml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def _section_class(model: type[BaseModel], name: str, raw: Any = None) -> type[BaseModel] | None:
    """The schema of a sub-table (`[model]` by its kind), or None for a plain value."""
    if model is Experiment and name == "model":
        kind = raw.get("kind", "gpt") if isinstance(raw, dict) else "gpt"
        return model_class(kind) if isinstance(kind, str) else ModelSection
    ann = model.model_fields[name].annotation
    # A table that may be left out (`moe: MoEConfig | None`) is checked like one that may not.
    tables = [a for a in (typing.get_args(ann) or (ann,))
              if isinstance(a, type) and issubclass(a, BaseModel)]
    return tables[0] if len(tables) == 1 else None


def all_keys(model: type[BaseModel] = Experiment, prefix: str = "") -> list[str]:
    """Every dotted key the schema accepts, every model kind's included (for suggestions)."""
    keys = []
    for name in model.model_fields:
        if model is Experiment and name == "model":
            for kind in kinds.kinds():
                keys += [k for k in all_keys(model_class(kind), "model.") if k not in keys]
            continue
        section = _section_class(model, name)
        keys += all_keys(section, f"{prefix}{name}.") if section else [f"{prefix}{name}"]
    return keys


def _check_unknown_keys(raw: dict, model: type[BaseModel], prefix: str, source: str,
                        kind: str = "gpt") -> None:
    """`kind`: the experiment's model kind, whose [model] keys may be suggested."""
    if model is Experiment and isinstance(raw.get("model"), dict):
        kind = raw["model"].get("kind", "gpt")
        if not isinstance(kind, str):  # else every key of [model] was called unknown
            raise UserError(f"config key 'model.kind' in {source}: input should be the name "
                            f"of a model kind ({', '.join(kinds.kinds())}), got {kind!r} "
                            f"({_type_name(kind)})")
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        if key not in model.model_fields:
            siblings = [f"{prefix}{k}" for k in model.model_fields]
            # Suggestions from the whole schema, but not another model kind's keys.
            others = [k for k in all_keys() if not k.startswith("model.")] + (
                all_keys(model_class(kind), "model.") if kind in kinds.kinds() else [])
            close = (difflib.get_close_matches(dotted, siblings, n=1, cutoff=0.6)
                     or difflib.get_close_matches(dotted, others, n=1, cutoff=0.6))
            alias = ALIASES.get(key)
            if alias:
                close = [alias]
            hint = f"; did you mean '{close[0]}'?" if close else "; see docs/config.md for the keys"
            which = f" (a {raw['kind']} model)" if prefix == "model." and "kind" in raw else ""
            owners = _kinds_with(key) if prefix == "model." else []
            if owners:
                hint = (f"; it is a key of {' and '.join(owners)} models, not of this one: drop "
                        "it, or set model.kind")
            raise UserError(f"unknown config key '{dotted}'{which} in {source}{hint}")
        section = _section_class(model, key, value)
        if section is not None:
            if not isinstance(value, dict):
                raise UserError(
                    f"config key '{dotted}' in {source} must be a table ([{dotted}]), "
                    f"got {type(value).__name__}"
                )
            _check_unknown_keys(value, section, f"{dotted}.", source, kind)


def _type_name(value: Any) -> str:
    return {str: "string", int: "integer", float: "float", bool: "boolean", list: "array",
            dict: "table"}.get(type(value), type(value).__name__)


def _key(err: dict) -> str:
    """The dotted key of a validation error, without the members of a union pydantic
    tried (scan_layers = "yes": ('model', 'scan_layers', 'bool') and the same with
    "literal['auto']")."""
    return ".".join(str(p) for p in err["loc"]
                    if not (isinstance(p, str) and (p in ("bool", "int", "float", "str")
                                                    or "[" in p)))


def _message(e: ValidationError) -> tuple[str, dict]:
    """The first error's key and message; a value no member of a union takes gets the
    members' wants in one ("input should be a valid boolean or 'auto'")."""
    errors = e.errors()
    key = _key(errors[0])
    wants = [x["msg"].removeprefix("Value error, ") for x in errors if _key(x) == key]
    prefix = "Input should be "
    if len(wants) > 1 and all(w.startswith(prefix) for w in wants):
        wants = [wants[0], *(w.removeprefix(prefix) for w in wants[1:])]
        return key, {**errors[0], "msg": " or ".join(wants)}
    return key, {**errors[0], "msg": wants[0]}


def validate(raw: dict, source: str) -> Experiment:
    """Build an Experiment from a raw dict, with one-line errors."""
    _check_unknown_keys(raw, Experiment, "", source)
    try:
        return Experiment.model_validate(raw)
    except ValidationError as e:
        loc, err = _message(e)
        value = err.get("input")
        msg = err["msg"]
        if not loc:  # a check across sections: the message names its keys
            raise UserError(f"{msg} (in {source})") from None
        if isinstance(value, dict) and err["type"] == "value_error":  # a check across a
            raise UserError(f"config key '{loc}' in {source}: {msg[:1].lower() + msg[1:]}"
                            ) from None  # table's keys, which it names
        raise UserError(
            f"config key '{loc}' in {source}: {msg[:1].lower() + msg[1:]}, "
            f"got {value!r} ({_type_name(value)})"
        ) from None


def _error_at(raw: dict) -> str | None:
    """Where the first validation error of `raw` is ("" for a check across sections),
    or None where it validates."""
    try:
        Experiment.model_validate(raw)
    except ValidationError as e:
        return _key(e.errors()[0])
    return None


def parse_value(text: str) -> Any:
    """A `--set` value is TOML (`3`, `1e-3`, `true`, `"x"`, `[1, 2]`); bare words are strings."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_override(raw: dict, assignment: str, named: str | None = None) -> None:
    """Set KEY=VALUE in `raw`; `named`: how the user gave it (default "--set KEY")."""
    key, _, text = assignment.partition("=")
    key = key.strip()
    if "=" not in assignment or not key:
        raise UserError(f"--set expects key=value, got '{assignment}' (e.g. --set train.steps=50)")
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise UserError(f"{named or f'--set {key}'}: '{part}' is a value, not a table")
        node = child
    node[parts[-1]] = parse_value(text.strip())


def _kinds_with(key: str) -> list[str]:
    """The model kinds whose [model] table has `key`."""
    return [k for k in kinds.kinds() if key in model_class(k).model_fields]


# Names users bring from other trainers, for "did you mean" on --set and in files.
ALIASES = {"learning_rate": "optimizer.lr", "lr": "optimizer.lr",
           "batch_size": "train.global_batch", "global_batch_size": "train.global_batch",
           "n_layer": "model.layers", "num_layers": "model.layers",
           "n_head": "model.heads", "num_heads": "model.heads",
           "n_embd": "model.d_model", "hidden_size": "model.d_model",
           "block_size": "model.seq_len", "max_iters": "train.steps",
           "vocab_size": "model.vocab", "weight_decay": "optimizer.weight_decay"}


def _name_is_plain(raw: dict, source: str) -> None:
    """The run name becomes runs/<name>: one plain directory name, nothing that climbs out."""
    name = raw.get("name")
    if isinstance(name, str) and (not name or name in (".", "..") or "/" in name
                                  or "\\" in name or name.startswith("~")):
        raise UserError(f"name = {name!r} in {source} must be a plain directory name (no '/', "
                        "'..' or '~'); pick another name, or place the run with --run-dir")


def load_experiment(path: str | Path, overrides: list[str] = (),
                    said: dict[str, str] | None = None) -> Experiment:
    """The experiment file with `overrides` (KEY=VALUE) applied. An error in an override
    names it as the user gave it: `said[KEY]` (e.g. "--steps", "--vary model.heads"),
    else "--set KEY"."""
    path = Path(path)

    def named(key: str) -> str:
        return (said or {}).get(key, f"--set {key}")

    raw = read_toml(path, "experiment file")
    if not raw:
        raise UserError(f"experiment file '{path}' is empty; start from "
                        "experiments/quickstart.toml")
    raw.setdefault("name", path.stem)
    _check_unknown_keys(raw, Experiment, "", str(path))
    # a check of a table (model.heads=3 against model.d_model = 64) that held until a
    # --set: that --set is named if the check still fails after the last one
    valid, broke = bool(overrides) and _error_at(raw) is None, None
    for assignment in overrides:
        key = assignment.split("=", 1)[0].strip()
        apply_override(raw, assignment, named(key))
        _check_unknown_keys(raw, Experiment, "", named(key))
        loc = _error_at(raw)
        if loc == key or (loc or "").startswith(key + "."):  # in a value given with --set
            validate(raw, named(key))  # (or an item of its list or table) names --set
        if valid and loc and key.startswith(loc + "."):
            broke = (loc, key)
        valid = loc is None
    _name_is_plain(raw, str(path))
    blamed = broke is not None and _error_at(raw) == broke[0]
    return validate(raw, named(broke[1]) if blamed else str(path))
