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

import math
from collections.abc import Iterable, Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from plait.config import MAX_SEED
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
    """(params, prompt [P], key) -> `n` new token ids (P + n <= the model's seq_len). The
    prompt is padded to a power of two (at least 16, at most seq_len), so prompts of
    nearby lengths (a conversation's turns) share one compiled program: the padding's
    cache entries lie past the prompt, where each step's mask does not look and its own
    token overwrites them. A mixture of experts with a capacity is not padded (the
    padding would change a sequence's capacity)."""
    cfg = mdef.cfg
    heads, head_dim = cfg.n_kv_heads, cfg.head_size  # the cache holds the key/value heads
    exact = cfg.moe is not None and cfg.moe.capacity_factor > 0

    def generate(params: dict, prompt: jax.Array, length: jax.Array, key: jax.Array
                 ) -> jax.Array:
        model = mdef.module(params, dtype)
        empty = jnp.zeros((1, cfg.seq_len, heads, head_dim), dtype or jnp.float32)
        caches = [(empty, empty) for _ in range(cfg.layers)]
        logits, caches = model.decode(prompt[None], caches, jnp.int32(0))

        def step(carry, i):
            caches, last = carry
            token = choose(last[: cfg.vocab], jax.random.fold_in(key, i), temperature, top_k)
            logits, caches = model.decode(token[None, None], caches, length + i)
            return (caches, logits[0, -1]), token

        first = jax.lax.dynamic_index_in_dim(logits[0], length - 1, keepdims=False)
        return jax.lax.scan(step, (caches, first), jnp.arange(n, dtype=jnp.int32))[1]

    compiled = jax.jit(generate)

    def run(params: dict, prompt: jax.Array, key: jax.Array) -> jax.Array:
        P = prompt.shape[0]
        width = P if exact else min(max(16, 1 << (P - 1).bit_length()), cfg.seq_len)
        padded = jnp.zeros((width,), jnp.int32).at[:P].set(jnp.asarray(prompt, jnp.int32))
        return compiled(params, padded, jnp.int32(P), key)

    return run


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


def load(run_dir: Path, step: int | None, does: str = "plait sample generates text from"):
    """(the run's experiment, the per-layer model, its parameters on one device, step);
    `does`: what the command does with such runs, for the line refusing another kind."""
    from plait import mesh as mesh_lib
    from plait.checkpoint import Checkpoints
    from plait.tasks.gpt import GPTTask

    exp, ckpt_dir = decoder_run(run_dir, does)
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


def _check(tokens: int | None, temperature: float, top_k: int, chat: bool, system: str | None,
           seed: int) -> None:
    if tokens is not None and tokens < 1:
        raise UserError(f"--tokens must be at least 1, got {tokens}")
    if not 0 <= seed <= MAX_SEED:
        raise UserError(f"--seed must be between 0 and 2**63 - 1, got {seed}")
    if not math.isfinite(temperature) or temperature < 0:
        raise UserError(f"--temperature must be a number >= 0 (0: always the most likely "
                        f"token), got {temperature}")
    if top_k < 0:
        raise UserError(f"--top-k must be >= 0 (0: no cut), got {top_k}")
    if system is not None and not chat:
        raise UserError("--system is a chat's first message; pass --chat with it")
    _utf8(system, "--system")


def _utf8(text: str | None, flag: str) -> None:
    """One line for text that is not UTF-8 (Python keeps a command line's stray bytes as
    lone surrogates, which no tokenizer encodes)."""
    try:
        (text or "").encode("utf-8")
    except UnicodeEncodeError as e:
        raise UserError(f"{flag} is not UTF-8 text (a byte that is not UTF-8 at character "
                        f"{e.start}); pass it in UTF-8") from None


DEFAULT_TOKENS = 100  # what plait sample generates unless --tokens says


class _Model:
    """A run's checkpoint loaded once for sampling: the model, its tokenizer, and with
    `chat` its chat template, end-of-text token and the conversation's opening (the
    system message, if any)."""

    def __init__(self, run_dir: Path, step: int | None, tokens: int | None, temperature: float,
                 top_k: int, chat: bool, system: str | None = None):
        from plait.data.tokenizer import for_run
        from plait.train.step import compute_dtype

        self.exp, mdef, self.params, self.at = load(run_dir, step)
        # --tokens left out: DEFAULT_TOKENS, or half the context of a model whose context is
        # shorter (the quickstart's 64: the default of 100 had refused every prompt).
        self.said = "--tokens" if tokens is not None else "the default --tokens"
        if tokens is None:
            tokens = min(DEFAULT_TOKENS, max(1, self.exp.model.seq_len // 2))
        self.codec, self.tokens, self.template, self.stop = for_run(run_dir), tokens, None, None
        if chat:
            from plait.data import chat as chats
            from plait.data.tokenizer import RUN_FILE, HFTokenizer

            if not isinstance(self.codec, HFTokenizer):
                raise UserError(f"--chat needs the run's tokenizer and chat template; "
                                f"'{run_dir}' has no tokenizer.json (byte-level)")
            self.template = chats.find(run_dir / RUN_FILE)
            eos = self.template.eos
            self.stop = self.codec.tok.token_to_id(eos) if eos else None
        self.opening = [{"role": "system", "content": system}] if system is not None else []
        self.generate = generator(mdef, compute_dtype(self.exp), tokens, temperature, top_k)

    def conversation(self, turns: list[dict]) -> list[int]:
        """The ids of the opening and `turns` through the chat template, the assistant's
        turn opened."""
        text = self.template.render(self.opening + turns, add_generation_prompt=True)
        return self.codec.encode_lines([text], special=False)[0]  # the template placed them

    def fits(self, ids: list[int]) -> bool:
        return len(ids) + self.tokens <= self.exp.model.seq_len

    def answer(self, ids: list[int], key: jax.Array) -> tuple[str, dict]:
        """The text generated after prompt ids (cut at the chat's end-of-text)."""
        if not ids:
            raise UserError("the prompt is empty; give --prompt some text")
        room = self.exp.model.seq_len
        if len(ids) >= room:
            raise UserError(f"the prompt is {len(ids)} tokens, model.seq_len = {room} with "
                            f"room for one generated: shorten it to at most {room - 1} tokens")
        if not self.fits(ids):
            raise UserError(f"the prompt ({len(ids)} tokens) plus {self.said} {self.tokens} is "
                            f"more than model.seq_len = {room}; ask for at most "
                            f"{room - len(ids)} tokens or shorten the prompt")
        if max(ids) >= self.exp.model.vocab:
            raise UserError(f"the prompt has token id {max(ids)} >= model.vocab = "
                            f"{self.exp.model.vocab} (tokenizer: {self.codec.name})")
        out = self.generate(self.params, jnp.asarray(ids, jnp.int32), key)
        new = [int(t) for t in np.asarray(out)]
        if self.stop is not None and self.stop in new:  # the assistant's turn is over
            new = new[:new.index(self.stop)]
        return self.codec.decode(new), {"step": self.at, "prompt_tokens": len(ids),
                                        "tokens": new, "tokenizer": self.codec.name}


def sample(run_dir: str | Path, prompt: str, tokens: int | None, temperature: float, top_k: int,
           seed: int, step: int | None, chat: bool = False, system: str | None = None
           ) -> tuple[str, dict]:
    """The generated text (after the prompt) and what made it. With `chat`, the prompt
    is a user's message (after `system`'s, if given) put through the run's chat template
    with the assistant's turn opened, and the answer ends at the template's end-of-text
    token."""
    _check(tokens, temperature, top_k, chat, system, seed)
    _utf8(prompt, "--prompt")
    m = _Model(Path(run_dir), step, tokens, temperature, top_k, chat, system)
    ids = (m.conversation([{"role": "user", "content": prompt}]) if chat
           else m.codec.encode(prompt))
    return m.answer(ids, jax.random.key(seed))


def converse(run_dir: str | Path, messages: Iterable[str], tokens: int | None,
             temperature: float, top_k: int, seed: int, step: int | None,
             system: str | None = None
             ) -> Iterator[tuple[str, dict]]:
    """A conversation: each of `messages` (a user's turn; blank ones skipped) answered in
    turn through the run's chat template, every earlier turn and answer before it (after
    `system`'s message). Turns that no longer fit model.seq_len with --tokens to spare
    are left out from the oldest (the system message stays); info["left_out"] counts
    them. The checkpoint is read once."""
    _check(tokens, temperature, top_k, True, system, seed)
    m = _Model(Path(run_dir), step, tokens, temperature, top_k, True, system)
    turns: list[dict] = []
    left_out = 0
    for i, message in enumerate(x for x in messages if x.strip()):
        _utf8(message, f"message {i + 1} on standard input")
        turns.append({"role": "user", "content": message.rstrip("\n")})
        ids = m.conversation(turns)
        while not m.fits(ids) and len(turns) > 1:  # the oldest exchange goes first
            turns, left_out = turns[2:], left_out + 2
            ids = m.conversation(turns)
        text, info = m.answer(ids, jax.random.fold_in(jax.random.key(seed), i))
        turns.append({"role": "assistant", "content": text})
        yield text, {**info, "left_out": left_out}
