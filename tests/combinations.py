"""Random combinations of axes, schedules and model options, trained against one device.

    python tests/combinations.py [--runs N] [--seed S]
                                 [--mode fresh|resume|data|dlrm|sync|eval] [--out FILE.jsonl]
                                 [--processes P]

The suite holds losses equal across meshes for the combinations someone wrote down;
this draws others. Each run draws a model (GPT-2's layout; a Llama with 1, 2 or 4
key/value heads for 4 query heads, q/k norms, tied or not; a mixture of experts,
capacity or dropless, top-1 or 2, on every layer or every other, a shared expert or
not, grouped by tiles or ragged_dot; sometimes a head_dim apart from d_model / heads,
biases, the other MLP, a vocabulary of 250 padded to another multiple, another
optimizer, schedule or clipping, bfloat16 compute), a mesh of 8 simulated CPU devices
(pipeline; no tensor mode, 1-D, 2-D, 2.5-D or 3-D; context with ring or all-gather
attention; expert; fsdp; data), a remat policy, stacked layers or not, loss pieces, and
microbatches or a pipeline schedule (virtual stages drawn for interleaved), and runs
`plait train` for 4 steps. Each step's loss must equal that of the same model on one
device (rtol 1e-4; 2e-2 in bfloat16); a refusal must be one line with exit status 2.
Modes: `fresh` as above; `resume` trains 2 steps on one draw and resumes to 4 on
another (the checkpoint moved between meshes and layouts); `data` trains on a
fine-tuning token file (loss mask, document index) with a random `data.row_start` and
`data.document_mask`; `dlrm` draws table placements, optimizers and features of
experiments/dlrm-tiny.toml over data x fsdp; `sync` draws EASGD or DiLoCo replicas over
data, each split over tensor, context or fsdp, against the same replicas on data alone;
`eval` trains 2 steps on one device and scores the checkpoint with `plait eval` on the
fine-tuning file, on one device and on the drawn mesh. With `--processes 2` each drawn
mesh runs under `plait launch --processes 2`: two processes joined by jax.distributed
(gloo) on localhost.

Every run is one line of JSON in --out; the end prints the failures. Not part of the
suite (minutes per dozen runs on 2 cores); run it after changing a parallel mode.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from helpers import ROOT, subprocess_env
from helpers import losses as logged_losses

RTOL = 1e-4
BF16_RTOL = 2e-2  # bfloat16 compute: the layouts' reduction orders round differently


def _model(rng: random.Random, mode: str) -> tuple[str, dict]:
    kinds = ["gpt", "llama"] if mode == "sync" else ["gpt", "llama", "moe"]
    kind = rng.choice(kinds)
    s: dict = {"train.global_batch": 16, "optimizer.warmup_steps": 0,
               "optimizer.decay_steps": 4, "model.layers": rng.choice([2, 4]),
               "model.d_model": 64, "model.heads": 4, "model.d_ff": 128,
               "model.vocab": rng.choice([256, 256, 250]), "model.seq_len": 64,
               "model.kind": '"gpt"' if kind == "gpt" else '"llama"'}
    if rng.random() < 0.3:  # the less travelled model options
        s.update({"model.head_dim": rng.choice([8, 16, 32]),
                  "model.qkv_bias": rng.choice(["false", "true"]),
                  "model.bias": rng.choice(["false", "true"]),
                  "model.mlp": rng.choice(['"gelu"', '"swiglu"']),
                  "model.vocab_multiple": rng.choice([1, 8, 128])})
    if rng.random() < 0.3:
        s.update({"optimizer.name": rng.choice(['"adamw"', '"sgd"', '"adagrad"']),
                  "optimizer.schedule": rng.choice(['"cosine"', '"linear"', '"wsd"',
                                                    '"constant"']),
                  "optimizer.grad_clip": rng.choice([0.0, 0.05, 1.0])})
    if rng.random() < 0.2:  # rounding differs between layouts: compared at BF16_RTOL
        s["precision.compute"] = '"bfloat16"'
    if kind != "gpt":
        s.update({"model.kv_heads": rng.choice([1, 2, 4]), "model.rope_theta": 10000.0,
                  "model.qk_norm": rng.choice(["false", "true"]),
                  "model.tie_embeddings": rng.choice(["false", "true"])})
    if kind == "moe":
        s.update({"model.moe.experts": 4, "model.moe.top_k": rng.choice([1, 2]),
                  "model.moe.z_weight": 0.001,
                  "model.moe.capacity_factor": rng.choice([0.0, 2.0]),
                  "model.moe.shared_d_ff": (shared := rng.choice([0, 32])),
                  "model.moe.every": rng.choice([1, 1, 2]),
                  "model.moe.d_ff": rng.choice([32, 64]),
                  "model.moe.shared_gate": rng.choice(["false", "true"] if shared else
                                                      ["false"]),
                  "model.moe.renormalize": rng.choice(["false", "true"]),
                  "model.moe.grouped": rng.choice(['"auto"', '"tiles"', '"ragged_dot"'])})
    if mode == "data":
        s.update({"data.source": '"tokens"',
                  "data.row_start": rng.choice(['"anywhere"', '"document"', '"auto"']),
                  "data.document_mask": rng.choice(["false", "true"])})
    if mode == "sync":
        s.update({"sync.method": rng.choice(['"easgd"', '"diloco"']),
                  "sync.period": rng.choice([1, 2, 3])})
    return kind, s


def _mesh(rng: random.Random, kind: str, layers: int) -> dict[str, int]:
    axes: dict[str, int] = {}
    left = 8
    p = rng.choice([1, 1, 2, 4] if layers == 4 else [1, 1, 2])
    if p > 1:
        axes["pipeline"], left = p, left // p
    tensor = rng.choice(["none", "1d", "1d", "2d", "3d", "2.5d"])
    if tensor == "1d" and left >= 2:
        axes["tensor"] = rng.choice([x for x in (2, 4) if left % x == 0])
        left //= axes["tensor"]
    elif tensor == "2d" and left >= 4:
        axes.update(tensor_row=2, tensor_col=2)
        left //= 4
    elif tensor in ("3d", "2.5d") and left >= 8:
        axes.update({"3d": dict(tensor_x=2, tensor_y=2, tensor_z=2),
                     "2.5d": dict(tensor_depth=2, tensor_row=2, tensor_col=2)}[tensor])
        left //= 8
    for axis, chance, sizes in (("context", 0.3, (2,)), ("expert", 0.6, (2, 4)),
                                ("fsdp", 0.5, (2, 4, 8))):
        if (axis != "expert" or kind == "moe") and left >= 2 and rng.random() < chance:
            axes[axis] = rng.choice([x for x in sizes if left % x == 0])
            left //= axes[axis]
    if left > 1:
        axes["data"] = left
    return axes or {"data": 1}


def _options(rng: random.Random, axes: dict[str, int]) -> tuple[dict, int]:
    o: dict = {"model.remat": rng.choice(['"none"', '"full"', '"save_dots"',
                                          '"save_attention"', '"save_qkv"']),
               "model.scan_layers": rng.choice(["false", "true"]),
               "model.loss_chunks": rng.choice([1, 2, 4])}
    if "pipeline" in axes:
        o["pipeline.schedule"] = rng.choice(['"gpipe"', '"1f1b"', '"interleaved"',
                                             '"chimera"', '"zb-h1"'])
        o["pipeline.microbatches"] = rng.choice([2, 4])
        o["pipeline.recompute"] = rng.choice(["false", "true"])
        if o["pipeline.schedule"] == '"interleaved"' and rng.random() < 0.5:
            o["pipeline.virtual_stages"] = rng.choice([1, 2, 4])
        micro = o["pipeline.microbatches"]
    else:
        micro = o["train.microbatches"] = rng.choice([1, 1, 2])
    if "context" in axes:
        o["context.attention"] = rng.choice(['"ring"', '"allgather"'])
    return o, micro


def _sync_mesh(rng: random.Random, kind: str) -> tuple[dict[str, int], int]:
    """Replicas over data and, inside each, what a replica may be split over."""
    replicas = rng.choice([2, 4])
    axes, left = {"data": replicas}, 8 // replicas
    for axis, chance in (("tensor", 0.5), ("context", 0.3), ("fsdp", 0.5)):
        if left >= 2 and rng.random() < chance:
            axes[axis] = rng.choice([x for x in (2, 4) if left % x == 0])
            left //= axes[axis]
    axes["data"] *= left  # what is left over is more replicas (the reference has as many)
    return axes, axes["data"]


def _dlrm(rng: random.Random) -> tuple[dict, dict, dict[str, int]]:
    s = {"embedding.optimizer": rng.choice(['"sgd"', '"adagrad"', '"adam"']),
         "optimizer.name": rng.choice(['"adagrad"', '"sgd"', '"adamw"']),
         "model.pooling": rng.choice(['"sum"', '"mean"']),
         "model.cross_layers": rng.choice([0, 0, 2]),
         "data.ids_fixed": rng.choice(["true", "false"]),
         "data.popularity": rng.choice(['"uniform"', '"powerlaw"']), "data.eval_batches": 0}
    kinds = ["table", "row", "column", "replicated"]
    o = {"embedding.sharding": rng.choice(['"auto"'] + [f'"{k}"' for k in kinds])}
    if rng.random() < 0.4:
        o["embedding.overrides"] = "{" + ", ".join(
            f'"{i}" = "{rng.choice(kinds)}"' for i in range(4) if rng.random() < 0.5) + "}"
    fsdp = rng.choice([1, 2, 4, 8])
    return s, o, {k: v for k, v in (("fsdp", fsdp), ("data", 8 // fsdp)) if v > 1} or {"data": 1}


def _spec(axes: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in axes.items())


class Runner:
    def __init__(self, work: Path, experiment: Path, data: Path | None, processes: int = 1):
        self.work, self.experiment, self.data = work, experiment, data
        self.processes = processes
        self.refs: dict[str, list[float]] = {}

    def _run(self, args: list[str], drawn: bool) -> subprocess.CompletedProcess:
        """`plait ARGS` in one process, or (a drawn mesh, --processes P) under
        `plait launch --processes P`: P processes joined by jax.distributed on localhost,
        whose failures it reports in one line."""
        launch = (["launch", "--processes", str(self.processes), "--"]
                  if drawn and self.processes > 1 else [])
        return subprocess.run([sys.executable, "-m", "plait", *launch, *args],
                              capture_output=True, text=True, env=subprocess_env(),
                              timeout=900)

    def train(self, sets: dict, axes: dict[str, int], run_dir: Path, devices: int = 8,
              steps: int = 4, checkpoints: bool = False, drawn: bool = True):
        cmd = ["train", str(self.experiment), "--run-dir", str(run_dir), "--steps",
               str(steps), "--mesh", _spec(axes), "--devices", str(devices),
               "--set", "log.every_steps=1", "--set", "log.tensorboard=false",
               "--set", 'log.console="line"', "--set", "checkpoint.async_save=false",
               "--set", f"checkpoint.enabled={'true' if checkpoints else 'false'}"]
        if self.data is not None and "data.source" in sets:
            cmd += ["--set", f'data.path="{self.data}"']
        for k, v in sets.items():
            cmd += ["--set", f"{k}={v}"]
        out = self._run(cmd, drawn)
        return out, (logged_losses(run_dir).tolist() if out.returncode == 0 else None)

    def score(self, run_dir: Path, axes: dict[str, int], devices: int = 8,
              drawn: bool = True):
        """`plait eval` of run_dir's newest checkpoint on the token file, over `axes`."""
        got = run_dir / f"eval-{devices}.json"
        cmd = ["eval", str(run_dir), "--data", str(self.data), "--mesh", _spec(axes),
               "--devices", str(devices), "--max-batches", "2", "--json", str(got)]
        out = self._run(cmd, drawn)
        return out, ([json.loads(got.read_text())["loss"]] if out.returncode == 0 else None)

    def reference(self, sets: dict, replicas: int = 1):
        """The same model on one device, or on `replicas` devices of data alone."""
        key = json.dumps([sets, replicas], sort_keys=True)
        if key not in self.refs:
            run_dir = self.work / f"ref-{hashlib.md5(key.encode()).hexdigest()[:10]}"
            out, losses = self.train(sets, {"data": replicas}, run_dir, devices=replicas,
                                     drawn=False)
            if losses is None:
                return out
            self.refs[key] = losses
        return self.refs[key]


def _judge(rec: dict, out, losses, ref) -> dict:
    if losses is not None:
        rec["rel"] = max(abs(a - b) / abs(b) for a, b in zip(losses, ref, strict=False))
        rtol = BF16_RTOL if rec["sets"].get("precision.compute") == '"bfloat16"' else RTOL
        rec["bad"] = rec["rel"] > rtol or len(losses) != len(ref)
        if rec["bad"]:
            rec["losses"], rec["ref"] = losses, ref
        return rec
    lines = [x for x in out.stderr.strip().splitlines() if x.strip()]
    one_line = out.returncode == 2 and len(lines) == 1
    rec["error"] = lines[-1] if one_line else out.stderr.strip()[-1500:]
    rec["bad"] = not one_line
    return rec


def one_run(rng: random.Random, mode: str, runner: Runner, n: int) -> dict | None:
    run_dir = runner.work / f"run-{n}"
    if mode == "dlrm":
        s, o, axes = _dlrm(rng)
        ref = runner.reference(s)
        rec = {"n": n, "mesh": axes, "sets": {**s, **o}}
        if not isinstance(ref, list):
            return _judge({**rec, "in": "reference"}, ref, None, None)
        out, losses = runner.train({**s, **o}, axes, run_dir)
        return _judge(rec, out, losses, ref)
    kind, s = _model(rng, mode)
    replicas = 1
    if mode == "sync":
        axes, replicas = _sync_mesh(rng, kind)
    else:
        axes = _mesh(rng, kind, s["model.layers"])
    o, micro = _options(rng, axes)
    # a router's balancing loss is taken per microbatch: the reference splits as the run
    ref_sets = {**s, "train.microbatches": micro} if kind == "moe" else s
    rec = {"n": n, "kind": kind, "mesh": axes, "sets": {**s, **o}}
    if mode == "resume":
        axes2 = _mesh(rng, kind, s["model.layers"])
        o2, micro2 = _options(rng, axes2)
        if kind == "moe" and micro2 != micro:
            return None
        rec.update(then_mesh=axes2, then_sets=o2)
    if mode == "eval":  # trained on one device, scored there and on the drawn mesh
        out, _ = runner.train({**s, **o}, {"data": 1}, run_dir, devices=1, steps=2,
                              checkpoints=True, drawn=False)
        if out.returncode == 0:
            out, ref = runner.score(run_dir, {"data": 1}, devices=1, drawn=False)
        if out.returncode != 0:
            return _judge({**rec, "in": "reference"}, out, None, None)
        out, losses = runner.score(run_dir, axes)
        return _judge(rec, out, losses, ref)
    ref = runner.reference(ref_sets, replicas)
    if not isinstance(ref, list):  # refused (or failed) on the reference's own mesh
        return _judge({**rec, "in": "reference"}, ref, None, None)
    if mode == "resume":
        out, losses = runner.train({**s, **o}, axes, run_dir, steps=2, checkpoints=True)
        if out.returncode == 0:
            out, losses = runner.train({**s, **o2}, axes2, run_dir, checkpoints=True)
    else:
        out, losses = runner.train({**s, **o}, axes, run_dir)
    return _judge(rec, out, losses, ref)


def _fine_tuning_file(work: Path) -> Path:
    """A token file of 400 prompt/response records with its loss mask and index."""
    rng = random.Random(0)
    words = ("the", "mesh", "of", "devices", "trains", "one", "model", "with", "every",
             "kind", "parallelism", "data", "tensor", "pipeline", "context", "expert")
    docs = work / "docs.jsonl"
    with docs.open("w") as f:
        for i in range(400):
            prompt = " ".join(rng.choice(words) for _ in range(rng.randint(2, 12)))
            text = " ".join(rng.choice(words) for _ in range(rng.randint(3, 40)))
            f.write(json.dumps({"prompt": f"Q{i}: {prompt}?", "text": text}) + "\n")
    out = work / "sft.bin"
    subprocess.run([sys.executable, "-m", "plait", "data", str(docs), str(out),
                    "--prompt-field", "prompt", "--field", "text"], check=True,
                   capture_output=True, env=subprocess_env())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mode", default="fresh",
                    choices=["fresh", "resume", "data", "dlrm", "sync", "eval"])
    ap.add_argument("--out", type=Path, default=Path("combinations.jsonl"))
    ap.add_argument("--processes", type=int, default=1,
                    help="run each drawn mesh as this many processes joined by "
                         "jax.distributed on localhost (the references run in one)")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="plait-combinations-") as tmp:
        work = Path(tmp)
        data = _fine_tuning_file(work) if args.mode in ("data", "eval") else None
        name = "dlrm-tiny.toml" if args.mode == "dlrm" else "quickstart.toml"
        runner = Runner(work, ROOT / "experiments" / name, data, args.processes)
        failures, n, t0 = [], 0, time.time()
        with args.out.open("w") as f:
            while n < args.runs:
                rec = one_run(rng, args.mode, runner, n + 1)
                if rec is None:
                    continue
                n += 1
                f.write(json.dumps(rec) + "\n")
                f.flush()
                verdict = ("FAILED" if rec["bad"] else
                           f"rel {rec['rel']:.1e}" if "rel" in rec else "refused")
                meshes = " -> ".join(_spec(rec[m]) for m in ("mesh", "then_mesh") if m in rec)
                print(f"combinations: {n}/{args.runs} ({time.time() - t0:.0f}s) {verdict}: "
                      f"{meshes}", file=sys.stderr, flush=True)
                if rec["bad"]:
                    failures.append(rec)
                subprocess.run(["rm", "-rf", str(work / f"run-{n}")])
    for rec in failures:
        print(json.dumps(rec))
    print(f"combinations: {n} runs, {len(failures)} failed ({args.out})")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
