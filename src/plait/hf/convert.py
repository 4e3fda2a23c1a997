"""`plait import HF_DIR --run-dir RUN` and `plait export RUN --out DIR`.

Import reads a local Hugging Face model directory (config.json, model.safetensors
or shards listed in model.safetensors.index.json, tokenizer.json,
tokenizer_config.json and chat_template.jinja when present) and writes a run
directory: the experiment (config.toml), the tokenizer and its chat template, and a
step-0 checkpoint holding only the parameters, in the dtype they were stored in,
which `plait train` restores (cast to float32 master weights on load) with a
fresh optimizer state. Tensors are read one at a time through `safetensors`
(each file's mapping closed after the read) and each is converted into the
checkpoint's tree at once, so the host holds the model about once, and the
checkpoint is written an array and a few chunks at a time (docs/benchmarks.md
has the measured peak). The run directory is written under
a temporary name and renamed when complete: an interrupted import leaves
nothing that looks like a run.

Export writes what `transformers.AutoModelForCausalLM.from_pretrained` loads:
config.json, model.safetensors (float32 or bfloat16; past 5 GB, shards of at most
that and their index, as transformers writes them) and the run's tokenizer files.
Each file is written as it fills, so the host holds the parameters and one file.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from plait import output_paths
from plait.data import chat
from plait.errors import UserError
from plait.hf import config_json, layout
from plait.progress import Ticker
from plait.views.common import size_text

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
TOKENIZER = "tokenizer.json"
# Carried from a model directory into the run and back out: the tokenizer, and its
# special tokens and chat template (plait data --chat, plait sample --chat).
TOKENIZER_FILES = (TOKENIZER, *chat.FILES)
IMPORT_CHUNK_BYTES = 64 * 2**20  # the checkpoint's chunks: TensorStore encodes one at a time
SHARD_BYTES = 5 * 10**9  # an export's largest safetensors file (transformers' "5GB")


class Tensors:
    """The tensors of a model directory by name, read one at a time (safetensors)."""

    def __init__(self, hf_dir: Path):
        from safetensors import safe_open

        index = hf_dir / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as e:
                raise UserError(f"{index} is not a safetensors index ({e}); re-download the "
                                "model") from None
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (hf_dir / f).is_file()]
            if missing:
                raise UserError(f"{hf_dir} lacks the shard {missing[0]} listed in {INDEX} "
                                f"({len(missing)} of {len(files)} missing); download every "
                                "shard")
        elif (hf_dir / SINGLE).is_file():
            weight_map, files = None, [SINGLE]
        else:
            raise UserError(f"{hf_dir} has neither {SINGLE} nor {INDEX}; plait reads "
                            "safetensors checkpoints")
        for f in files:  # every file readable before anything is written
            try:
                with safe_open(str(hf_dir / f), framework="numpy") as handle:
                    keys = list(handle.keys())
            except Exception as e:  # noqa: BLE001 - the library's own error, on one line
                raise UserError(f"{hf_dir / f} is not a readable safetensors file "
                                f"({str(e).splitlines()[0]}); re-download it") from None
            if weight_map is None:
                weight_map = dict.fromkeys(keys, SINGLE)
        self.weight_map = weight_map
        self.dir = hf_dir
        self.last = ""

    def names(self) -> set[str]:
        return set(self.weight_map)

    def dtypes(self) -> set[str]:
        from safetensors import safe_open

        out = set()
        for f in set(self.weight_map.values()):
            with safe_open(str(self.dir / f), framework="numpy") as handle:
                out |= {handle.get_slice(n).get_dtype() for n in handle.keys()}  # noqa: SIM118
        return out

    def __call__(self, name: str) -> np.ndarray:
        """One tensor, copied out of its file, whose mapping is closed at once: the pages
        read stay out of this process (safetensors maps the whole file)."""
        from safetensors import safe_open

        self.last = name
        if name not in self.weight_map:
            raise UserError(f"{self.dir} has no tensor '{name}', which its config.json's "
                            "architecture needs; the checkpoint is incomplete or of another "
                            "model")
        with safe_open(str(self.dir / self.weight_map[name]), framework="numpy") as handle:
            return handle.get_tensor(name)


def _set(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def _check_fresh(path: Path, flag: str) -> None:
    """`path` holds nothing yet, and the directory it goes in is made."""
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        what = "is a file" if not path.is_dir() else "already exists and is not empty"
        raise UserError(f"{flag} {path} {what}; choose a new directory (nothing there was "
                        "touched)")
    output_paths.parent(path, flag)


def _fresh_dir(path: Path, flag: str) -> Path:
    """A temporary sibling of `path`, which must not hold anything yet."""
    _check_fresh(path, flag)
    tmp = path.parent / f".{path.name}.partial"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def _publish(tmp: Path, final: Path) -> None:
    """The finished temporary directory takes its final name (empty or absent)."""
    if final.exists():
        final.rmdir()
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(final)


def _laid_out(cfg, arch: str, tensors, prefix: str, hf_dir: Path):
    """layout.to_plait's (path, array) pairs; a tensor too small or too large for the
    shape config.json's sizes give it (layout.ShapeMismatch) is one line."""
    try:
        yield from layout.to_plait(cfg, arch, tensors, prefix)
    except layout.ShapeMismatch as e:
        raise UserError(f"{hf_dir}: tensor '{tensors.last}' does not take the shape "
                        f"config.json's sizes give it ({e}); the weights and config.json "
                        "disagree") from None


def _experiment(hf: dict, table: dict, name: str, where: str):
    """The run's experiment; a value plait does not take (rms_norm_eps = 0, a rope
    scaling band upside down) is one line naming plait's key and the file (pydantic's
    traceback before)."""
    from plait.config_files import validate

    bf16 = str(hf.get("torch_dtype") or hf.get("dtype") or "").endswith("bfloat16")
    return validate({
        "name": name, "model": table,
        "data": {"source": "tokens"},
        "train": {"steps": 1000, "global_batch": 8},
        "optimizer": {"lr": 2e-5, "warmup_steps": 20, "weight_decay": 0.0, "min_lr_ratio": 0.1},
        "precision": {"compute": "bfloat16" if bf16 else "float32"},
        "checkpoint": {"every_steps": 200, "keep": 2},
    }, f"{where} (as plait's keys)")


def import_model(hf_dir: str | Path, run_dir: str | Path, seq_len: int | None = None
                 ) -> dict[str, Any]:
    """Write RUN (config.toml, tokenizer.json, checkpoints/0) from a Hugging Face model
    directory; returns what was imported."""
    import jax

    from plait.models.gpt import abstract_model

    hf_dir, run_dir = Path(hf_dir), Path(run_dir)
    config = hf_dir / "config.json"
    if not hf_dir.is_dir():
        raise UserError(f"model directory '{hf_dir}' " + (
            "is a file" if hf_dir.exists() else "not found") + "; pass a local Hugging Face "
                        "model directory (config.json, *.safetensors, tokenizer.json)")
    if not config.is_file():
        raise UserError(f"'{hf_dir}' has no config.json; pass a Hugging Face model directory")
    try:
        hf = json.loads(config.read_text())
    except ValueError as e:
        raise UserError(f"{config} is not JSON ({e})") from None
    where = str(config)
    if not isinstance(hf, dict):
        raise UserError(f"{where} is not a JSON object of settings; pass a Hugging Face "
                        "model directory")
    arch = config_json.architecture(hf, where)
    try:
        table = config_json.model_table(hf, where, seq_len)
    except KeyError as e:
        raise UserError(f"{where} lacks {e.args[0]}, which {arch} needs") from None
    exp = _experiment(hf, table, run_dir.name or "imported", where)
    tensors = Tensors(hf_dir)
    prefix = layout.gpt2_prefix(tensors.names())
    held = layout.layers_held(tensors.names(), arch, prefix)
    if exp.model.layers > held:  # before a model of that depth is laid out
        raise UserError(f"{where} gives {exp.model.layers} layers but the weights hold "
                        f"{held}; the weights and config.json disagree")
    expected = abstract_model(exp.model).shapes()
    total = sum(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(expected))
    tmp = _fresh_dir(run_dir, "--run-dir")
    try:
        params: dict = {}
        with Ticker("plait import: converting", total, size_text) as ticker:
            for path, value in _laid_out(exp.model, arch, tensors, prefix, hf_dir):
                want = expected
                for k in path:
                    want = want[k]
                if tuple(value.shape) != tuple(want.shape):
                    raise UserError(f"{hf_dir}: tensor '{tensors.last}' gives "
                                    f"{'/'.join(path)} the shape {tuple(value.shape)}, but "
                                    f"config.json's sizes make it {tuple(want.shape)}; the "
                                    "weights and config.json disagree")
                _set(params, path, jax.device_put(value))  # the host copy goes with `value`
                del value
                ticker.advance(math.prod(want.shape) * want.dtype.itemsize)
            ticker.phase("plait import: writing the step-0 checkpoint")
            _write_import(tmp, exp, hf_dir, arch, params)
        del params
        _publish(tmp, run_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"architecture": arch, "model": table, "dtypes": sorted(tensors.dtypes()),
            "tokenizer": (run_dir / TOKENIZER).is_file(), "experiment": exp,
            "trained_positions": hf.get("max_position_embeddings")}


def _write_import(tmp: Path, exp, hf_dir: Path, arch: str, params: dict) -> None:
    """The imported run's files into `tmp`: config.toml, the tokenizer, checkpoint 0."""
    import jax

    from plait.checkpoint import Checkpoints

    (tmp / "config.toml").write_text(exp.to_toml())
    for name in TOKENIZER_FILES:  # the tokenizer and its chat template, if any
        if (hf_dir / name).is_file():
            shutil.copyfile(hf_dir / name, tmp / name)
    meta = {"step": 0, "params_only": True, "imported_from": str(hf_dir.absolute()),
            "architecture": arch, "mesh": "-",
            "data": {"source": exp.data.source, "seed": exp.seed, "next_step": 0,
                     "samples_seen": 0},
            "config": json.loads(exp.model_dump_json())}
    # The host holds the model once while orbax writes it: a cap just above the
    # largest array keeps orbax to one array in flight, and chunks written one file
    # each (not into OCDBT, which keeps a whole array's encoded chunks until it is
    # committed) keep TensorStore's encoding to a few chunks of it at a time
    # (docs/benchmarks.md, import memory).
    largest = max(a.nbytes for a in jax.tree.leaves(params))
    ckpts = Checkpoints(tmp / "checkpoints", keep=exp.checkpoint.keep, async_save=False,
                        save_concurrent_gb=(largest + 2**20) / 1e9, file_per_chunk=True)
    ckpts.save(0, {"params": params}, meta, chunk_bytes=IMPORT_CHUNK_BYTES)
    ckpts.wait()
    ckpts.close()


def export_run(run_dir: str | Path, out: str | Path, step: int | None = None,
               dtype: str = "float32") -> dict[str, Any]:
    """Write OUT (config.json, model.safetensors or its 5 GB shards and their index,
    tokenizer.json) from a decoder run's checkpoint (the newest, or `step`)."""
    import jax
    import ml_dtypes

    from plait.sample import load

    if dtype not in ("float32", "bfloat16"):
        raise UserError(f"--dtype {dtype}: export writes float32 or bfloat16")
    run_dir, out = Path(run_dir), Path(out)
    _check_fresh(out, "--out")  # before the checkpoint is read
    exp, _, params, at = load(run_dir, step, "plait export converts")
    cfg = exp.model
    config = config_json.hf_config(cfg, dtype)  # refuses layouts no architecture holds
    tmp = _fresh_dir(out, "--out")
    np_dtype = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    try:
        host = jax.tree.map(np.asarray, params)
        del params
        total = sum(a.size for a in jax.tree.leaves(host)) * np.dtype(np_dtype).itemsize
        shards = _Shards(tmp)
        with Ticker("plait export: converting and writing", total, size_text) as ticker:
            for name, a in layout.to_hf(cfg, host):
                converted = np.ascontiguousarray(a.astype(np_dtype))
                del a
                shards.add(name, converted)
                ticker.advance(converted.nbytes)
            shards.close()
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name in TOKENIZER_FILES:
            if (run_dir / name).is_file():
                shutil.copyfile(run_dir / name, tmp / name)
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"step": at, "architecture": config["architectures"][0],
            "tensors": len(shards.weight_map), "bytes": shards.total, "files": shards.files}


class _Shards:
    """Tensors written into safetensors files of at most SHARD_BYTES each as they come
    (a file is written when the next tensor would overflow it, so the host holds one
    file's worth besides the parameters): one file is model.safetensors, more are
    model-0000k-of-0000n.safetensors with their index, as transformers writes them."""

    def __init__(self, out: Path):
        self.out, self.pending, self.size = out, {}, 0
        self.weight_map: dict[str, str] = {}
        self.written: list[Path] = []
        self.files: list[str] = []
        self.total = 0

    def add(self, name: str, tensor: np.ndarray) -> None:
        if self.pending and self.size + tensor.nbytes > SHARD_BYTES:
            self._write()
        self.pending[name] = tensor
        self.size += tensor.nbytes
        self.total += tensor.nbytes

    def _write(self) -> None:
        from safetensors.numpy import save_file

        path = self.out / f".shard-{len(self.written) + 1:05d}.safetensors"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.weight_map.update(dict.fromkeys(self.pending, path.name))
        self.written.append(path)
        self.pending, self.size = {}, 0

    def close(self) -> None:
        """The last file written, all named, the index beside them if there are more."""
        if self.pending or not self.written:
            self._write()
        n = len(self.written)
        names = {p.name: SINGLE if n == 1 else f"model-{k:05d}-of-{n:05d}.safetensors"
                 for k, p in enumerate(self.written, 1)}
        for p in self.written:
            p.rename(self.out / names[p.name])
        self.weight_map = {t: names[f] for t, f in self.weight_map.items()}
        self.files = sorted(set(names.values()))
        if n > 1:
            index = {"metadata": {"total_size": self.total}, "weight_map": self.weight_map}
            (self.out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
