"""What every benchmark script shares at its edges: the one way it hands back its
figures (JSON on stdout, and the same text in the file --json names; benchmarks/results/
keeps those), and the one way it ends (a mistake of the user's, or a run plait refuses,
as plait's own commands end it: one line, no traceback); and, for the memory scripts,
one plait command's peak memory on the code of this or another checkout."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent

# Run in a fresh interpreter per measurement: ru_maxrss of its children is then the
# one plait command's peak, not the largest of several.
_PEAK = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, "
         "stdout=subprocess.DEVNULL, stderr=subprocess.PIPE); "
         "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20)")


def peak_gib(tree: Path, argv: list[str], cwd: Path) -> tuple[float, float]:
    """(peak resident GiB, wall seconds) of `plait *argv` run on the code under `tree`."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _PEAK, sys.executable, "-m", "plait",
                          *argv], cwd=cwd, check=True, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(tree / "src")))
    return float(out.stdout.strip().splitlines()[-1]), time.perf_counter() - t0


def compare_parser(doc: str) -> argparse.ArgumentParser:
    """--rounds, --compare OLD_CHECKOUT (measured alternately with this one), --json."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compare", type=Path, help="another checkout, measured alternately")
    ap.add_argument("--json")
    return ap


def trees(args: argparse.Namespace) -> dict[str, Path]:
    """The checkouts measured: this one, and --compare's."""
    return {"this": HERE} | ({"compare": args.compare.resolve()} if args.compare else {})


def median_seconds(f: Callable[..., object], repeat: int,
                   fresh: Callable[[], object] | None = None, calls: int = 1) -> float:
    """Median wall seconds a call of f (JAX work) over `repeat` samples, after one sample
    that compiles and warms up. A sample is `calls` calls issued back to back and waited
    for once, divided by `calls`: for kernels of a fraction of a millisecond, where one
    wait per call adds the host's round trip to each (the norm kernel's 0.2 ms calls
    timed 0.92x and 1.05x XLA's in two runs on an H200, waited for one by one). With
    `fresh`, each call is f(fresh()) and only f is timed, one call a sample: for an f
    that consumes (donates) its input."""
    import statistics

    import jax

    if fresh is not None and calls != 1:
        raise ValueError("fresh inputs are made one call a sample (calls = 1)")

    def one() -> float:
        args = () if fresh is None else (jax.block_until_ready(fresh()),)
        t0 = time.perf_counter()
        for _ in range(calls):
            out = f(*args)
        jax.block_until_ready(out)
        return (time.perf_counter() - t0) / calls

    one()
    return statistics.median(one() for _ in range(repeat))


def nvidia_gpu(what: str):
    """The first device if it is an NVIDIA GPU; else a plait UserError, `what` ("the
    kernel runs") on an NVIDIA GPU, not this device: a kernel benchmark's one line."""
    import jax

    from plait.errors import UserError

    device = jax.devices()[0]
    if device.platform != "gpu":
        raise UserError(f"{what} on an NVIDIA GPU, not {device.device_kind}")
    return device


def failed_setting(name: str, setting: dict, error: Exception) -> dict:
    """A kernel's launch setting that would not compile or run: said in one line, and its
    record for the JSON (the benchmark goes on with the next setting)."""
    first = str(error).splitlines()[0] if str(error) else ""
    print(f"{name}: failed ({type(error).__name__}: {first[:120]})", flush=True)
    return {**setting, "error": first[:300]}


def best_setting(result: dict, runs: list[dict], xla_ms: float, took: Callable[[dict], float],
                 diff: str, tolerance: float, suffix: str = "") -> bool:
    """A kernel benchmark's verdict on its launch settings (runs: their records, a failed
    one has "error"): the fastest that ran, by took(record) in ms, recorded in `result`
    as "best" + suffix with its speed-up over XLA's xla_ms, and said; True, said too, if
    any setting's `diff` from XLA's values exceeds `tolerance`."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return False
    best = min(ok, key=took)
    result["best" + suffix] = best
    result["speedup_over_xla" + suffix] = xla_ms / took(best)
    print(f"best{suffix.replace('_', ' ')}: {best}, {xla_ms / took(best):.2f}x XLA's",
          flush=True)
    if max(r[diff] for r in ok) > tolerance:
        print(f"the kernel's values differ from XLA's by more than {tolerance:g}", flush=True)
        return True
    return False


def report(result: dict, json_path: str | Path | None) -> None:
    """Print `result` as indented JSON; with a path, write the same text there."""
    text = json.dumps(result, indent=2)
    print(text)
    if json_path:
        Path(json_path).write_text(text + "\n")


def json_of_own_process(script: str | Path, args: list[str], *, quiet: bool = False,
                        stdout=None) -> dict:
    """The JSON `script` (a benchmark) writes when run with `args` in a Python process of
    its own, as `plait train` runs: runs compared side by side each get a fresh process
    (docs/benchmarks.md, "An eighth GPU session"). `--json` goes last, so it wins over
    one in `args`. `quiet`: the run's output kept back, shown if it fails; `stdout`: as
    subprocess.run takes it. A run that fails ends this one with its status (a
    refusal's one line already said)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out_json = Path(tmp) / "run.json"
        done = subprocess.run([sys.executable, str(Path(script).resolve()), *args,
                               "--json", str(out_json)],
                              capture_output=quiet, stdout=stdout, text=True)
        if done.returncode:
            if quiet:
                sys.stdout.write(done.stdout[-2000:])
                sys.stderr.write(done.stderr[-3000:])
            raise SystemExit(done.returncode)
        return json.loads(out_json.read_text())


def run_script(main: Callable[[], int | None]) -> None:
    """Run a script's `main` and exit with its status; a plait UserError (a bad key, fp8
    asked of a CPU) ends in one line and status 2, as with `plait` itself
    (`plait.errors.reported`). A script stops at the first such error: a benchmark that
    refuses one of its runs has no figure to give."""
    from plait.errors import reported

    raise SystemExit(reported(Path(sys.argv[0]).name, main))
