"""`plait eval RUN_DIR`: a language model's loss and perplexity on a whole token file.

Training's held-out figure (`data.eval_path`) is a fixed sample of random windows,
logged as the run goes; this scores a checkpoint (an imported model before
fine-tuning, a run after it) on every token of a file once. The file is read as
consecutive windows of model.seq_len + 1 tokens, each starting on the previous
one's last token, so every token after the first is a target exactly once. Batches
of --batch windows run on the mesh with the task and loss that training uses (its
layouts, pipeline and context axes included). The last window may be short and the
last batch part-full: they are filled out with targets the loss leaves out (~0, as
a loss mask stores them), so every target is scored and none is counted twice (the
windows a batch could not hold had been left out: 14 of 78 of a small file at the
default batch). The checkpoint is read without touching the run directory, so a
run may go on training beside it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from plait.config import Experiment
from plait.data.tokens import TokenFile
from plait.errors import UserError


class Windows:
    """A token file as consecutive windows: row r of batch k is window k * rows + r,
    tokens [w * seq, w * seq + seq + 1) (those its loss mask leaves out as ~id); the
    last window's missing tokens, and the rows past the last window, are ~0: targets
    the loss leaves out, read as id 0 after the row's real tokens (causal attention
    keeps them from the real ones)."""

    def __init__(self, file: TokenFile, seq_len: int, rows: int):
        self.file, self.seq_len, self.per_batch = file, seq_len, rows
        self.targets = len(file.tokens) - 1
        self.count = -(-self.targets // seq_len)  # the last one may be short

    def targets_in(self, batches: int) -> int:
        """Targets of the file in the first `batches` batches."""
        return min(batches * self.per_batch * self.seq_len, self.targets)

    def rows(self, step: int, start: int, stop: int) -> np.ndarray:
        s, first = self.seq_len, step * self.per_batch
        out = np.full((stop - start, s + 1), ~0, np.int32)
        for i, w in enumerate(range(first + start, first + stop)):
            if w < self.count:
                length = min(s + 1, self.targets + 1 - w * s)
                out[i, :length] = self.file.window(w * s, length)
        return out


def _tokens(path: Path, run_dir: Path, exp: Experiment, dtype: str) -> TokenFile:
    """The file (and its loss mask), checked against the run's tokenizer and vocabulary."""
    from plait.data.tokenizer import check_tokenized_as_run

    if path.is_file():  # a missing file: TokenFile's line
        check_tokenized_as_run(path, run_dir, f"'{path}'")
        if path.stat().st_size < 2 * np.dtype(dtype).itemsize:
            raise UserError(f"'{path}' (--data) holds fewer than 2 tokens: nothing to score "
                            "(a target needs a token before it)")
    # Windows are Windows' own (a file shorter than one is one short window): the file
    # is read for its tokens, its mask and its document starts.
    return TokenFile(path, dtype, 1, exp.seed, exp.model.vocab,
                     key="--data", spare=0, row_start="anywhere",
                     document_mask=exp.data.document_mask, dtype_key="--dtype")


def evaluate(run_dir: Path, data: str | None, mesh, step: int | str | None = None,
             batch: int | None = None, max_batches: int | None = None,
             dtype: str | None = None, seq_len: int | None = None,
             progress: bool = True) -> dict:
    """{"step", "loss", "perplexity", "tokens", "windows", "batches", "curve", ...}
    of the run's checkpoint (the newest, `step`, or with step "all" every kept one: the
    figures are then the best one's, "curve" has them all) on `data` (default: the
    run's data.eval_path) on `mesh`, in windows of `seq_len` tokens (default: the run's;
    a rotary model may be scored at another length, e.g. past the one it trained at)."""
    from plait import hosts
    from plait.checkpoint import Checkpoints
    from plait.sample import decoder_run
    from plait.tasks import make_task

    exp, ckpt_dir = decoder_run(run_dir, "plait eval scores")
    if seq_len is not None and seq_len < 1:
        raise UserError(f"--seq-len must be at least 1, got {seq_len}")
    if seq_len is not None and seq_len != exp.model.seq_len:
        if "seq_len" in exp.model.shape_keys_now():
            raise UserError(f"--seq-len {seq_len}: this model's learned position table "
                            f"holds model.seq_len = {exp.model.seq_len} positions; score it "
                            "at that length (rotary models take any)")
        exp, _ = decoder_run(run_dir, "plait eval scores", [f"model.seq_len={seq_len}"])
    path = data or exp.data.eval_path
    if not path:
        raise UserError(f"the run '{run_dir}' has no data.eval_path; pass --data TOKENS.bin "
                        "(a file made by plait data with the run's tokenizer)")
    rows = exp.train.global_batch if batch is None else batch
    if rows < 1:
        raise UserError(f"--batch must be at least 1, got {rows}")
    if max_batches is not None and max_batches < 1:
        raise UserError(f"--max-batches must be at least 1, got {max_batches}")
    windows = Windows(_tokens(Path(path), run_dir, exp, dtype or exp.data.dtype),
                      exp.model.seq_len, rows)
    whole = -(-windows.count // rows)  # the last batch may be part-full
    n = whole if max_batches is None else min(whole, max_batches)
    # One model, whatever the run's replicas: a local-SGD checkpoint gives its center.
    exp = exp.model_copy(update={
        "train": exp.train.model_copy(update={"global_batch": rows}),
        "sync": exp.sync.model_copy(update={"method": "allreduce"}), "mesh": None})
    try:
        task = make_task(exp, mesh)
    except UserError as e:  # the batch is --batch here (by default the run's global batch)
        said = f"--batch {rows}" + (" (the run's train.global_batch)" if batch is None else "")
        raise UserError(str(e).replace(f"train.global_batch = {rows}", said)
                        .replace("make global_batch", "pass --batch")) from None
    ckpts = Checkpoints(ckpt_dir, keep=max(1, exp.checkpoint.keep), async_save=False,
                        read_only=True)
    steps: list[int | None] = [step] if step != "all" else sorted(ckpts.steps())
    if not steps:
        raise UserError(f"'{run_dir}' has no checkpoints yet; train with checkpoints "
                        "enabled first")
    curve, notes = [], []
    for s in steps:
        try:
            loss, at, note, kept = _score(task, ckpts, run_dir, s, windows, n, rows,
                                          progress)
        except Exception as e:  # noqa: BLE001 - one unreadable checkpoint of many
            if step != "all" or isinstance(e, UserError):
                raise
            reason = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
            print(f"plait eval: the checkpoint at step {s} is unusable ({reason}); skipped",
                  file=sys.stderr)
            continue
        curve.append({"step": at, "loss": loss, "perplexity": float(np.exp(min(loss, 80.0))),
                      "kept": kept})
        notes += [note] if note and note not in notes else []
    if not curve:
        raise UserError(f"no usable checkpoint in '{ckpt_dir}' (tried steps "
                        f"{', '.join(map(str, steps))})")
    best = min(curve, key=lambda c: c["loss"])
    kept = best.pop("kept") if windows.file.mask is not None else None
    for c in curve:
        c.pop("kept", None)
    return {"run_dir": str(run_dir), "data": str(path), **best, "curve": curve,
            "tokens": windows.targets_in(n), "kept_targets": kept,
            "windows": min(n * rows, windows.count), "batch": rows,
            "seq_len": exp.model.seq_len, "batches": n, "all_batches": whole,
            "mesh": hosts.mesh_text(mesh), "note": "; ".join(notes) or None}


def _score(task, ckpts, run_dir: Path, step: int | None, windows: Windows, n: int,
           rows: int, progress: bool) -> tuple[float, int, str | None, int]:
    """(mean loss, step, notice, targets counted) of one checkpoint over the first n
    batches."""
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn

    from plait.progress import Display
    from plait.sample import read_params
    from plait.train.loop import host_value

    params, at, note = read_params(task, ckpts, run_dir, step)
    # Laid out for the mesh (stacked, pipelined) the way training lays them out.
    params = task.laid_out_params(params)
    total = kept = 0.0  # the loss summed over the kept targets, and how many
    # A bar on a terminal; elsewhere (logs, nohup) a line every tenth of the batches.
    with Display(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                 TimeRemainingColumn(), shown=progress and n >= 4) as shown:
        bar = shown.bar.add_task(f"step {at}: scoring {n} batches of {rows} windows", total=n)
        for k in range(n):
            loss, count = task.eval_loss_fn(params, task.batch(windows, k))
            count = float(host_value(count))
            total, kept = total + float(host_value(loss)) * count, kept + count
            shown.bar.advance(bar)
            if (k + 1) % max(n // 10, 1) == 0 or k + 1 == n:
                shown.say(f"plait eval: step {at}: {k + 1}/{n} batches, loss so far "
                          f"{total / max(kept, 1):.4f}")
    if not kept:
        raise UserError(f"the loss mask of '{windows.file.path}' keeps no target in the "
                        f"{n} batch(es) scored; score more of it (--max-batches) or another "
                        "file")
    return total / kept, at, note, int(kept)
