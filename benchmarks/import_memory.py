"""Host memory of `plait import` against the size of the model it reads.

Writes a random Llama-3.2-1B-shaped Hugging Face directory (config.json and
sharded bfloat16 safetensors with their index, made here, nothing downloaded),
then runs `plait import` on it in a fresh process and reads that process's peak
resident memory (ru_maxrss of the child). The target: at most 1.3 x N + 300 MB
for a safetensors model of N bytes.

    python benchmarks/import_memory.py [--layers 16] [--dtype bfloat16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np
from report import report, run_script  # benchmarks/ is the script's directory
from safetensors.numpy import save_file

# meta-llama/Llama-3.2-1B's shape
SHAPE = {"hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 8,
         "intermediate_size": 8192, "vocab_size": 128256, "head_dim": 64}


def make_model(out: Path, layers: int, dtype: str, per_shard: int = 4) -> int:
    """A random model directory; returns the bytes of its tensors."""
    d, h, kv, f, V, hd = (SHAPE[k] for k in ("hidden_size", "num_attention_heads",
                                             "num_key_value_heads", "intermediate_size",
                                             "vocab_size", "head_dim"))
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    rng = np.random.default_rng(0)

    def rand(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np_dtype)

    out.mkdir(parents=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "num_hidden_layers": layers, "max_position_embeddings": 131072,
              "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True,
              "hidden_act": "silu", "torch_dtype": dtype,
              "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192}, **SHAPE}
    (out / "config.json").write_text(json.dumps(config))
    weight_map, total = {}, 0
    groups = [list(range(i, min(i + per_shard, layers))) for i in range(0, layers, per_shard)]
    for n, group in enumerate(groups):
        shard: dict[str, np.ndarray] = {}
        if n == 0:
            shard["model.embed_tokens.weight"] = rand(V, d)
        for i in group:
            b = f"model.layers.{i}."
            shard.update({
                f"{b}self_attn.q_proj.weight": rand(h * hd, d),
                f"{b}self_attn.k_proj.weight": rand(kv * hd, d),
                f"{b}self_attn.v_proj.weight": rand(kv * hd, d),
                f"{b}self_attn.o_proj.weight": rand(d, h * hd),
                f"{b}mlp.gate_proj.weight": rand(f, d), f"{b}mlp.up_proj.weight": rand(f, d),
                f"{b}mlp.down_proj.weight": rand(d, f),
                f"{b}input_layernorm.weight": np.ones(d, np_dtype),
                f"{b}post_attention_layernorm.weight": np.ones(d, np_dtype)})
        if n == len(groups) - 1:
            shard["model.norm.weight"] = np.ones(d, np_dtype)
        name = f"model-{n + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        total += sum(a.nbytes for a in shard.values())
        weight_map.update({k: name for k in shard})
        del shard
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="plait-import-mem-"))
    try:
        model = root / "hf"
        n_bytes = make_model(model, args.layers, args.dtype)
        files = sum(p.stat().st_size for p in model.glob("*.safetensors"))
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "plait", "import", str(model),
                               "--run-dir", str(root / "run")], capture_output=True, text=True)
        wall = time.monotonic() - t0
        if proc.returncode:
            sys.exit(f"plait import failed:\n{proc.stderr}")
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
        bound = 1.3 * files + 300 * 2**20
        out = {"date": time.strftime("%Y-%m-%d"), "layers": args.layers, "dtype": args.dtype,
               "tensor_bytes": n_bytes, "safetensors_bytes": files, "peak_rss_bytes": peak,
               "bound_bytes": bound, "peak_over_bound": peak / bound,
               "peak_over_model": peak / files, "wall_s": wall,
               "checkpoint_bytes": sum(p.stat().st_size for p in (root / "run").rglob("*")
                                       if p.is_file())}
        report(out, args.json)
        print(f"plait import of a {files / 2**30:.2f} GiB {args.dtype} model: peak "
              f"{peak / 2**30:.2f} GiB = {peak / files:.2f} x the model; bound 1.3 x N + 300 MB "
              f"= {bound / 2**30:.2f} GiB ({'met' if peak <= bound else 'NOT met'}); "
              f"{wall:.1f} s")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    run_script(main)
