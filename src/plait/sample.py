"""`plait sample RUN_DIR --prompt TEXT`: text from a GPT run's checkpoint, with a KV cache.

The checkpoint (the newest, or --step) is read without touching the run
directory, so a run may go on training beside it. The model runs on one
device with its layers one entry each (the checkpoint's own layout), in the
run's compute precision. One jitted program fills the cache from the prompt
and then generates every new token inside a `lax.scan`, each step attending
over the cache instead of recomputing the prefix. The prompt is encoded, and
the result decoded, with the tokenizer the run was trained with
(RUN_DIR/tokenizer.json), or as UTF-8 bytes.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from plait.errors import UserError


def choose(logits: jax.Array, key: jax.Array, temperature: float, top_k: int) -> jax.Array:
    """One token id from logits [vocab]: the most likely at temperature 0, else drawn from
    softmax(logits / temperature) over the top_k most likely (0: all)."""
    if temperature == 0.0:
        return jnp.argmax(logits).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if 0 < top_k < logits.shape[0]:
        kth = jax.lax.top_k(logits, top_k)[0][-1]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits).astype(jnp.int32)


def generator(mdef, dtype, n: int, temperature: float, top_k: int):
    """jit(params, prompt [P], key) -> `n` new token ids (P + n <= the model's seq_len)."""
    cfg = mdef.cfg
    heads, head_dim = cfg.n_kv_heads, cfg.head_size  # the cache holds the key/value heads

    def generate(params: dict, prompt: jax.Array, key: jax.Array) -> jax.Array:
        model = mdef.module(params, dtype)
        empty = jnp.zeros((1, cfg.seq_len, heads, head_dim), dtype or jnp.float32)
        caches = [(empty, empty) for _ in range(cfg.layers)]
        logits, caches = model.decode(prompt[None], caches, jnp.int32(0))
        P = prompt.shape[0]

        def step(carry, i):
            caches, last = carry
            token = choose(last[: cfg.vocab], jax.random.fold_in(key, i), temperature, top_k)
            logits, caches = model.decode(token[None, None], caches, P + i)
            return (caches, logits[0, -1]), token

        return jax.lax.scan(step, (caches, logits[0, -1]), jnp.arange(n, dtype=jnp.int32))[1]

    return jax.jit(generate)


def greedy_without_cache(mdef, params: dict, prompt: list[int], n: int, dtype=None) -> list[int]:
    """The reference decode: the whole sequence through the model for every new token
    (no cache); for tests."""
    forward = jax.jit(lambda p, t: mdef.apply(p, t, dtype))
    seq = list(prompt)
    width = len(prompt) + n  # one program: the model is causal, so padding after is inert
    for _ in range(n):
        padded = jnp.asarray([seq + [0] * (width - len(seq))], jnp.int32)
        logits = forward(params, padded)[0, len(seq) - 1, : mdef.cfg.vocab]
        seq.append(int(jnp.argmax(logits)))
    return seq[len(prompt):]


def decoder_run(run_dir: Path, does: str = "plait sample generates text from",
                sets: list[str] | None = None):
    """(the experiment, with `sets` applied as --set would; the checkpoint directory) of
    a language-model run that a reader (sample, export, eval) reads without touching;
    one line for anything else."""
    from plait.config_files import load_experiment
    from plait.kinds import is_decoder

    if not run_dir.is_dir():
        raise UserError(f"run directory '{run_dir}' not found; pass the --run-dir of a "
                        "plait train run")
    config = run_dir / "config.toml"
    if not config.is_file():
        raise UserError(f"'{run_dir}' has no config.toml; pass the directory of a plait "
                        "train run")
    exp = load_experiment(config, sets or [])
    if not is_decoder(exp.model):
        raise UserError(f"{does} language-model runs (gpt, llama); '{run_dir}' trained a "
                        f"{exp.model.kind} model")
    ckpt_dir = run_dir / "checkpoints"
    if not ckpt_dir.is_dir():
        raise UserError(f"'{run_dir}' has no checkpoints yet; train with checkpoints enabled "
                        "(checkpoint.every_steps) first")
    return exp, ckpt_dir


def load(run_dir: Path, step: int | None):
    """(the run's experiment, the per-layer model, its parameters on one device, step)."""
    from plait import mesh as mesh_lib
    from plait.checkpoint import Checkpoints
    from plait.tasks.gpt import GPTTask

    exp, ckpt_dir = decoder_run(run_dir)
    # The checkpoint's own layout: layers one entry each, no pipeline, one model, on
    # one device.
    one = exp.model_copy(update={
        "model": exp.model.model_copy(update={"scan_layers": False, "remat": "none"}),
        "train": exp.train.model_copy(update={"global_batch": 1, "microbatches": 1}),
        "sync": exp.sync.model_copy(update={"method": "allreduce"}), "mesh": None})
    n = mesh_lib.provision_devices(mesh_lib.MeshSpec({"data": 1}, "plait sample"))
    task = GPTTask(one, mesh_lib.build_mesh({"data": 1}, n))
    ckpts = Checkpoints(ckpt_dir, keep=max(1, exp.checkpoint.keep), async_save=False,
                        read_only=True)
    params, at, _ = read_params(task, ckpts, run_dir, step)
    return exp, task.model, params, at


def read_params(task, ckpts, run_dir: Path, step: int | None) -> tuple[dict, int, str | None]:
    """(the model's parameters, one entry per layer, as `task` lays them out; the step;
    a notice or None) of the checkpoint of `step` or the newest usable one
    (`DecoderCheckpoints.params_plan`)."""
    abstract, take, note = task.params_plan(ckpts.record(step))
    if step is not None:
        state, meta = ckpts.restore_step(abstract, step, flag="--step")
    else:
        restored = ckpts.restore_latest(abstract)
        if restored is None:
            raise UserError(f"'{run_dir}' has no checkpoints yet; train with checkpoints "
                            "enabled first")
        state, meta = restored
    return take(state), int(meta["step"]), note


def sample(run_dir: str | Path, prompt: str, tokens: int, temperature: float, top_k: int,
           seed: int, step: int | None, chat: bool = False, system: str | None = None
           ) -> tuple[str, dict]:
    """The generated text (after the prompt) and what made it. With `chat`, the prompt
    is a user's message (after `system`'s, if given) put through the run's chat template
    with the assistant's turn opened, and the answer ends at the template's end-of-text
    token."""
    from plait.data.tokenizer import for_run
    from plait.train.step import compute_dtype

    if tokens < 1:
        raise UserError(f"--tokens must be at least 1, got {tokens}")
    if temperature < 0:
        raise UserError(f"--temperature must be >= 0 (0: always the most likely token), "
                        f"got {temperature}")
    if top_k < 0:
        raise UserError(f"--top-k must be >= 0 (0: no cut), got {top_k}")
    if system is not None and not chat:
        raise UserError("--system is a chat's first message; pass --chat with it")
    run_dir = Path(run_dir)
    exp, mdef, params, at = load(run_dir, step)
    codec = for_run(run_dir)
    stop = None
    if chat:
        from plait.data import chat as chats
        from plait.data.tokenizer import RUN_FILE, HFTokenizer

        if not isinstance(codec, HFTokenizer):
            raise UserError(f"--chat needs the run's tokenizer and chat template; '{run_dir}' "
                            "has no tokenizer.json (byte-level)")
        template = chats.find(run_dir / RUN_FILE)
        messages = [{"role": "system", "content": system}] if system is not None else []
        text = template.render([*messages, {"role": "user", "content": prompt}],
                               add_generation_prompt=True)
        ids = codec.encode_lines([text], special=False)[0]  # the template placed them
        stop = codec.tok.token_to_id(template.eos) if template.eos else None
    else:
        ids = codec.encode(prompt)
    if not ids:
        raise UserError("the prompt is empty; give --prompt some text")
    room = exp.model.seq_len
    if len(ids) + tokens > room:
        raise UserError(f"the prompt ({len(ids)} tokens) plus --tokens {tokens} is more than "
                        f"model.seq_len = {room}; ask for at most {max(room - len(ids), 0)} "
                        "tokens or shorten the prompt")
    if max(ids) >= exp.model.vocab:
        raise UserError(f"the prompt has token id {max(ids)} >= model.vocab = "
                        f"{exp.model.vocab} (tokenizer: {codec.name})")
    generate = generator(mdef, compute_dtype(exp), tokens, temperature, top_k)
    out = generate(params, jnp.asarray(ids, jnp.int32), jax.random.key(seed))
    new = [int(t) for t in np.asarray(out)]
    if stop is not None and stop in new:  # the assistant's turn is over
        new = new[:new.index(stop)]
    return codec.decode(new), {"step": at, "prompt_tokens": len(ids), "tokens": new,
                               "tokenizer": codec.name}
