"""Where a training step's GPU time goes: `plait train --profile` over a window of
steps, the GPU's kernels summed by name and by kind (matrix products, attention,
copies, gathers and scatters, reductions, collectives, other fusions) per step, and
the host round trips (device-to-host copies: a while loop's condition or a cond's
predicate read by the host, the GPU idle until it answers), beside the step's own
time (the median of the steps before the traced ones, from metrics.jsonl): what the
kernels leave of it is time the GPU waited; inside the traced window, the gaps between
kernels by size (launches, a host behind the GPU, syncs) and the largest of them with
the kernels either side, which say where it waited. While a profiler is active XLA
runs command buffers' (CUDA graphs') kernels one by one, so the traced steps run as
launches, not graphs (yet the loop's steps ran 3.5-4% longer than traced ones on an H100,
and slower still with the graphs off: docs/benchmarks.md, "A fifth GPU session"). The step's
program is dumped as XLA:GPU optimized it (RUN_DIR/hlo), so the kernels' time is also
summed by the JAX operation that made them (`ops`, as `gpu_census.py` estimates it).
Small enough to keep under benchmarks/results/; the trace itself is hundreds of MB.

    python benchmarks/kernel_profile.py EXPERIMENT [--set K=V ...] [--steps 8 --window 5:7]
    python benchmarks/kernel_profile.py --trace RUN_DIR/profile   (a trace already taken)

A CPU run's trace has no GPU plane: the script says so in one line (status 2).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from report import report, run_script  # benchmarks/ is the script's directory

# The first pattern a kernel's name matches gives its kind (cuBLAS's Hopper kernels are
# nvjet_*, cuDNN's fused attention *sdpa* with its helper kernels).
KINDS = [
    ("attention", r"sdpa|flash|fmha|dot_do_o|convert_dq"),
    ("matmul", r"nvjet|gemm|cutlass|xmma|cublas|wgmma"),
    ("collective", r"nccl|all_reduce|all_gather|reduce_scatter|all_to_all|collective"),
    ("copy", r"^memcpy|^memset|copy"),
    ("gather/scatter", r"scatter|gather|dynamic_slice|dynamic_update_slice"),
    ("transpose", r"transpose"),
    ("reduction", r"reduce"),
    ("other fusion", r""),
]


def kind_of(kernel: str) -> str:
    return next(kind for kind, pattern in KINDS if re.search(pattern, kernel))


def summarize(profile, steps: int, top: int = 25, hlo_text: str | None = None) -> dict:
    """Per-step kernel time of the first GPU plane of a jax.profiler.ProfileData, by
    kind and by kernel, and its device-to-host copies per step; with the step's
    optimized HLO (`hlo_text`), by the JAX operation that made each kernel too."""
    planes = [p for p in profile.planes if re.match(r"/device:GPU:\d+$", p.name)]
    if not planes:
        from plait.errors import UserError

        raise UserError("the trace has no GPU plane (a CPU run?): kernel times are read "
                        "from a GPU's; open a CPU trace in TensorBoard or Perfetto")
    plane = planes[0]
    lines = list(plane.lines)
    streams = [x for x in lines if x.name.startswith("Stream")] or lines
    ns, calls = collections.Counter(), collections.Counter()
    by_hlo = collections.Counter()  # kernel time by the HLO instruction that launched it
    events = [e for line in streams for e in line.events]
    kernels = [e for e in events if "D2H" not in e.name]
    trips = len(events) - len(kernels)
    for e in kernels:
        ns[e.name] += e.duration_ns
        calls[e.name] += 1
        hlo_op = dict(e.stats).get("hlo_op")
        if hlo_op:
            by_hlo[str(hlo_op)] += e.duration_ns
    if not by_hlo:  # no instruction on the kernels: the derived line of XLA's ops has them
        for line in (x for x in lines if x.name == "XLA Ops"):
            for e in line.events:
                by_hlo[e.name] += e.duration_ns
    kinds = collections.Counter()
    for name, t in ns.items():
        kinds[kind_of(name)] += t
    ms = 1e-6 / steps
    ops = {"ops": by_op(by_hlo, op_names(hlo_text), steps, top)} if by_hlo and hlo_text else {}
    return {"device": plane.name, "steps": steps,
            "busy_ms_per_step": round(sum(ns.values()) * ms, 3),
            "host_round_trips_per_step": trips / steps,
            "kernels_per_step": sum(calls.values()) / steps,
            **idle_time(kernels, steps),
            **module_runs(lines),
            "kinds_ms_per_step": {k: round(v * ms, 3) for k, v in kinds.most_common()},
            "top": [{"kernel": name, "kind": kind_of(name), "ms_per_step": round(t * ms, 3),
                     "calls_per_step": calls[name] / steps}
                    for name, t in ns.most_common(top)], **ops}


# The train step's program as XLA:GPU optimized it, dumped beside the trace: its
# instructions' JAX operations (op_name metadata) turn kernel time by HLO instruction
# into kernel time by JAX operation, the census's `ops` measured.
HLO_DUMP_FLAGS = "--xla_dump_to={} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=jit_step"


def jax_op(op_name: str) -> str:
    """An instruction's op_name as the census and the profile both name it: less the
    jit's prefix, at most 100 characters (ops_compare.py joins the two on it)."""
    return re.sub(r"jit\([^)]*\)/", "", op_name)[:100]


def op_names(hlo_text: str) -> dict[str, str]:
    """Instruction name -> the JAX operation that made it."""
    return {m.group(1): jax_op(m.group(2)) for m in re.finditer(
        r'^\s*(?:ROOT\s+)?%?([\w.\-]+) = .*?op_name="([^"]*)"', hlo_text, re.MULTILINE)}


def by_op(by_hlo: collections.Counter, names: dict[str, str], steps: int,
          top: int) -> list[dict]:
    """Measured kernel time per step by JAX operation, largest first."""
    ops = collections.Counter()
    for hlo_op, t in by_hlo.items():
        ops[names.get(hlo_op, "(no op_name)")] += t
    return [{"op": op, "ms_per_step": round(t * 1e-6 / steps, 3)}
            for op, t in ops.most_common(top)]


def optimized_hlo(run_dir: Path) -> str | None:
    """The largest train-step module XLA dumped after optimizations under run_dir/hlo."""
    found = sorted((run_dir / "hlo").glob("*jit_step*after_optimizations.txt"),
                   key=lambda f: f.stat().st_size)
    return found[-1].read_text() if found else None


# Where a gap between kernels falls tells its cause: a few microseconds after most
# kernels is the launch of the next (the host ahead of the GPU), tens to hundreds after
# a short kernel is the host behind it, a millisecond or more a sync or a host's wait.
GAP_BUCKETS_US = [(0, 2), (2, 10), (10, 100), (100, 1000), (1000, float("inf"))]


def idle_time(kernels, steps: int, largest: int = 8, short_us: float = 5.0) -> dict:
    """The GPU's idle time inside the traced window: the gaps between the union of the
    streams' kernels, per step by size, the largest with the kernels either side, and
    the kernels shorter than `short_us` (those a launch costs as much as they run)."""
    spans = sorted((e.start_ns, e.end_ns, e.name) for e in kernels)
    if not spans:
        return {}
    gaps, end, before = [], spans[0][1], spans[0][2]
    for start, stop, name in spans[1:]:
        if start > end:
            gaps.append((start - end, before, name))
        if stop > end:
            end, before = stop, name
    buckets = {}
    for lo, hi in GAP_BUCKETS_US:
        inside = [g for g, _, _ in gaps if lo * 1e3 <= g < hi * 1e3]
        label = f"{lo}-{hi} us" if hi != float("inf") else f">={lo} us"
        buckets[label] = {"gaps_per_step": round(len(inside) / steps, 1),
                          "ms_per_step": round(sum(inside) * 1e-6 / steps, 4)}
    short = [e.duration_ns for e in kernels if e.duration_ns < short_us * 1e3]
    return {"span_ms_per_step": round((end - spans[0][0]) * 1e-6 / steps, 3),
            "idle_ms_per_step": round(sum(g for g, _, _ in gaps) * 1e-6 / steps, 4),
            "idle_by_gap": buckets,
            "largest_gaps": [{"us": round(g * 1e-3, 1), "after": a, "before": b}
                             for g, a, b in sorted(gaps, reverse=True)[:largest]],
            f"kernels_under_{short_us:g}us_per_step": {
                "count": len(short) / steps, "ms": round(sum(short) * 1e-6 / steps, 4)}}


def module_runs(lines) -> dict:
    """Each run of an XLA program on the GPU in the window (the derived "XLA Modules"
    line: a step is one run of the train step's program), its span and the GPU's gap
    since the run before: whether the window's steps ran alike, and back to back."""
    modules = [x for x in lines if x.name == "XLA Modules"]
    if not modules:
        return {}
    runs, last_end = [], None
    for e in sorted(modules[0].events, key=lambda e: e.start_ns):
        runs.append({"module": e.name, "ms": round(e.duration_ns * 1e-6, 3),
                     "after_gap_ms": None if last_end is None
                     else round((e.start_ns - last_end) * 1e-6, 3)})
        last_end = e.end_ns if last_end is None else max(last_end, e.end_ns)
    return {"module_runs": runs}


def read_trace(directory: Path):
    from jax.profiler import ProfileData

    from plait.errors import UserError

    found = sorted(directory.glob("**/*.xplane.pb"))
    if not found:
        raise UserError(f"no *.xplane.pb under {directory}: give the profile directory "
                        "`plait train --profile` wrote (RUN_DIR/profile)")
    return ProfileData.from_file(str(found[-1]))


def step_ms(run_dir: Path, before: int) -> float | None:
    """The median step time (ms) of steps 2..before in the run's metrics.jsonl: after
    the compiling first step, before the traced ones (a trace slows its steps)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    times = [r["step_time_s"] for r in rows if 2 <= r.get("step", 0) <= before
             and "step_time_s" in r]
    return round(statistics.median(times) * 1e3, 3) if times else None


def window(text: str) -> tuple[int, int]:
    try:
        start, stop = (int(v) for v in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}': give START:STOP, e.g. 5:7") from None
    if not 0 <= start < stop:
        raise argparse.ArgumentTypeError(f"'{text}': need 0 <= START < STOP")
    return start, stop


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("experiment", nargs="?")
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--window", type=window, default=(5, 7),
                    help="steps START+1..STOP are traced (default 5:7)")
    ap.add_argument("--trace", type=Path, help="summarise this profile directory instead")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json")
    args = ap.parse_args()
    start, stop = args.window
    if args.trace is None:
        if not args.experiment or args.steps < stop:
            ap.error("give an EXPERIMENT (or --trace DIR) and --steps >= the window's STOP")
        run_dir = Path(tempfile.mkdtemp(prefix="plait-profile-"))
        cmd = [sys.executable, "-m", "plait", "train", args.experiment, "--run-dir",
               str(run_dir), "--steps", str(args.steps), "--profile", f"{start}:{stop}",
               "--set", "log.every_steps=1", *(x for s in args.sets for x in ("--set", s))]
        # the step compiled, not read from JAX's cache (whose key leaves the dump flags
        # out): XLA dumps only what it compiles
        env = dict(os.environ, JAX_ENABLE_COMPILATION_CACHE="false")
        env["XLA_FLAGS"] = " ".join(
            x for x in (env.get("XLA_FLAGS", ""), HLO_DUMP_FLAGS.format(run_dir / "hlo")) if x)
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if done.returncode:
            sys.stderr.write(done.stderr[-3000:])
            return done.returncode
        args.trace = run_dir / "profile"
    result = summarize(read_trace(args.trace), stop - start, args.top,
                       optimized_hlo(args.trace.parent))
    step = step_ms(args.trace.parent, start)
    waited = None if step is None else round(step - result["busy_ms_per_step"], 3)
    report({"date": time.strftime("%Y-%m-%d"), "experiment": args.experiment,
            "sets": args.sets, "window": f"{start}:{stop}", "step_ms": step,
            "gpu_waited_ms_per_step": waited, **result}, args.json)
    return 0


if __name__ == "__main__":
    run_script(main)
