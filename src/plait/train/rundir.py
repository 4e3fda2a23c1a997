"""The run directory as a place to write.

Before the first step it is made, proved writable and checked for room for a
checkpoint, so a wrong --run-dir, a read-only mount or a full disk is one line
and exit status 2 before any work. During the run, a write that fails (disk
full, quota, read-only, file-size limit) is recognised here, whether it comes
from Python (an OSError) or from orbax's C++ writer (an error whose text carries
the OS error code), so the loop can stop in one line naming the path and cause.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import sys
import time
from pathlib import Path

from plait import output_paths
from plait.config import Experiment
from plait.config_files import tomllib
from plait.errors import UserError

log = logging.getLogger("plait")

# The write failures the loop turns into one line, with what the user should do.
CAUSES = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EFBIG: "a file grew past the size limit (ulimit -f)",
    errno.EIO: "an input/output error",
}
_OS_CODE = re.compile(r"os_error_code='?(\d+)")
_QUOTED_PATH = re.compile(r'local file "([^"]+)"|Failed writing: "([^"]+)"')


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"


# What plait keeps in a run directory: True for a directory, False for a file.
ENTRIES = {"checkpoints": True, "tensorboard": True, "config.toml": False,
           "metrics.jsonl": False, "summary.json": False, "plait.lock": False,
           "plait.log": False}


def prepare(run_dir: Path) -> None:
    """Make `run_dir` and prove a file can be written, flushed and removed in it; the
    names plait writes there must not be taken by the other kind (a file `checkpoints`
    failed as NotADirectoryError inside orbax, a directory `metrics.jsonl` as
    IsADirectoryError after the resume read it)."""
    output_paths.directory(run_dir, "--run-dir")
    for name, is_dir in ENTRIES.items():
        path = run_dir / name
        if path.exists() and path.is_dir() != is_dir:
            raise UserError(f"'{path}' is a {'file' if is_dir else 'directory'}, where plait "
                            f"keeps its {'directory' if is_dir else 'file'} {name}; move it "
                            "away or pass another --run-dir")
    probe = run_dir / f".plait-write-test-{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise UserError(f"the run directory '{run_dir}' is not writable: "
                        f"{CAUSES.get(e.errno, e.strerror)}; fix it or pass another --run-dir"
                        ) from None
    finally:
        probe.unlink(missing_ok=True)


def check_room(run_dir: Path, checkpoint_bytes: int, keep: int) -> None:
    """Refuse a run whose first checkpoint cannot fit; warn when `keep` of them will not
    (orbax writes the new one before it removes the oldest)."""
    free = shutil.disk_usage(run_dir).free
    if free < checkpoint_bytes:
        raise UserError(f"the run directory '{run_dir}' has {_gib(free)} free but one "
                        f"checkpoint takes about {_gib(checkpoint_bytes)}; free space, pass "
                        "another --run-dir, or set checkpoint.enabled = false")
    if free < (keep + 1) * checkpoint_bytes:
        log.warning("the run directory %s has %s free, less than the %d checkpoints kept "
                    "(checkpoint.keep + 1 while saving) of about %s each; a save may fail",
                    run_dir, _gib(free), keep + 1, _gib(checkpoint_bytes))


def _chain(e: BaseException):
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def write_failure(err: BaseException) -> tuple[str, str | None] | None:
    """(cause, path) when `err` is a failed write of the kinds in CAUSES, else None."""
    for e in _chain(err):
        if isinstance(e, OSError) and e.errno in CAUSES:
            return CAUSES[e.errno], e.filename
        text = str(e)
        m = _OS_CODE.search(text)
        if m and int(m.group(1)) in CAUSES:
            p = _QUOTED_PATH.search(text)
            return CAUSES[int(m.group(1))], (p.group(2) or p.group(1)) if p else None
    return None


def remove_partial_checkpoints(ckpt_dir: Path, quiet_s: float = 0.0,
                               limit_s: float = 0.0) -> list[str]:
    """Remove the temporary directories of checkpoints that never committed (orbax
    renames a finished one to its step number); the caller holds the run's lock.

    After a failed or abandoned save, TensorStore's writes of the other arrays run on
    in its own threads and re-make the directories they write into. With `quiet_s`,
    removal repeats until that long passes with none re-made (at most `limit_s`)."""
    removed: list[str] = []
    deadline = time.monotonic() + limit_s
    quiet_since = time.monotonic()
    while True:
        found = []
        if ckpt_dir.is_dir():
            for p in ckpt_dir.iterdir():
                if p.is_dir() and ".orbax-checkpoint-tmp" in p.name:
                    shutil.rmtree(p, ignore_errors=True)
                    found.append(p.name)
        now = time.monotonic()
        if found:
            removed += [n for n in found if n not in removed]
            quiet_since = now
        if now - quiet_since >= quiet_s or now >= deadline:
            return removed
        time.sleep(0.05)


def committed_steps(ckpt_dir: Path) -> list[int]:
    """Steps whose checkpoint finished, newest first, read from the directory itself."""
    if not ckpt_dir.is_dir():
        return []
    return sorted((int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit()), reverse=True)


class _QuietFileHandler(logging.FileHandler):
    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        pass  # a full disk must not turn every later warning into a traceback


def open_log(run_dir: Path) -> logging.Handler:
    """RUN_DIR/plait.log: every warning and error of plait and the libraries (orbax's
    tracebacks, Python warnings), which the console does not show in full."""
    handler = _QuietFileHandler(run_dir / "plait.log", encoding="utf-8", delay=True)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    return handler


def close_log(handler: logging.Handler | None) -> None:
    if handler is not None:
        logging.getLogger().removeHandler(handler)
        with contextlib.suppress(OSError):  # its last flush, on the disk that failed
            handler.close()


@contextlib.contextmanager
def stderr_to(path: Path | None):
    """File descriptor 2 into `path` (appended; /dev/null if None or unwritable) for the
    duration: for output that native code writes past Python's logging."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        target = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if path \
            else os.open(os.devnull, os.O_WRONLY)
    except OSError:
        target = os.open(os.devnull, os.O_WRONLY)
    os.dup2(target, 2)
    os.close(target)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def kept_schedule(exp: Experiment, run_dir: Path) -> tuple[Experiment, str | None]:
    """The learning-rate rule for a run resumed with another train.steps: the schedule it
    was trained under is kept (decay_steps stays the run's, after which lr stays at
    lr x min_lr_ratio), unless optimizer.decay_steps is set. Without this, the decay
    would be re-stretched over the new length and the lr would jump back up."""
    path = Path(run_dir) / "config.toml"
    ckpts = Path(run_dir) / "checkpoints"
    if exp.optimizer.decay_steps is not None or not path.is_file() or not (
            ckpts.is_dir() and any(p.name.isdigit() for p in ckpts.iterdir())):
        return exp, None
    try:
        old = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return exp, None
    decay = old.get("optimizer", {}).get("decay_steps") or old.get("train", {}).get("steps")
    if not isinstance(decay, int) or decay == exp.train.steps:
        return exp, None
    kept = exp.model_copy(update={"optimizer": exp.optimizer.model_copy(
        update={"decay_steps": decay})})
    return kept, (f"plait: train.steps is now {exp.train.steps}; the learning-rate schedule "
                  f"keeps decay_steps = {decay}, the run's (set optimizer.decay_steps to "
                  "stretch it instead)")
