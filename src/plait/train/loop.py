"""The training loop: resume, run steps, log, checkpoint, stop cleanly on SIGTERM."""

from __future__ import annotations

import json
import signal
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh

from plait import mesh as mesh_lib
from plait.checkpoint import Checkpoints
from plait.config import Experiment
from plait.data.clicks import HELD_OUT
from plait.hardware import peak_flops
from plait.models import flops_per_token
from plait.train.build import make_job
from plait.train.metrics import MetricsLog, StepTimer, auc


class StopFlag:
    """Set by SIGTERM/SIGINT; the loop checkpoints at the next step boundary and exits."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._old = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C stops at once
        self.signal = signum

    def restore(self) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


def _local_values(tree):
    """Host values of replicated metrics; works when the mesh spans several processes."""
    return jax.tree.map(lambda x: np.asarray(x.addressable_shards[0].data), tree)


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


def train(exp: Experiment, mesh: Mesh, run_dir: Path) -> dict:
    """Train `exp` on `mesh` in `run_dir`, resuming from its newest checkpoint."""
    run_dir = Path(run_dir)
    is_writer = jax.process_index() == 0
    job = make_job(exp, mesh)
    source = job.source()
    total = exp.train.steps
    ckpt_dir = run_dir / "checkpoints"
    resolved = exp.model_copy(update={"mesh": dict(mesh.shape)})

    # Every process makes the same orbax calls (they synchronise across processes).
    ckpts = None
    if exp.checkpoint.enabled or ckpt_dir.exists():
        ckpts = Checkpoints(ckpt_dir, exp.checkpoint.keep, exp.checkpoint.async_save)
        ckpts.check_model(exp.model.model_dump(), run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)

    restored = ckpts.restore_latest(job.canonical_layout.abstract()) if ckpts else None
    if restored is not None:
        state, meta = restored
        state = job.from_checkpoint(state)
        start = int(meta["step"])
    else:
        state, start = job.init_state(), 0
    log = MetricsLog(run_dir, start, total, exp.log.tensorboard, exp.log.console, is_writer)
    mesh_text = mesh_lib.inline(dict(mesh.shape))
    n_params = job.num_params()
    log.note(
        f"plait: {exp.name}: {n_params / 1e6:.2f}M parameters, mesh {mesh_text} "
        f"({mesh.devices.size} {mesh.devices.flat[0].platform} devices), run dir {run_dir}"
    )
    if restored is not None:
        log.note(f"plait: resumed from the checkpoint at step {start}")
    if hasattr(job, "describe_tables"):
        log.note(job.describe_tables(state))
    if start >= total:
        log.note(f"plait: already trained to step {start} of {total}; nothing to do "
                 "(raise --steps to continue)")
        log.close()
        if ckpts:
            ckpts.close()
        return {"steps_run": 0, "final_step": start, "records": []}
    if is_writer:
        write_config(run_dir, resolved, start)

    log.note("plait: compiling the train step ...")
    t0 = time.perf_counter()
    compiled = job.compile()
    compile_s = time.perf_counter() - t0
    log.note(f"plait: step compiled in {compile_s:.1f}s")

    device = mesh.devices.flat[0]
    peak = peak_flops(device.device_kind, exp.precision.compute)
    flops_tok = flops_per_token(exp.model)
    n_dev = mesh.devices.size

    rate_key = f"{job.unit}_per_s"

    def throughput(step_time: float) -> tuple[float, float | None]:
        """Tokens (or samples) per second and MFU (None where the device's peak or the
        model's FLOPs are unknown)."""
        tps = job.units_per_step / step_time
        return tps, (flops_tok * tps / (n_dev * peak)) if peak and flops_tok else None

    evaluate = getattr(job, "eval_fn", None) if exp.data.eval_batches else None
    held_out, held_out_labels = [], None
    if evaluate is not None:
        steps = [HELD_OUT + i for i in range(exp.data.eval_batches)]
        held_out = [job.batch(source, k) for k in steps]
        # Every process scores the whole held-out set; its labels are read once, on the host.
        held_out_labels = np.concatenate(
            [source.rows(k, 0, exp.train.global_batch)["labels"] for k in steps])

    def held_out_auc() -> float:
        """AUC of the current model on the held-out batches."""
        scores = [_local_values(evaluate(state, b)) for b in held_out]
        return auc(held_out_labels, np.concatenate(scores))

    stop = StopFlag()
    stop.install()
    timer = StepTimer()
    every = exp.log.every_steps
    ckpt_every = exp.checkpoint.every_steps
    last_saved = start if restored is not None else None
    step_times: list[float] = []

    resolved_json = json.loads(resolved.model_dump_json())

    def meta_for(step: int) -> dict:
        return {"step": step, "mesh": mesh_text,
                "data": {"source": exp.data.source, "seed": exp.seed, "next_step": step,
                         "samples_seen": step * exp.train.global_batch},
                "config": resolved_json}

    def save(step: int) -> None:
        nonlocal last_saved
        if ckpts is not None and last_saved != step:
            ckpts.save(step, job.to_checkpoint(state), meta_for(step))
            last_saved = step

    prefetch = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plait-data")
    batch_of = lambda k: job.batch(source, k)
    next_batch = prefetch.submit(batch_of, start)
    wall0 = time.perf_counter()
    step = start
    try:
        timer.lap(step)
        while step < total:
            batch = next_batch.result()
            if step + 1 < total:
                next_batch = prefetch.submit(batch_of, step + 1)
            state, metrics = compiled(state, batch)
            step += 1
            if step % every == 0 or step == total or step == start + 1:
                metrics = _local_values(metrics)
                dt = timer.lap(step)
                record = {"step": step, "loss": float(metrics["loss"]),
                          "lr": float(metrics["lr"]), "grad_norm": float(metrics["grad_norm"])}
                if dt is not None:
                    step_times.append(dt)
                    tps, mfu = throughput(dt)
                    record.update(step_time_s=dt, mfu=mfu, **{rate_key: tps})
                if held_out:
                    record["auc"] = held_out_auc()
                log.write(record)
            if ckpt_every and step % ckpt_every == 0 and exp.checkpoint.enabled:
                save(step)
            if stop.signal is not None:
                break
    finally:
        stop.restore()
        prefetch.shutdown(wait=True, cancel_futures=True)

    preempted = stop.signal is not None and step < total
    if exp.checkpoint.enabled or preempted:
        save(step)
    if ckpts:
        ckpts.wait()
        ckpts.close()
    wall = time.perf_counter() - wall0
    median_dt = statistics.median(step_times) if step_times else None
    tps, mfu = throughput(median_dt) if median_dt else (None, None)
    summary = {
        "steps_run": step - start,
        "final_step": step,
        "final_loss": log.history[-1]["loss"] if log.history else None,
        "compile_s": compile_s,
        "wall_s": wall,
        "median_step_time_s": median_dt,
        rate_key: tps,
        "preempted": preempted,
        "checkpoint_step": last_saved,
        "records": log.history,
    }
    if mfu is not None:
        summary["mfu"] = mfu
    if is_writer:
        (run_dir / "summary.json").write_text(
            json.dumps({k: v for k, v in summary.items() if k != "records"}, indent=2) + "\n")
    log.close()  # the progress bar ends before the summary line
    how = "stopped by signal" if preempted else "done"
    final = summary["final_loss"]
    log.note(
        f"plait: {how} at step {step}/{total}: loss {final:.4f}, "
        f"{summary[rate_key] or 0:,.0f} {job.unit}/s (median), {wall:.1f}s wall"
        + (f", held-out AUC {log.history[-1]['auc']:.4f}" if "auc" in log.history[-1] else "")
        + (f", checkpoint at step {last_saved}" if last_saved is not None else "")
        if final is not None else f"plait: {how} at step {step}/{total}"
    )
    return summary
