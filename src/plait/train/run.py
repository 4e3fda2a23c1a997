"""One invocation of `plait train` on its run directory: the task on the mesh, the
checkpoints it restores from and saves to, the header it prints, and how it closes
(cleanly, abandoned after a fault, or failing to write)."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import shutil
import threading
import time
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh

from plait import hosts
from plait.checkpoint import Checkpoints
from plait.config import Experiment
from plait.errors import RunFailed, UserError
from plait.kinds import is_decoder
from plait.models import fp8
from plait.tasks import check_memory, make_task
from plait.tasks.gpt_runtime import check_attention, check_grouped, check_kernels
from plait.train import lock, rundir
from plait.train.memory import check_state_fits
from plait.train.metrics import MetricsLog
from plait.train.state import schedule_text

logger = logging.getLogger("plait")


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
    """Wait (up to `timeout` in all) for orbax's writer threads to end: its own thread
    classes and the plain thread an async save commits on ("async_save")."""
    deadline = time.monotonic() + timeout
    for t in threading.enumerate():
        if t is threading.current_thread():
            continue
        if type(t).__module__.startswith("orbax") or t.name == "async_save":
            with contextlib.suppress(Exception):  # orbax's threads re-raise their error
                t.join(max(0.0, deadline - time.monotonic()))


class Run:
    """One invocation of `plait train`: a task on a mesh in a run directory."""

    def __init__(self, exp: Experiment, mesh: Mesh, run_dir: Path):
        self.exp, self.mesh, self.run_dir = exp, mesh, Path(run_dir)
        self.is_writer = jax.process_index() == 0
        check_memory(exp, mesh)  # before anything is built
        if exp.precision.matmul == "fp8":
            fp8.check_devices(mesh.devices.flat)
        check_kernels(exp.model, mesh.devices.flat[0])
        check_attention(exp.model, exp.precision.compute, mesh.devices.flat[0])
        if getattr(exp.model, "moe", None) is not None:
            check_grouped(exp.model, exp.precision.compute, mesh.devices.flat[0],
                          dict(mesh.shape))
        self.task = make_task(exp, mesh)
        check_state_fits(self.task)  # before the state is made (asynchronously)
        self.source = self.task.source()  # checks data files before anything is written
        self.run_files = self.task.run_files(self.source, self.run_dir)
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
                for name, path in self.run_files.items():
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

    def restore(self, from_step: int | None = None) -> tuple[dict | None, int, bool]:
        """(state, first step, restored?): the checkpoint of `from_step`, or the newest
        usable one; None where the run starts fresh (`fresh_state`, made once the step has
        compiled and fits: dispatched before, a state too big for the step was still made
        after the refusal, and the process waited for it, 30 s and 11 GB more for
        qwen2.5-0.5b on this CPU)."""
        if from_step is not None and self.ckpts is None:
            raise UserError(f"--from-step {from_step}: '{self.run_dir}' has no checkpoints")
        abstract, adapt, self.restore_note = self._restore_plan(from_step)
        if from_step is not None:
            restored = self.ckpts.restore_step(abstract, from_step)
        else:
            restored = self.ckpts.restore_latest(abstract) if self.ckpts else None
        if restored is None:
            self.restore_note = None
            return None, 0, False
        state, meta = restored
        start = int(meta["step"])
        self.last_saved = start
        seed = (meta.get("data") or {}).get("seed")
        if not meta.get("params_only") and seed is not None and seed != self.exp.seed:
            said = (f"the checkpoint's batches were drawn with seed = {seed}; from step "
                    f"{start + 1} on this run draws them with seed = {self.exp.seed}")
            self.restore_note = f"{self.restore_note}; {said}" if self.restore_note else \
                f"plait: {said}"
        if meta.get("params_only"):  # imported weights: the optimizer starts fresh
            return self.task.init_state(state["params"]), start, True
        return self.task.from_checkpoint(adapt(state)), start, True

    def _restore_plan(self, from_step: int | None):
        """The task's plan for the checkpoint about to be read, judged on its config (a
        checkpoint of another number of data replicas, say)."""
        meta = self.ckpts.record(from_step) if self.ckpts else {}
        abstract = self.task.canonical_layout.abstract()
        if meta.get("params_only"):
            if self.exp.sync.method != "allreduce" or not is_decoder(self.exp.model):
                raise UserError("imported weights start with sync.method = \"allreduce\" on "
                                "a decoder; train a first checkpoint that way, then switch")
            # (an import holds no FP8 scaling state: the task starts it fresh)
            return ({"params": fp8.without_state(abstract["params"])}, lambda state: state,
                    f"parameters imported from {meta.get('imported_from', 'elsewhere')}, "
                    "optimizer state fresh")
        if meta.get("config") is None:
            return abstract, lambda state: state, None
        self._same_optimizer(meta["config"])
        return self.task.restore_plan(meta["config"])

    def _same_optimizer(self, saved_config: dict) -> None:
        """Refuse another optimizer than the checkpoint's, in one line: orbax found the
        state's trees unlike, and every checkpoint was called unusable, with "move the
        directory away to start afresh" after it."""
        for key in self.task.optimizer_keys:
            section, name = key.split(".")
            saved = (saved_config.get(section) or {}).get(name)
            now = getattr(getattr(self.exp, section), name)
            if saved is not None and saved != now:
                raise UserError(
                    f"the run directory's checkpoints were trained with {key} = \"{saved}\" "
                    f"(its state is kept with them), this run asks for \"{now}\"; use "
                    f"{key} = \"{saved}\" or a new --run-dir")

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
        log.note(f"plait: {schedule_text(self.exp.optimizer, self.exp.train.steps)}")
        for line in self.task.describe(self.task.layout.abstract() if state is None else state):
            log.note(line)
        if state is not None:
            for line in self.task.state_notes():
                log.note(line)

    def fresh_state(self, log: MetricsLog) -> dict:
        """The state of a run that starts fresh, and what its making says; waited for, so
        the first step's time is the step's own."""
        state = jax.block_until_ready(self.task.init_state())
        for line in self.task.state_notes():
            log.note(line)
        return state

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
            removed = rundir.remove_partial_checkpoints(self.ckpt_dir, quiet_s=1.0,
                                                        limit_s=15.0)
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
