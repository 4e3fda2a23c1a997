"""The training loop: resume, run steps, log, checkpoint, stop cleanly on faults.

It knows a model kind only through the Task interface (`plait.tasks.base`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import shutil
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh

from plait import cluster, hosts
from plait.checkpoint import Checkpoints
from plait.config import Experiment
from plait.errors import RunFailed, UserError
from plait.tasks import check_memory, make_task
from plait.train import lock, rundir
from plait.train.failures import step_failed
from plait.train.metrics import (
    MetricsLog,
    StepTimer,
    Throughput,
    evaluation_keys,
    strict,
)
from plait.train.nonfinite import NonFiniteGuard
from plait.train.profiler import Profiler
from plait.train.signals import StopFlag

logger = logging.getLogger("plait")


def _local_values(tree):
    """Host values of metrics; works when the mesh spans several processes. A metric
    with one value per replica (local SGD) is their mean."""
    return jax.tree.map(host_value, tree)


def host_value(x: jax.Array) -> np.ndarray:
    if x.ndim == 0:  # replicated
        return np.asarray(x.addressable_shards[0].data)
    if not x.is_fully_addressable:  # every process calls this at the same step
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(x).mean(0)


def write_config(run_dir: Path, exp: Experiment, resumed_step: int) -> None:
    """Write the resolved config; a different earlier one is kept, never overwritten."""
    path = run_dir / "config.toml"
    text = exp.to_toml()
    if path.exists() and path.read_text() != text:
        backup = run_dir / f"config.step{resumed_step}.toml"
        n = 1
        while backup.exists():
            backup = run_dir / f"config.step{resumed_step}.{n}.toml"
            n += 1
        path.replace(backup)
    tmp = path.with_suffix(".toml.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _join_orbax_threads(timeout: float) -> None:
    """Wait (up to `timeout` in all) for orbax's writer threads to end."""
    deadline = time.monotonic() + timeout
    for t in threading.enumerate():
        if type(t).__module__.startswith("orbax") and t is not threading.current_thread():
            with contextlib.suppress(Exception):  # orbax's threads re-raise their error
                t.join(max(0.0, deadline - time.monotonic()))


class Run:
    """One invocation of `plait train`: a task on a mesh in a run directory."""

    def __init__(self, exp: Experiment, mesh: Mesh, run_dir: Path):
        self.exp, self.mesh, self.run_dir = exp, mesh, Path(run_dir)
        self.is_writer = jax.process_index() == 0
        check_memory(exp, mesh)  # before anything is built
        self.task = make_task(exp, mesh)
        self.source = self.task.source()  # checks data files before anything is written
        self.resolved = exp.model_copy(update={"mesh": dict(mesh.shape)})
        self.mesh_text = hosts.mesh_text(mesh)
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.ckpts, self.log_handler, self._saving = None, None, False
        if self.is_writer:  # before anything in the directory is touched
            rundir.prepare(self.run_dir)
            lock.acquire(self.run_dir)
            self.log_handler = rundir.open_log(self.run_dir)
        try:
            if self.is_writer and exp.checkpoint.enabled:
                rundir.check_room(self.run_dir, self.checkpoint_bytes(), exp.checkpoint.keep)
            # Every process makes the same orbax calls (they synchronise across processes).
            if exp.checkpoint.enabled or self.ckpt_dir.exists():
                self.ckpts = Checkpoints(self.ckpt_dir, exp.checkpoint.keep,
                                         exp.checkpoint.async_save)
                self.ckpts.check_model(exp.model, self.run_dir)
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if self.is_writer:
                for name, path in self.task.run_files(self.source).items():
                    tmp = self.run_dir / f".{name}.tmp"
                    shutil.copyfile(path, tmp)
                    tmp.replace(self.run_dir / name)
        except BaseException:
            self.close()
            raise
        self.last_saved: int | None = None
        self.restore_note: str | None = None
        self.resolved_json = json.loads(self.resolved.model_dump_json())

    def checkpoint_bytes(self) -> int:
        """Bytes of one checkpoint's arrays (their metadata is small beside them)."""
        leaves = jax.tree.leaves(self.task.canonical_layout.abstract())
        return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in leaves)

    def restore(self, from_step: int | None = None) -> tuple[dict, int, bool]:
        """(state, first step, restored?): the checkpoint of `from_step`, or the newest
        usable one, or a fresh state."""
        if from_step is not None and self.ckpts is None:
            raise UserError(f"--from-step {from_step}: '{self.run_dir}' has no checkpoints")
        abstract, adapt, self.restore_note = self._restore_plan(from_step)
        if from_step is not None:
            restored = self.ckpts.restore_step(abstract, from_step)
        else:
            restored = self.ckpts.restore_latest(abstract) if self.ckpts else None
        if restored is None:
            self.restore_note = None
            return self.task.init_state(), 0, False
        state, meta = restored
        start = int(meta["step"])
        self.last_saved = start
        return self.task.from_checkpoint(adapt(state)), start, True

    def _restore_plan(self, from_step: int | None):
        """The task's plan for the checkpoint about to be read, judged on its config (a
        checkpoint of another number of data replicas, say)."""
        steps = self.ckpts.steps() if self.ckpts else []
        step = from_step if from_step is not None else (steps[0] if steps else None)
        saved = None
        if step is not None and step in steps:
            with contextlib.suppress(Exception):  # unreadable: judged when restoring
                saved = self.ckpts.read_meta(step).get("config")
        if saved is None:
            return self.task.canonical_layout.abstract(), lambda state: state, None
        return self.task.restore_plan(saved)

    def meta_for(self, step: int) -> dict:
        exp = self.exp
        return {"step": step, "mesh": self.mesh_text,
                "data": {"source": exp.data.source, "seed": exp.seed, "next_step": step,
                         "samples_seen": step * exp.train.global_batch},
                "config": self.resolved_json}

    def saving(self) -> bool:
        """Whether a checkpoint is being written now (in the loop or behind it)."""
        return self._saving or (self.ckpts is not None and self.ckpts.saving())

    def save(self, state: dict, step: int) -> None:
        if self.ckpts is not None and self.last_saved != step:
            self._saving = True
            try:
                self.ckpts.save(step, self.task.to_checkpoint(state), self.meta_for(step))
            finally:
                self._saving = False
            self.last_saved = step

    def header(self, log: MetricsLog, state: dict, start: int, restored: bool) -> None:
        mesh = self.mesh
        log.note(f"plait: {self.exp.name}: {self.task.num_params() / 1e6:.2f}M parameters, mesh "
                 f"{self.mesh_text} ({mesh.devices.size} {mesh.devices.flat[0].platform} "
                 f"devices{hosts.hosts_text(mesh)}), run dir {self.run_dir}")
        if restored:
            log.note(f"plait: resumed from the checkpoint at step {start}")
        for line in self.task.describe(state):
            log.note(line)

    def close(self) -> None:
        if self.ckpts:
            self._saving = True  # the wait below is part of the last save
            try:
                self.ckpts.wait()
                self.ckpts.close()
            finally:
                self._saving = False
        if self.is_writer:
            lock.release(self.run_dir)
        rundir.close_log(self.log_handler)
        self.log_handler = None

    def abandon(self) -> None:
        """Close after a failure: pending saves get their chance to finish, a save that
        cannot is removed, and nothing raised here hides the failure being reported."""
        # A failed save's writer threads may still be writing, and TensorStore prints
        # their late errors straight to stderr: that goes to plait.log meanwhile.
        with rundir.stderr_to(self.run_dir / "plait.log" if self.is_writer else None):
            if self.ckpts:
                for finish in (self.ckpts.wait, self.ckpts.close):
                    try:
                        finish()
                    except Exception as e:  # noqa: BLE001 - reported by the caller's line
                        if rundir.write_failure(e) is None:
                            logger.warning("closing the checkpoints after a failure: %s", e)
            _join_orbax_threads(timeout=30.0)
        if self.is_writer:
            removed = rundir.remove_partial_checkpoints(self.ckpt_dir)
            if removed:
                logger.warning("removed the unfinished checkpoint(s) %s", ", ".join(removed))
            lock.release(self.run_dir)
        rundir.close_log(self.log_handler)
        self.log_handler = None

    def write_failed(self, cause: str, path: str | None) -> RunFailed:
        """One line for a write that failed: where, why, what is kept, what to do."""
        self.abandon()
        steps = rundir.committed_steps(self.ckpt_dir) if self.is_writer else []
        kept = (f"the checkpoint at step {steps[0]} is intact" if steps
                else "no checkpoint was written")
        m = re.search(r"/(\d+)\.orbax-checkpoint-tmp", path or "")
        where = (f" (writing the checkpoint at step {m.group(1)})" if m
                 else f" (writing {path})" if path else "")
        return RunFailed(f"could not write to the run directory {self.run_dir}{where}: {cause}; "
                         f"{kept}; free space or fix the directory, then rerun the same "
                         "command to resume")


def _steps(run: Run, compiled, state: dict, start: int, log: MetricsLog, stop: StopFlag,
           profiler: Profiler):
    """Run steps from `start`; returns (state, last step, step times)."""
    task, exp = run.task, run.exp
    total, every, ckpt_every = exp.train.steps, exp.log.every_steps, exp.checkpoint.every_steps
    evaluate = task.evaluator(run.source)
    rate = Throughput(task, run.mesh, exp.precision.compute)
    timer, step_times = StepTimer(), []
    prefetch = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plait-data")
    # The first step runs alone on the device: its batch is ready before it starts and
    # the next one is made after it ends (a transfer during the first execution broke
    # cuDNN's graph capture on an H100: shared/gpu-findings).
    next_batch = prefetch.submit(lambda: jax.block_until_ready(task.batch(run.source, start)))
    step = start
    guard = NonFiniteGuard(run.mesh, exp.train.on_nonfinite, exp.train.max_skipped)
    eval_every = exp.data.eval_every_steps

    def emit(at: int, metrics: dict, with_eval: bool) -> None:
        """Write the record of step `at` (a sync on its metrics)."""
        try:
            metrics = _local_values(metrics)
        except jax.errors.JaxRuntimeError as e:
            raise step_failed(run, at - 1, e) from None
        dt = timer.lap(at)
        record = {"step": at, "loss": float(metrics["loss"]),
                  "lr": float(metrics["lr"]), "grad_norm": float(metrics["grad_norm"])}
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
    pending: tuple[int, dict] | None = None

    def flush() -> None:
        nonlocal pending
        if pending is not None:
            emit(*pending, with_eval=False)
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
            if step % every == 0 or step == total or step == start + 1:
                with_eval = evaluate is not None and (not eval_every or step % eval_every == 0
                                                      or step == total)
                if with_eval or step == total:
                    emit(step, metrics, with_eval)
                else:
                    pending = (step, metrics)
            saving = ckpt_every and step % ckpt_every == 0 and exp.checkpoint.enabled
            if saving or stop.signal is not None or step == total:
                flush()
                guard.check(run)  # nothing non-finite is ever saved
            if saving:
                run.save(state, step)
            if stop.signal is not None:
                break
    finally:
        profiler.close()
        prefetch.shutdown(wait=True, cancel_futures=True)
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
            + (f", checkpoint at step {run.last_saved}" if run.last_saved is not None else ""))


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
    if run.is_writer:
        write_config(run.run_dir, run.resolved, start)
    log.note("plait: compiling the train step ...")
    t0 = time.perf_counter()
    compiled = run.task.compile()
    compile_s = time.perf_counter() - t0
    log.note(f"plait: step compiled in {compile_s:.1f}s")
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
