"""The sweep's cost model: a predicted step time and memory per device on target hardware.

Per step, per device:
- compute = matmul FLOPs / (peak FLOP/s of the compute dtype x efficiency), plus
  the task's memory traffic (a DLRM's row gathers and updates) at the memory
  bandwidth;
- each collective = count x latency steps (2 log2 g for an all-reduce over g
  devices, log2 g for a gather or scatter) x latency + ring wire bytes / bandwidth of
  the links its group crosses (within a node, or across nodes: the compile
  lays the mesh over the hardware's nodes, outer axes across them, and reads
  which groups span several); bf16 collectives count at 2 bytes per element on
  accelerators (the CPU compile runs them in fp32), except over the batch axes
  (data, fsdp), which carry the fp32 master parameters and gradients;
- no overlap of compute and communication;
- a pipeline multiplies the busy time by 1 + its bubble_ratio from the
  schedule table;
- a fixed cost per step and per kernel the step launches (the compiled
  program's kernel count): zero until `plait sweep --run` measures some shapes
  and `calibrate` fits the two to what they took (small models are all
  overhead: the quickstart's predicted 6 ms was 24 ms measured on 2 cores);
- a shape fits if arguments + outputs + temporaries - aliases <= device memory.
"""

from __future__ import annotations

import math

from plait import analysis
from plait import mesh as mesh_lib
from plait.config import Experiment
from plait.hardware import Hardware
from plait.sweep.compiled import between, groups_of
from plait.sweep.shapes import Candidate


def _log2(g: int) -> int:
    return max(1, math.ceil(math.log2(g))) if g > 1 else 0


# Latency steps of one collective over g devices: recursive halving / doubling
# (Rabenseifner; Thakur et al. 2005), which NCCL's and MPI's tree-like algorithms
# approach, moves the ring's bytes in log2(g) steps a phase, where a ring takes g - 1:
# small collectives (a step's scalar metrics) cost log2(g) latencies, not g.
LATENCY_STEPS = {"all-reduce": lambda g: 2 * _log2(g), "all-gather": _log2,
                 "reduce-scatter": _log2, "all-to-all": lambda g: g - 1,
                 "collective-permute": lambda g: 1}


def collective_time(kind: str, group: int, count: float, wire_bytes: float, cross: bool,
                    hw: Hardware, width: float = 1.0) -> float:
    """Seconds of `count` ring collectives moving `wire_bytes` in all, within a node or
    across nodes (`cross`)."""
    bw = hw.inter_node_bandwidth if cross else hw.intra_node_bandwidth
    lat = hw.inter_node_latency if cross else hw.intra_node_latency
    return count * LATENCY_STEPS.get(kind, lambda g: g - 1)(int(group)) * lat + (
        wire_bytes * width / bw)


# Collectives over these axes only move parameters and gradients (fp32 master copies),
# whatever the compute dtype.
FP32_AXES = frozenset({"data", "fsdp"})
# The context and expert axes split tokens like a batch axis: their all-reduces sum fp32
# weight gradients (the expert axis's all-to-alls, or a dropless model's all-gathers and
# reduce-scatters, carry tokens in the compute dtype). The
# context axis's gathers and ring sends carry keys and values in the compute dtype (the
# ring's key/value gradients travel in fp32 and are priced at the compute width: at most
# 2C / (4C - 2) of its bytes, under by 2x in bf16).
GRADIENT_AXES = FP32_AXES | {"context", "expert"}


def collective_width(exp: Experiment, hw: Hardware, compiled_on: str = "cpu") -> float:
    """Bytes on `hw` per compiled byte of an activation collective: a bf16 run's are 2
    bytes an element on an accelerator, but a CPU compile runs them in fp32."""
    accelerator = hw.extra.get("device") != "cpu" and not hw.shared_compute
    return 0.5 if (exp.precision.compute == "bfloat16" and accelerator
                   and compiled_on == "cpu") else 1.0


def comm_by_link(groups: dict, hw: Hardware, width: float) -> dict[str, dict[str, float]]:
    """{"within_host" | "across_hosts": {"s": seconds, "wire": wire bytes}} of the
    step's collectives (`groups_of`) on `hw`, each at the link it crosses as compiled
    (a sweep compiles every shape laid over the hardware's nodes)."""
    out = {link: {"s": 0.0, "wire": 0.0} for link in analysis.LINKS}
    for (kind, axes, g, cross), (count, nbytes) in groups.items():
        axis_list = [a for a in axes.split(",") if a]
        fp32 = axis_list and (set(axis_list) <= FP32_AXES or (
            kind == "all-reduce" and set(axis_list) <= GRADIENT_AXES))
        w = 1.0 if fp32 else width
        link = out[analysis.LINKS[cross]]
        link["s"] += collective_time(kind, g, count, nbytes, cross, hw, w)
        link["wire"] += nbytes * w
    return out


def link_times(ops: list[dict], hw: Hardware, width: float = 1.0) -> dict[str, float]:
    """Seconds per link class of an analysis's collective ops (plait inspect)."""
    return {k: v["s"] for k, v in comm_by_link(groups_of(ops), hw, width).items()}


def predict(exp: Experiment, c: Candidate, measured: dict, hw: Hardware, n: int) -> dict:
    """One result row: the candidate, its predicted time, memory and whether it fits."""
    width = collective_width(exp, hw)
    compute = measured["flops"] / (hw.peak(exp.precision.compute, n) * hw.efficiency)
    links = comm_by_link(measured["groups"], hw, width)
    comm = sum(v["s"] for v in links.values())
    wire = sum(v["wire"] for v in links.values())
    bubble = measured["figures"]["bubble_ratio"] if measured.get("figures") else 0.0
    traffic = measured.get("row_traffic_bytes", 0.0) / hw.bandwidth(n)
    compute += traffic
    model_step = (compute + comm) * (1 + bubble)
    step = model_step
    extra = {"memory_traffic_s": traffic} if "row_traffic_bytes" in measured else {}
    if "embedding_kinds" in measured:
        extra["embedding_kinds"] = measured["embedding_kinds"]
    return {"mesh": c.mesh, **c.columns(), "settings": dict(c.settings),
            "varied": c.varied_settings, **extra,
            "tensor_mode": mesh_lib.tensor_mode(c.sizes) or "none",
            "flops_per_device": measured["flops"], "collective_bytes": wire,
            "collective_bytes_across_nodes": links["across_hosts"]["wire"],
            "compute_s": compute, "comm_s": comm,
            "comm_across_nodes_s": links["across_hosts"]["s"], "bubble_ratio": bubble,
            "predicted_step_s": step, "model_step_s": model_step,
            "kernels": measured.get("kernels"),
            "units_per_step": measured["units_per_step"],
            "predicted_units_per_s": measured["units_per_step"] / step,
            "memory_bytes": measured["memory"], "fits": measured["memory"] <= hw.memory(n)}


def predict_group(exp: Experiment, group: list[Candidate], compiled: dict[int, dict],
                  hw: Hardware, n: int) -> list[dict]:
    """Rows of candidates that differ only in their pipeline's microbatch count, from the
    figures `compiled` at some of the counts ({N: figures}: the fewest and the most,
    `shapes.anchors`); a count between them is interpolated (`compiled.between`)."""
    from plait.sweep.shapes import laid_out

    rows = []
    for c in group:
        N, held = c.microbatches, {}
        m = compiled.get(N)
        if c.pipeline:
            s, t = laid_out(exp, c)
            if m is None:
                lo, hi = min(compiled), max(compiled)
                ticks = [len(laid_out(exp, c, k)[1].table) for k in (lo, hi)]
                m = between(compiled[lo], compiled[hi],
                            (len(t.table) - ticks[0]) / (ticks[1] - ticks[0]),
                            (1 / N - 1 / lo) / (1 / hi - 1 / lo))
            m = dict(m, figures=s.figures)
            # What the compiled executor holds, per rank (its memory is the largest).
            held = {"stash_slots_per_rank": t.held["stash"], "keep_slots_per_rank": t.held["keep"]}
        rows.append({**predict(exp, c, m, hw, n), **held})
    return rows


def _nonnegative_fit(x, y):
    """Least squares with every coefficient >= 0: the best of the plain fits over each
    subset of x's columns whose coefficients all come out >= 0 (exact for a few columns)."""
    import itertools

    import numpy as np

    best, coef = np.inf, np.zeros(x.shape[1])
    for k in range(1, x.shape[1] + 1):
        for cols in itertools.combinations(range(x.shape[1]), k):
            c = np.linalg.lstsq(x[:, cols], y, rcond=None)[0]
            err = float(np.sum((x[:, cols] @ c - y) ** 2))
            if np.all(c >= 0) and err < best:
                best, coef = err, np.zeros(x.shape[1])
                coef[list(cols)] = c
    return coef


def calibrate(rows: list[dict]) -> dict | None:
    """Fit overheads (each >= 0) to the rows `--run` measured and add them to every row's
    prediction: per step, per kernel the step launches, and per pipelined step (the
    executor's loop of ticks costs more than its kernels: 20 ms a step on the 2-core CPU
    with 8 simulated devices, whatever the microbatch count; fitted only when two or
    more pipelined and two or more other shapes were measured). Returns the fit, or None
    with nothing measured."""
    import numpy as np

    done = [r for r in rows if r.get("measured_step_s")]
    if not done:
        return None
    y = np.array([r["measured_step_s"] - r["model_step_s"] for r in done], float)
    k = np.array([r["kernels"] for r in done], float)
    piped = np.array([bool(r.get("pipeline_schedule")) for r in done], float)
    by_kernels = bool(len(done) >= 2 and np.ptp(k) > 0)
    by_pipelines = bool(min(piped.sum(), len(done) - piped.sum()) >= 2)
    x = np.stack([np.ones_like(y)] + [k] * by_kernels + [piped] * by_pipelines, axis=1)
    coef = iter(_nonnegative_fit(x, y))
    per_step = float(next(coef))
    per_kernel = float(next(coef)) if by_kernels else 0.0
    per_pipelined = float(next(coef)) if by_pipelines else 0.0
    for r in rows:
        r["overhead_s"] = (per_step + per_kernel * r["kernels"]
                           + (per_pipelined if r.get("pipeline_schedule") else 0.0))
        r["predicted_step_s"] = r["model_step_s"] + r["overhead_s"]
        r["predicted_units_per_s"] = (r["units_per_step"] / r["predicted_step_s"]
                                      if r["predicted_step_s"] else 0.0)
    return {"per_step_s": per_step, "per_kernel_s": per_kernel,
            "per_pipelined_step_s": per_pipelined, "measured_shapes": len(done)}
