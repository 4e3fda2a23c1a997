"""Where the language-model task's batches come from: synthetic streams or token files
(with their loss mask, document index and tokenizer), and the held-out loss logged as
the run goes."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from plait.config import Experiment
from plait.tasks.base import Evaluator, Source


def token_file(exp: Experiment, path: str, key: str, documents: bool):
    """A token file read as the experiment's data section says (dtype, where rows start,
    document starts flagged for a document mask)."""
    from plait.data.tokens import TokenFile

    m, d = exp.model, exp.data
    return TokenFile(path, d.dtype, m.seq_len, exp.seed, m.vocab, key=key,
                     row_start=d.row_start, document_mask=documents)


def source(exp: Experiment, documents: bool) -> Source:
    m, d = exp.model, exp.data
    if d.source == "synthetic":
        from plait.data.synthetic import SyntheticTokens

        return SyntheticTokens(m.vocab, m.seq_len, exp.seed, d.successors)
    return token_file(exp, d.path or "", "data.path", documents)


def run_files(source: Source, run_dir: Path) -> dict[str, Path]:
    """The files a run keeps beside its checkpoints: the data's tokenizer. A token file
    tokenized otherwise than the run's checkpoints were (its tokenizer.json, or bytes: a
    run with checkpoints and none) is refused: it trained the model on another text's ids,
    and replaced the tokenizer an imported run came with (plait eval refuses such a file)."""
    from plait.data.tokenizer import RUN_FILE, check_tokenized_as_run
    from plait.data.tokens import TokenFile

    if not isinstance(source, TokenFile):  # synthetic tokens: ids of no text
        return {}
    if (run_dir / RUN_FILE).is_file() or (run_dir / "checkpoints").is_dir():
        check_tokenized_as_run(source.path, run_dir,
                               f"data file '{source.path}' ({source.key})",
                               ", or use a new --run-dir")
    return {RUN_FILE: source.tokenizer} if source.tokenizer is not None else {}


def evaluator(task) -> Evaluator | None:
    """Held-out loss and perplexity on the first data.eval_batches batches of
    data.eval_path (a token file like data.path), when it is set."""
    d = task.exp.data
    if not d.eval_path or not d.eval_batches:
        return None
    held_out = token_file(task.exp, d.eval_path, "data.eval_path", task.documents)
    return HeldOutLoss(task, [task.batch(held_out, k) for k in range(d.eval_batches)])


class HeldOutLoss:
    """Mean loss (and its exp, perplexity) of the state on fixed held-out batches: of its
    parameters, or of replicas that train apart (sync.method) their center, the model
    they meet at and that checkpoint readers take."""

    def __init__(self, task, batches: list[jax.Array]):
        self.task, self.batches = task, batches

    def __call__(self, state: dict) -> dict[str, float]:
        params = state["sync"]["center"] if self.task.local else state["params"]
        scored = [self.task.eval_loss_fn(params, b) for b in self.batches]
        loss, kept = (np.array([np.asarray(x.addressable_shards[0].data) for x in column])
                      for column in zip(*scored, strict=True))
        mean = float(np.sum(loss * kept) / max(np.sum(kept), 1))  # over the kept targets
        return {"eval_loss": mean, "eval_perplexity": float(np.exp(min(mean, 80.0)))}
