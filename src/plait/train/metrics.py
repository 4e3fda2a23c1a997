"""Where training metrics go: metrics.jsonl, TensorBoard event files and the console."""

from __future__ import annotations

import json
import math
import sys
import time
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from plait.hardware import peak_flops

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from plait.tasks.base import Task

# Keys every record of the loop has; anything else in a record is a task's evaluation
# metric (e.g. a DLRM's held-out "auc"), shown and logged as it comes.
STANDARD = ("step", "loss", "lr", "grad_norm", "step_time_s", "mfu", "skipped_steps")


# A model's own figures of each step (a mixture of experts' router metrics): logged as
# they come, shown compactly, never called held-out.
MODEL_PREFIXES = ("moe_",)


def evaluation_keys(record: dict) -> list[str]:
    return [k for k in record if k not in STANDARD and not k.endswith("_per_s")
            and not k.startswith(MODEL_PREFIXES)]


def trim_jsonl(path: Path, keep_through_step: int) -> None:
    """Drop records after `keep_through_step` (and a torn last line) before a resume.

    Those steps are about to be run again from the checkpoint, and will produce
    the same records; keeping both would show every such step twice. A line that is
    not UTF-8 JSON (a torn write's bytes) is dropped with the torn ones.
    """
    if not path.exists():
        return
    kept = []
    for line in path.read_bytes().decode("utf-8", errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("step", 0) <= keep_through_step:
            kept.append(line)
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(f"{line}\n" for line in kept))
    tmp.replace(path)


def strict(record: dict) -> dict:
    """The record as strict JSON takes it: a non-finite number becomes null and its key is
    listed under "nonfinite" (json.dumps would write NaN, which strict readers reject)."""
    bad = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
    if not bad:
        return record
    return {**{k: None if k in bad else v for k, v in record.items()}, "nonfinite": bad}


class MetricsLog:
    def __init__(self, run_dir: Path, start_step: int, total_steps: int, tensorboard: bool,
                 console_mode: str, is_writer: bool = True):
        self.is_writer = is_writer
        self.path = run_dir / "metrics.jsonl"
        self.tb, self._tb_args = None, None
        if is_writer:
            trim_jsonl(self.path, start_step)
            self.file = self.path.open("a")
            # Made at the first record: a run with nothing to do writes no empty file.
            self._tb_args = (str(run_dir / "tensorboard"), start_step + 1) if tensorboard \
                else None
        if console_mode == "auto":
            console_mode = "bar" if sys.stdout.isatty() else "line"
        self.mode = console_mode if is_writer else "none"
        self.console = Console(highlight=False, soft_wrap=True)
        self.progress = None
        if self.mode == "bar":
            self.progress = Progress(
                TextColumn("[bold]step {task.completed}/{task.total}"), BarColumn(),
                TextColumn("{task.fields[status]}"), TimeRemainingColumn(),
                console=self.console, transient=False,
            )
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step,
                                               status="compiling")
            self.progress.start()
        self.history: list[dict] = []

    def _open_tensorboard(self) -> None:
        logdir, purge_step = self._tb_args
        self._tb_args = None
        try:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(logdir, purge_step=purge_step)
        except ImportError:  # pragma: no cover - optional on bare accelerator images
            print("plait: tensorboardX is not installed; no TensorBoard files",
                  file=sys.stderr)

    def note(self, text: str) -> None:
        if self.mode != "none":
            self.console.print(text)

    def write(self, record: dict) -> None:
        self.history.append(record)
        if not self.is_writer:
            return
        self.file.write(json.dumps(strict(record), allow_nan=False) + "\n")
        self.file.flush()
        if self.tb is None and self._tb_args is not None:
            self._open_tensorboard()
        if self.tb is not None:
            for key, value in record.items():
                # (tensorboardX warns on every non-finite scalar; metrics.jsonl has them)
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self.tb.add_scalar(f"train/{key}", value, record["step"])
        status = format_status(record)
        if self.progress is not None:
            self.progress.update(self.task, completed=record["step"], status=status)
        elif self.mode == "line":
            print(f"step {record['step']:>6}  {status}", flush=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.is_writer:
            self.file.close()
            if self.tb is not None:
                self.tb.close()


def format_status(r: dict) -> str:
    parts = [f"loss {r['loss']:.4f}", f"lr {r['lr']:.2e}", f"gnorm {r['grad_norm']:.3f}"]
    if r.get("tokens_per_s"):
        parts.append(f"{r['tokens_per_s']:,.0f} tok/s")
    if r.get("samples_per_s"):
        parts.append(f"{r['samples_per_s']:,.0f} samples/s")
    for key in evaluation_keys(r):
        parts.append(f"{key} {r[key]:.4f}")
    if "moe_aux_loss" in r:
        parts.append(f"router aux {r['moe_aux_loss']:.3f} z {r['moe_z_loss']:.3f} load "
                     f"{r['moe_tokens_max'] / max(r['moe_tokens_mean'], 1e-9):.2f}x dropped "
                     f"{100 * r['moe_dropped_fraction']:.1f}%")
    if r.get("step_time_s"):
        parts.append(f"{r['step_time_s'] * 1e3:.1f} ms/step")
    if r.get("skipped_steps"):
        parts.append(f"{r['skipped_steps']} skipped")
    if r.get("mfu") is not None:
        parts.append(f"MFU {100 * r['mfu']:.1f}%")
    return "  ".join(parts)


class StepTimer:
    """Wall time per step between log points (device work is synchronised there)."""

    def __init__(self) -> None:
        self.last_time = time.perf_counter()
        self.last_step: int | None = None

    def lap(self, step: int, now: float | None = None) -> float | None:
        """Seconds per step since the last lap, with step `step` ended at `now` (a
        perf_counter time; default: now)."""
        now = time.perf_counter() if now is None else now
        out = None
        if self.last_step is not None and step > self.last_step:
            out = (now - self.last_time) / (step - self.last_step)
        self.last_time, self.last_step = now, step
        return out


class StepEnds:
    """When each step submitted ends, seen by a thread that waits for its outputs.

    The loop's own sync on a step comes after it has dispatched the next step, and a
    dispatch may hold the main thread past the step's end: on a GPU the last of 16
    steps of gpt2-1.3b read 242 ms against a median of 316 ms (61% MFU where the
    others read 47%), as the step before it was read late by about the time the last
    one took to dispatch. A daemon thread, so that a step that never ends (a lost
    peer) does not hold the process at exit; `close` waits for it otherwise.
    """

    def __init__(self) -> None:
        import queue
        import threading

        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="plait-step-ends",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import jax

        while (item := self._queue.get()) is not None:
            outputs, ended = item
            try:
                jax.block_until_ready(outputs)
                ended.set_result(time.perf_counter())
            except Exception as e:  # the loop's own sync raises it too, in its words
                ended.set_exception(e)

    def submit(self, outputs) -> Future:
        """A future of the perf_counter time when `outputs` (a step's) are ready."""
        ended: Future = Future()
        self._queue.put((outputs, ended))
        return ended

    def close(self, wait_s: float = 10.0) -> None:
        """End the thread, waiting up to `wait_s` for the steps it still watches. A
        daemon thread still inside XLA when Python finalises is stopped by a forced
        unwind that XLA's C++ catches, and the process aborts ("FATAL: exception not
        rethrown", status -6) after a run that succeeded: seen twice in ~750 runs of
        `plait train` two at a time on 2 cores, and every time in a script whose
        daemon thread waits on a step at exit."""
        self._queue.put(None)
        self._thread.join(wait_s)


def auc(labels, scores) -> float:
    """Area under the ROC curve: the Mann-Whitney statistic with tied scores averaged."""
    import numpy as np

    labels = np.asarray(labels, np.float64).ravel()
    scores = np.asarray(scores, np.float64).ravel()
    pos = labels > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    ranks[order] = np.arange(1, len(scores) + 1)
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    sums = np.bincount(inverse, weights=ranks)
    ranks = (sums / counts)[inverse]
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


class Throughput:
    """Units (tokens, samples) per second and MFU of a step time; MFU is None where the
    device's peak or the model's FLOPs are unknown."""

    def __init__(self, task: Task, mesh: Mesh, precision: str):
        self.units = task.units_per_step
        self.key = f"{task.unit}_per_s"
        peak = peak_flops(mesh.devices.flat[0].device_kind, precision)
        flops = task.flops_per_unit()
        self.flops_per_s = peak * mesh.devices.size if peak and flops else None
        self.flops = flops

    def __call__(self, step_time: float) -> tuple[float, float | None]:
        rate = self.units / step_time
        return rate, (self.flops * rate / self.flops_per_s) if self.flops_per_s else None
