"""The training loop: resume, run steps, log, checkpoint, stop cleanly on faults.

It knows a model kind only through the Task interface (`plait.tasks.base`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import statistics
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh

from plait import cluster
from plait.config import Experiment
from plait.errors import RunFailed, UserError
from plait.hardware import peak_memory_bytes
from plait.train import rundir
from plait.train.failures import step_failed
from plait.train.memory import check_step_fits
from plait.train.metrics import (
    MetricsLog,
    StepEnds,
    StepTimer,
    Throughput,
    evaluation_keys,
    strict,
)
from plait.train.nonfinite import NonFiniteGuard
from plait.train.profiler import Profiler, check_window
from plait.train.run import Run, write_config
from plait.train.signals import StopFlag

logger = logging.getLogger("plait")


def _local_values(tree):
    """Host values of metrics; works when the mesh spans several processes. A metric
    with one value per replica (local SGD) is their mean."""
    return jax.tree.map(host_value, tree)


def host_value(x: jax.Array) -> np.ndarray:
    values = cluster.host_array(x)
    return values if x.ndim == 0 else values.mean(0)


def _steps(run: Run, compiled, state: dict, start: int, log: MetricsLog, stop: StopFlag,
           profiler: Profiler):
    """Run steps from `start`; returns (state, last step, step times)."""
    task, exp = run.task, run.exp
    total, every, ckpt_every = exp.train.steps, exp.log.every_steps, exp.checkpoint.every_steps
    evaluate = task.evaluator(run.source)
    rate = Throughput(task, run.mesh, exp.precision.compute)
    timer, step_times = StepTimer(), []
    prefetch = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plait-data")
    ends = StepEnds()  # a step's time: from one logged step's end to the next's
    # The first step runs alone on the device: its batch is ready before it starts and
    # the next one is made after it ends (a transfer during the first execution broke
    # cuDNN's graph capture on an H100: docs/benchmarks.md, "GPU facts").
    next_batch = prefetch.submit(lambda: jax.block_until_ready(task.batch(run.source, start)))
    step = start
    guard = NonFiniteGuard(run.mesh, exp.train.on_nonfinite, exp.train.max_skipped)
    eval_every = exp.data.eval_every_steps

    def emit(at: int, metrics: dict, with_eval: bool, done: Future) -> None:
        """Write the record of step `at` (a sync on its metrics; `done`: the future of
        when they were ready, StepEnds')."""
        try:
            metrics = _local_values(metrics)
            end = done.result()
        except jax.errors.JaxRuntimeError as e:
            raise step_failed(run, at - 1, e) from None
        dt = timer.lap(at, end)
        record = {"step": at, "loss": float(metrics["loss"]),
                  "lr": float(metrics["lr"]), "grad_norm": float(metrics["grad_norm"])}
        # A task's own figures of the step (a mixture of experts' router metrics).
        record.update({k: float(v) for k, v in metrics.items()
                       if k not in ("loss", "lr", "grad_norm", "skipped")})
        if guard.policy == "skip":
            record["skipped_steps"] = guard.skipped()
        if dt is not None:
            step_times.append(dt)
            units, mfu = rate(dt)
            record.update(step_time_s=dt, mfu=mfu, **{rate.key: units})
        if with_eval:
            t_eval = time.perf_counter()
            record.update(evaluate(state))
            timer.last_time += time.perf_counter() - t_eval  # not a step's time
        log.write(record)
        guard.check(run)

    # A log step's record is written once the next step is queued, so the device is not
    # left idle while the host formats and writes it (a short step, e.g. dlrm-bench's
    # 1.4 ms on an H100, lost 15% to that); evaluations, saves, signals and the last step
    # write it at once.
    pending: tuple[int, dict, Future] | None = None

    def flush() -> None:
        nonlocal pending
        if pending is not None:
            at, metrics, done = pending
            emit(at, metrics, False, done)
            pending = None
    try:
        timer.lap(step)
        while step < total:
            batch = next_batch.result()
            if step > start and step + 1 < total:
                next_batch = prefetch.submit(task.batch, run.source, step + 1)
            profiler.before(step)
            try:
                state, metrics = compiled(state, batch)
                if step == start:
                    jax.block_until_ready(metrics)
            except jax.errors.JaxRuntimeError as e:
                raise step_failed(run, step, e) from None
            if step == start and step + 1 < total:
                next_batch = prefetch.submit(task.batch, run.source, step + 1)
            flush()
            step += 1
            guard.after(metrics, step)
            profiler.after(step, state)
            # An evaluation is due on its own schedule, and logged where it falls.
            due = evaluate is not None and eval_every and step % eval_every == 0
            if step % every == 0 or step == total or step == start + 1 or due:
                with_eval = evaluate is not None and (not eval_every or due or step == total)
                done = ends.submit(metrics)
                if with_eval or step == total:
                    emit(step, metrics, with_eval, done)
                else:
                    pending = (step, metrics, done)
            saving = ckpt_every and step % ckpt_every == 0 and exp.checkpoint.enabled
            if saving or stop.signal is not None or step == total:
                flush()
                guard.check(run)  # nothing non-finite is ever saved
            if saving:
                run.save(state, step)
            if stop.signal is not None:
                break
        profiler.close(step, state)
    finally:
        profiler.close()
        prefetch.shutdown(wait=True, cancel_futures=True)
        ends.close()
    return state, step, step_times


def _summary(run: Run, log: MetricsLog, start: int, step: int, step_times: list[float],
             compile_s: float, wall: float, preempted: bool) -> dict:
    rate = Throughput(run.task, run.mesh, run.exp.precision.compute)
    median_dt = statistics.median(step_times) if step_times else None
    units, mfu = rate(median_dt) if median_dt else (None, None)
    summary = {"steps_run": step - start, "final_step": step,
               "final_loss": log.history[-1]["loss"] if log.history else None,
               "compile_s": compile_s, "wall_s": wall, "median_step_time_s": median_dt,
               rate.key: units, "preempted": preempted, "checkpoint_step": run.last_saved,
               "records": log.history}
    if mfu is not None:
        summary["mfu"] = mfu
    peak = peak_memory_bytes(run.mesh)
    if peak is not None:  # an accelerator's high-water mark; CPU keeps none
        summary["peak_device_memory_bytes"] = peak
    if run.is_writer:
        (run.run_dir / "summary.json").write_text(
            json.dumps(strict({k: v for k, v in summary.items() if k != "records"}), indent=2,
                       allow_nan=False) + "\n")
    return summary


def _final_line(run: Run, log: MetricsLog, summary: dict, total: int) -> str:
    how = "stopped by signal" if summary["preempted"] else "done"
    step, final = summary["final_step"], summary["final_loss"]
    if final is None:
        return f"plait: {how} at step {step}/{total}"
    extras = {k: log.history[-1][k] for k in evaluation_keys(log.history[-1])}
    rate = f"{run.task.unit}_per_s"
    return (f"plait: {how} at step {step}/{total}: loss {final:.4f}, "
            f"{summary[rate] or 0:,.0f} {run.task.unit}/s (median), {summary['wall_s']:.1f}s wall"
            + "".join(f", held-out {k} {v:.4f}" for k, v in extras.items())
            + (f", {summary['peak_device_memory_bytes'] / 2**30:.1f} GiB peak device memory"
               if "peak_device_memory_bytes" in summary else "")
            + (f", checkpoint at step {run.last_saved}" if run.last_saved is not None else ""))


def _would_hang(task, compiled) -> str | None:
    """Why the compiled step would hang on XLA:CPU, or None; said before the first step
    instead of XLA's abort 40 s into it (docs/architecture.md). Two shapes of program:
    a collective-permute inside a pipeline's per-tick switch (XLA:CPU runs one only when
    every device of the program reaches it, and ranks take different branches at once),
    and a conditional holding collectives beside a collective it is not ordered against
    (XLA:CPU may run them in either order on different devices)."""
    if jax.default_backend() != "cpu":
        return None
    text = compiled.as_text()
    if "conditional(" not in text:
        return None
    from plait import hlo

    mod = hlo.parse_hlo(text)
    found = (hlo.ops_in_branches(mod, "collective-permute") if task.branches_diverge()
             else [])
    if found:
        what = (f"{len(found)} collective-permute(s) inside the pipeline's per-tick switch "
                f"(the first from {_origin(found[0])}), where ranks busy with another "
                "action never join them")
    else:
        pairs = hlo.unordered_beside_conditionals(mod)
        if not pairs:
            return None
        cond, other = pairs[0]
        what = (f"a conditional holding collectives (from {_origin(cond)}) beside "
                f"{len({o.name for _, o in pairs})} collective(s) not ordered against it "
                f"(the first from {_origin(other)}), which devices may run in different "
                "orders")
    return (f"the compiled step would hang on XLA:CPU: {what}; this is a plait bug "
            "(please report it with this line); another mesh or configuration may avoid it")


def _origin(ins) -> str:
    """Where in the traced program an HLO instruction came from."""
    m = re.search(r'op_name="([^"]*)"', ins.attrs)
    return m.group(1) if m else ins.name


def _close_quietly(log: MetricsLog) -> None:
    with contextlib.suppress(OSError):  # the failing disk may fail the last flush too
        log.close()


def train(exp: Experiment, mesh: Mesh, run_dir: Path,
          profile: tuple[int, int] | None = None, from_step: int | None = None) -> dict:
    """Train `exp` on `mesh` in `run_dir`, resuming from its newest checkpoint (or the one
    of `from_step`); with `profile` = (start, stop), trace steps start + 1 .. stop into
    RUN_DIR/profile."""
    exp, schedule_note = rundir.kept_schedule(exp, run_dir)
    run = Run(exp, mesh, run_dir)
    total = exp.train.steps
    state, start, restored = run.restore(from_step)
    log = MetricsLog(run.run_dir, start, total, exp.log.tensorboard, exp.log.console,
                     run.is_writer)
    run.header(log, state, start, restored)
    if schedule_note:
        log.note(schedule_note)
    if run.restore_note:
        log.note(run.restore_note)
    if start >= total:
        log.note(f"plait: already trained to step {start} of {total}; nothing to do "
                 "(raise --steps to continue)")
        log.close()
        run.close()
        return {"steps_run": 0, "final_step": start, "records": []}
    try:
        profile, profile_note = check_window(profile, start, total)
    except UserError:
        _close_quietly(log)
        run.abandon()
        raise
    if profile_note:
        log.note(profile_note)
    if run.is_writer:
        write_config(run.run_dir, run.resolved, start)
    log.note("plait: compiling the train step ...")
    t0 = time.perf_counter()
    compiled = run.task.compile()
    try:  # refused before the first batch is made: nothing of the run is lost
        check_step_fits(run.task, compiled)
        hang = _would_hang(run.task, compiled)
        if hang:
            raise RunFailed(hang)
    except (UserError, RunFailed):
        _close_quietly(log)
        run.abandon()
        raise
    compile_s = time.perf_counter() - t0
    log.note(f"plait: step compiled in {compile_s:.1f}s")
    if state is None:
        state = run.fresh_state(log)
    cluster.barrier("step-compiled")  # every process starts the first step together

    stop = StopFlag(run)
    stop.install()
    wall0 = time.perf_counter()
    try:
        state, step, step_times = _steps(run, compiled, state, start, log, stop,
                                         Profiler(profile, run.run_dir, log))
        preempted = stop.signal is not None and step < total
        if exp.checkpoint.enabled or preempted:
            run.save(state, step)
        run.close()
        summary = _summary(run, log, start, step, step_times, compile_s,
                           time.perf_counter() - wall0, preempted)
    except RunFailed:
        _close_quietly(log)
        run.abandon()  # pending saves finish; nothing after the failure is written
        raise
    except Exception as e:
        failure = rundir.write_failure(e)
        if failure is None:
            raise
        _close_quietly(log)
        raise run.write_failed(*failure) from None
    finally:
        stop.restore()  # after the last save: a signal during it is handled as above
    log.close()  # the progress bar ends before the summary line
    log.note(_final_line(run, log, summary, total))
    return summary


def train_briefly(exp: Experiment, mesh: Mesh, steps: int, console: str = "none",
                  log_every: int = 1) -> dict:
    """The summary of `steps` steps of plait train's loop for `exp` on `mesh` in a scratch
    directory: data included, no checkpoints, every `log_every`-th step logged with the
    mean time of the steps since the last (every step by default). What `plait sweep
    --run` and the benchmarks time."""
    run = exp.model_copy(update={
        "train": exp.train.model_copy(update={"steps": steps}),
        "checkpoint": exp.checkpoint.model_copy(update={"enabled": False}),
        "log": exp.log.model_copy(update={"every_steps": log_every, "tensorboard": False,
                                          "console": console})})
    with tempfile.TemporaryDirectory() as tmp:
        return train(run, mesh, Path(tmp))
