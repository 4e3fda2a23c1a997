"""Compile plait's train step for an NVIDIA GPU that is not there, and say where its time
would go.

    python benchmarks/gpu_census.py EXPERIMENT [--set key=value ...] [--gpu h100|h200]
        [--top 25] [--program step|init] [--hlo FILE] [--json FILE]

With JAX's CUDA plugin installed (`pip install "jax[cuda13]"`; no GPU, driver or CUDA
toolkit needed), JAX compiles ahead of time for a GPU described by an XLA target
configuration (`jax.experimental.topologies`; `benchmarks/gpu_targets/*.txtpb`): XLA:GPU's
own layouts, fusions, library calls and schedule, without autotuning. The step compiled
is `plait train`'s for one device, with plait's XLA flags (plait/xla_flags.py), and what
"auto" settings take on that GPU (a Hopper target: the norm and loss Triton kernels since
2026-11-27; `--set model.norm_kernel="xla" --set model.loss_kernel="xla"` for the
figures before). Printed:
the compile time, the memory XLA plans for it (arguments + temporaries, against JAX's
default 75% of the GPU), and its kernels (`hlo_census`) by kind, by fusion group and
by the JAX operation that made them, each with a roofline time -- an estimate to
compare two programs by, not a measurement (docs/benchmarks.md, "Compiling for a GPU
without one", sets it beside measured steps) -- and how many are tiny (under a
megabyte, no product: free at the roofline, a few microseconds each on a GPU), by the
operation that made them (`tiny_ops`).
A lent GPU's 15 minutes buy a few measurements; this is how a change is weighed
before them.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

from report import report, run_script  # benchmarks/ is the script's directory

TARGETS = Path(__file__).resolve().parent / "gpu_targets"
# dense bf16 peak FLOP/s and memory bandwidth (bytes/s) of each target
GPUS = {"h100": (989.4e12, 3.35e12), "h200": (989.4e12, 4.8e12)}
SMS = {"h100": 132, "h200": 132}  # streaming multiprocessors of each target
JAX_DEFAULT_FRACTION = 0.75


def cuda_plugin() -> bool:
    """Whether JAX's CUDA plugin (any CUDA major version) is installed."""
    for version in (13, 12):
        try:
            if importlib.util.find_spec(f"jax_plugins.xla_cuda{version}"):
                return True
        except ModuleNotFoundError:  # no jax_plugins package at all
            return False
    return False


def compile_for_gpu(exp, gpu: str, program: str = "step"):
    """The jax Compiled `program` of `exp` on one `gpu` (a key of GPUS), compiled here:
    the train step, or "init", the program that makes a fresh run's state."""
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import AxisType, Mesh

    from plait.tasks import make_task
    from plait.train.state import init_program

    config = (TARGETS / f"{gpu}.txtpb").read_text()
    topology = topologies.get_topology_desc("plait", "cuda", target_config=config,
                                            topology="1x1x1")
    mesh = Mesh(np.array(topology.devices[:1]), ("data",), axis_types=(AxisType.Auto,))
    task = make_task(exp, mesh)
    if program == "init":
        return init_program(task._laid_out, task.tx, task.layout).lower(None).compile()
    with _pallas_sees(SMS[gpu]):
        return task.compile()


@contextlib.contextmanager
def _pallas_sees(sms: int):
    """JAX's transposed grouped GEMM kernel for Hopper (model.moe.grouped = "pallas") sizes
    its grid by `jax.devices()[0].core_count`, which a CPU device lacks: while the step is
    traced here, that module sees one device of the target's SM count."""
    try:
        from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu as kernel
    except ImportError:  # no Mosaic GPU in this JAX: nothing to show
        yield
        return
    import jax

    class SeenJax:
        def __getattr__(self, name):
            return getattr(jax, name)

        @staticmethod
        def devices(*args, **kw):
            return [SimpleNamespace(core_count=sms)]

    with mock.patch.object(kernel, "jax", SeenJax()):
        yield


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("experiment")
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--gpu", choices=sorted(GPUS), default="h100")
    ap.add_argument("--top", type=int, default=25, help="fusion groups printed")
    ap.add_argument("--sized-branch", type=int, default=0,
                    help="price a switch among data-chosen sizes (dropless experts' spill "
                         "tiles) at this size's index, not the first (0 tiles)")
    ap.add_argument("--program", choices=("step", "init"), default="step",
                    help="the train step, or the program that makes a fresh run's state "
                         "(its compile time is part of a run's start)")
    ap.add_argument("--hlo", help="write the optimized HLO here")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    from plait.errors import UserError

    if not cuda_plugin():
        raise UserError("JAX's CUDA plugin is not installed: pip install \"jax[cuda13]\" "
                        "(no GPU needed) to compile for a GPU here")
    # No GPU, so no CUDA libraries to check the versions of; plait's XLA flags, as
    # `plait train` sets them, before the backend starts.
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    from plait import xla_flags

    xla_flags.apply_defaults()
    import hlo_census

    from plait.config_files import load_experiment

    exp = load_experiment(args.experiment, args.sets)
    t0 = time.perf_counter()
    compiled = compile_for_gpu(exp, args.gpu, args.program)
    compile_s = time.perf_counter() - t0
    text = compiled.as_text()
    if args.hlo:
        Path(args.hlo).write_text(text)
    memory = compiled.memory_analysis()
    peak, bandwidth = GPUS[args.gpu]
    found = hlo_census.kernels(text, args.sized_branch)
    total = hlo_census.estimate(found, peak, bandwidth)
    planned = (memory.argument_size_in_bytes + memory.temp_size_in_bytes
               + memory.output_size_in_bytes - memory.alias_size_in_bytes) / 2**30
    size = float(next(line.split(":")[1] for line in (TARGETS / f"{args.gpu}.txtpb")
                      .read_text().splitlines() if "device_memory_size" in line)) / 2**30
    report({"experiment": exp.name, "sets": args.sets, "gpu": args.gpu,
            "program": args.program, "sized_branch": args.sized_branch,
            "compile_s": round(compile_s, 1), "planned_memory_gib": round(planned, 2),
            "fits_jax_default": planned <= JAX_DEFAULT_FRACTION * size,
            "kernels_per_step": round(sum(k.launches for k in found)),
            "tiny_kernels_per_step": hlo_census.tiny_launches(found),
            "estimated_step_ms": round(total * 1e3, 2),
            "kinds": hlo_census.by_kind(found),
            "groups": hlo_census.by_group(found, args.top),
            "ops": hlo_census.by_op(found, args.top),
            "tiny_ops": hlo_census.tiny_by_op(found, args.top)}, args.json)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    run_script(main)
