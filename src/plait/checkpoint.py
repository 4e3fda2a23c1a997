"""Checkpoints with orbax: save asynchronously, restore the newest usable one, reshard on load.

A checkpoint holds the whole train state (step, parameters, optimizer state)
plus a JSON record of the step, the data position and the resolved config.
orbax writes each step into a temporary directory and renames it when it is
complete, so a run killed mid-save leaves nothing that looks finished; a
checkpoint that fails to load (corrupt files) is skipped with a warning in
favour of the previous one.
"""

from __future__ import annotations

import functools
import logging
import warnings
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from plait.config import ModelSection
from plait.errors import UserError

log = logging.getLogger("plait")


@functools.cache
def _one_replica_writes_each_shard() -> None:
    """In one process, each array shard is written from its first replica. orbax's
    default on CPU (replica-parallel) splits every replicated shard among its replicas
    with one eager slice per device, so that several hosts share the writing; in one
    process that is only dispatch work, in the pause a save takes out of training (a
    12-step resume test on 8 CPU devices, 7 saves: 11.2 s -> 6.9 s; docs/architecture.md,
    "Determinism, checkpoints and resume"). Restores read either layout (chunks of
    whole shards or of their slices). Across processes orbax keeps its default.
    Registered once for jax.Array in orbax's global registry, which its standard
    handler reads."""
    from orbax.checkpoint._src.metadata import array_metadata_store

    if jax.process_count() > 1:
        return
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)  # "overriding jax.Array": meant
    try:
        ocp.type_handlers.register_type_handler(
            jax.Array, ocp.type_handlers.ArrayHandler(
                use_replica_parallel=False, array_metadata_store=array_metadata_store.Store()),
            override=True)
    finally:
        absl.setLevel(level)


class Checkpoints:
    def __init__(self, directory: Path, keep: int, async_save: bool = True,
                 read_only: bool = False, save_concurrent_gb: float | None = None,
                 file_per_chunk: bool = False):
        """read_only: for readers beside a run that may be training (plait sample): nothing
        is created, renamed or cleaned up, and a restore may ask for a part of the saved
        state (the parameters without the optimizer's moments: a third of the memory
        with AdamW). save_concurrent_gb: at most this many GB of
        arrays copied out of jax and being written at once (orbax copies every array at
        once by default: twice the state in memory at the peak of a save); it must exceed
        the largest array. file_per_chunk (with save_concurrent_gb): each chunk of an array
        is its own file instead of a record in one OCDBT database per checkpoint; OCDBT
        holds a whole array's encoded chunks in memory until the array is committed (a
        1 GiB array: +1.02 GiB at the peak of its write, +0.27 GiB file per chunk; the
        import's peak, docs/benchmarks.md). Restores read either layout."""
        self.directory = Path(directory).absolute()
        self.read_only = read_only
        _one_replica_writes_each_shard()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            enable_async_checkpointing=async_save,
            create=not read_only,
            # The run holds the lock: any -tmp is stale (a reader leaves them alone).
            cleanup_tmp_directories=not read_only,
            read_only=read_only,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # StandardCheckpointHandler caps only the bytes being written; the PyTree
            # handler under it also caps the copies out of jax that wait to be written.
            self._limited = save_concurrent_gb is not None
            # The PyTree handler (under the Standard one) restores part of a tree.
            handlers = ({} if not (self._limited or read_only) else {"item_handlers": {
                "state": ocp.PyTreeCheckpointHandler(
                    use_ocdbt=not file_per_chunk,
                    save_concurrent_gb=save_concurrent_gb,
                    save_device_host_concurrent_gb=save_concurrent_gb),
                "meta": ocp.JsonCheckpointHandler()}})
            self.manager = ocp.CheckpointManager(
                self.directory, options=options,
                **(handlers or {"item_names": ("state", "meta")}))

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps(), reverse=True)

    def save(self, step: int, state: dict, meta: dict, chunk_bytes: int | None = None
             ) -> None:
        """chunk_bytes (with save_concurrent_gb): write each array in chunks of at most
        this many bytes, so that TensorStore encodes a chunk at a time, not a whole
        array (the import's peak; docs/benchmarks.md)."""
        if self._limited:
            save_args = None if chunk_bytes is None else jax.tree.map(
                lambda _: ocp.SaveArgs(chunk_byte_size=chunk_bytes), state)
            item = ocp.args.PyTreeSave(state, save_args=save_args)
        else:
            item = ocp.args.StandardSave(state)
        self.manager.save(step, args=ocp.args.Composite(state=item, meta=ocp.args.JsonSave(meta)),
                          force=True)

    def read_meta(self, step: int) -> dict:
        out = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(out["meta"])

    def record(self, step: int | None = None) -> dict:
        """The JSON record of `step` (default: the newest), which a restore is about to
        read; {} when there is none or it does not read (judged when restoring)."""
        steps = self.steps()
        step = steps[0] if step is None and steps else step
        if step not in steps:
            return {}
        try:
            return self.read_meta(step)
        except Exception:  # noqa: BLE001 - unreadable: the restore skips or refuses it
            return {}

    def check_model(self, model: ModelSection, run_dir: Path) -> None:
        """Refuse a run directory whose checkpoints come from another model kind or shape
        (the kind's `shape_keys`)."""
        model_cfg = model.model_dump()
        for step in self.steps():
            try:
                meta = self.read_meta(step)
            except Exception:
                continue  # judged (and skipped) when restoring
            saved = meta.get("config", {}).get("model", {})
            keys = ("kind", *model.shape_keys_now())
            diff = [k for k in keys if _has(saved, k) and _get(saved, k) != _get(model_cfg, k)]
            if diff:
                k = diff[0]
                raise UserError(
                    f"run directory '{run_dir}' holds checkpoints of a different model "
                    f"(model.{k} = {_get(saved, k)!r} there, {_get(model_cfg, k)!r} now); "
                    "use a new --run-dir or the original model settings"
                )
            return

    def restore_step(self, abstract_state: dict, step: int, flag: str = "--from-step"
                     ) -> tuple[dict, dict]:
        """The checkpoint of `step` (one of the kept ones), resharded; the newer ones are
        renamed `<step>.superseded` (kept, and out of the way of the steps run again)."""
        steps = self.steps()
        if step not in steps:
            kept = ", ".join(map(str, sorted(steps))) or "none"
            raise UserError(f"{flag} {step}: no checkpoint of step {step} in "
                            f"'{self.directory}'; the kept ones are: {kept}")
        out = self.manager.restore(step, args=ocp.args.Composite(
            state=self._restore_args(abstract_state), meta=ocp.args.JsonRestore()))
        state, meta = out["state"], dict(out["meta"])
        jax.block_until_ready(state)
        self._rename([s for s in steps if s > step], "superseded")
        return state, meta

    def _restore_args(self, abstract_state: dict):
        """A reader's restore takes the part of the state `abstract_state` names; a run's
        the whole of it."""
        if not self.read_only:
            return ocp.args.StandardRestore(abstract_state)
        return ocp.args.PyTreeRestore(
            abstract_state, partial_restore=True,
            restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_state))

    def restore_latest(self, abstract_state: dict) -> tuple[dict, dict] | None:
        """Newest checkpoint that loads, resharded onto `abstract_state`'s shardings."""
        steps = self.steps()
        unusable: list[int] = []
        reason = ""
        for step in steps:
            try:
                out = self.manager.restore(step, args=ocp.args.Composite(
                    state=self._restore_args(abstract_state),
                    meta=ocp.args.JsonRestore()))
                state, meta = out["state"], dict(out["meta"])
                jax.block_until_ready(state)
                self._move_aside(unusable)
                return state, meta
            except Exception as e:  # corrupt or unreadable: fall back
                reason = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
                unusable.append(step)
                if step != steps[-1]:  # the last one's reason goes into the error
                    log.warning("checkpoint at step %d in %s is unusable (%s); trying an "
                                "older one", step, self.directory, reason)
        if steps:
            fix = ("nothing can be read from this run; train it again into another "
                   "--run-dir" if self.read_only else "move the directory away to start "
                   "afresh")
            raise UserError(f"no usable checkpoint in '{self.directory}' (tried steps "
                            f"{', '.join(map(str, steps))}; step {steps[-1]}: {reason}); "
                            f"{fix}")
        return None

    def _move_aside(self, steps: list[int]) -> None:
        """Keep unusable checkpoints, renamed, so the resumed run can save those steps again."""
        self._rename(steps, "unusable")

    def _rename(self, steps: list[int], why: str) -> None:
        if jax.process_index() == 0 and not self.read_only:
            for step in steps:
                src = self.directory / str(step)
                dst = self.directory / f"{step}.{why}"
                n = 1
                while dst.exists():
                    dst = self.directory / f"{step}.{why}-{n}"
                    n += 1
                if src.exists():
                    src.rename(dst)
                    log.warning("moved the %s checkpoint aside to %s", why, dst)
        if steps:
            self.manager.reload()

    def saving(self) -> bool:
        """An asynchronous save still writing."""
        try:
            return bool(self.manager.is_saving_in_progress())
        except Exception:  # noqa: BLE001 - asked from a signal handler: never raise
            return False

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


def _get(config: dict, key: str):
    """config[key] for a dotted key ("moe.experts"); None where a table is absent."""
    for part in key.split("."):
        if not isinstance(config, dict):
            return None
        config = config.get(part)
    return config


def _has(config: dict, key: str) -> bool:
    return key.split(".")[0] in config
