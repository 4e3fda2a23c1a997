"""What a GPT runs on a device when its config says "auto": the attention kernel
(`model.attention`), scanned or unrolled blocks (`model.scan_layers`), the loss's and
the LayerNorms' kernels (`model.loss_kernel`, `model.norm_kernel`) and a mixture of
experts' grouped products (`model.moe.grouped`), each with the reason, and the start-up
lines that say them."""

from __future__ import annotations

from pathlib import Path

from plait.config import GPTConfig
from plait.data.tokens import resolve_row_start
from plait.errors import UserError
from plait.models import gpt_counts


def _nvidia(platform: str, device_kind: str) -> bool:
    return platform == "gpu" and "nvidia" in device_kind.lower()


def _cudnn_takes(head: int) -> bool:
    """Whether cuDNN's fused attention takes this head size (a multiple of 8, <= 128)."""
    return head % 8 == 0 and head <= 128


def _device_text(device) -> str:
    """"cpu", or "NVIDIA A100 (gpu)": a device as the refusals name it."""
    kind = device.device_kind
    return kind if kind == device.platform else f"{kind} ({device.platform})"


def attention_for(cfg: GPTConfig, compute: str, platform: str, device_kind: str,
                  document_mask: bool = False) -> tuple[str, str]:
    """(implementation, why) for `model.attention`: "auto" takes the fused cuDNN flash
    kernel of `jax.nn.dot_product_attention` where it applies (an NVIDIA GPU, bf16 compute,
    a head size cuDNN takes), XLA's attention otherwise. (JAX's own default chose XLA's
    unfused attention on an H100, 2.2x slower: docs/benchmarks.md, "GPU facts".) A run
    trained on "cudnn" is read with XLA's off an NVIDIA GPU (plait eval, sample, export;
    plait train refuses it there: check_attention)."""
    nvidia = _nvidia(platform, device_kind)
    if cfg.attention == "cudnn" and not nvidia:
        return "xla", f"model.attention = \"cudnn\", no cuDNN on {platform}"
    if cfg.attention != "auto":
        return cfg.attention, "model.attention"
    head = cfg.head_size
    if not nvidia:
        return "xla", f"auto: no fused kernel on {platform}"
    if compute != "bfloat16":
        return "xla", "auto: cuDNN flash attention needs bf16 compute"
    if document_mask:
        return "xla", "auto: a document mask (data.document_mask), which plait does not give "\
            "cuDNN's fused kernel"
    if not _cudnn_takes(head):
        return "xla", f"auto: head size {head} is not one cuDNN takes (a multiple of 8, <= 128)"
    return "cudnn", "auto: fused flash attention on an NVIDIA GPU"


# Up to this depth `scan_layers = "auto"` unrolls the blocks on a GPU: gpt2-1.3b's 64
# unrolled ran at 47.0% MFU on an H100 where the scanned step spent a fifth of its time
# stacking residuals (docs/benchmarks.md, "A third GPU session").
UNROLL_MAX_LAYERS = 64


def scan_for(cfg: GPTConfig, platform: str) -> tuple[bool, str]:
    """(scan?, why) for `model.scan_layers`. "auto" unrolls on a GPU up to
    UNROLL_MAX_LAYERS blocks: there XLA schedules and fuses across blocks, and the
    unrolled GPT-2 124M ran 20-30% faster than the scanned one on an H100
    (docs/benchmarks.md, "GPU facts"); the unrolled step's compile time grows with
    depth (52 s for 64 layers on an H100). Deeper models, CPUs (no speed gap measured,
    compile several times faster) and TPUs (where scanning is the norm, as in MaxText)
    scan."""
    if cfg.scan_layers != "auto":
        return bool(cfg.scan_layers), "model.scan_layers"
    if cfg.moe is not None and cfg.moe.every > 1:
        return False, "auto: unrolled, dense and expert layers alternate (moe.every > 1)"
    if platform == "gpu" and cfg.layers <= UNROLL_MAX_LAYERS:
        return False, f"auto: unrolled on a GPU up to {UNROLL_MAX_LAYERS} layers"
    if platform == "gpu":
        return True, f"auto: scanned on a GPU beyond {UNROLL_MAX_LAYERS} layers"
    return True, f"auto: scanned on {platform}"


def on_hopper(device) -> bool:
    """Whether `device` is a Hopper GPU (compute capability 9.0: H100, H200)."""
    return device.platform == "gpu" and getattr(device, "compute_capability", None) == "9.0"


def _pallas_obstacle(cfg: GPTConfig, compute: str, device, mesh_shape: dict[str, int]
                     ) -> tuple[str, str] | None:
    """(what, detail) that keeps `model.moe.grouped = "pallas"`'s kernels from running
    here, or None: they are Mosaic GPU kernels for sm_90 (Hopper), in bf16, with the
    products' dimensions multiples of 64, on rows that all belong to this rank's experts
    (no `expert` axis: parallel.grouped_pallas)."""
    if not on_hopper(device):
        capability = getattr(device, "compute_capability", None)
        return "device", (_device_text(device)
                          + (f", compute capability {capability}" if capability else ""))
    if compute != "bfloat16":
        return "compute", compute
    if mesh_shape.get("expert", 1) > 1:
        return "expert", str(mesh_shape["expert"])
    bad = [f"{k} = {v}" for k, v in (("model.d_model", cfg.d_model),
                                      ("the experts' d_ff", cfg.expert_d_ff)) if v % 64]
    return ("dims", ", ".join(bad)) if bad else None


# Why `model.moe.grouped = "auto"` takes the tiles, by obstacle (start-up line).
_AUTO_TILES = {"device": "not a Hopper GPU", "compute": "the Hopper kernels multiply in bf16",
               "expert": "an expert axis", "dims": "dimensions not multiples of 64"}


def grouped_for(cfg: GPTConfig, compute: str, device, mesh_shape: dict[str, int]
                ) -> tuple[GPTConfig, str]:
    """(cfg with `model.moe.grouped` as the program for `device` runs it, why). "auto"
    takes JAX's Pallas kernels where they run (a Hopper GPU, bf16, no expert axis: on an
    H200 mixtral-mini ran 0.743 of its dense twin's tokens/s on them, 0.665 on the
    tiles, docs/benchmarks.md) and the tiles elsewhere. "pallas" where its kernels
    cannot run (`plait inspect` or `sweep` on a CPU) is traced as the tiles, the same
    routing and FLOPs; `plait train` refuses it there (check_grouped)."""
    moe = cfg.moe
    if moe is None or moe.capacity_factor or moe.grouped not in ("auto", "pallas"):
        return cfg, "model.moe.grouped"
    obstacle = _pallas_obstacle(cfg, compute, device, mesh_shape)
    pick = "pallas" if obstacle is None else "tiles"
    if moe.grouped == "auto":
        why = "auto: a Hopper GPU" if obstacle is None else f"auto: {_AUTO_TILES[obstacle[0]]}"
    else:
        why = "model.moe.grouped" if obstacle is None else "pallas traced as the tiles here"
    return cfg.model_copy(update={"moe": moe.model_copy(update={"grouped": pick})}), why


KERNEL_KEYS = ("loss_kernel", "norm_kernel", "fp8_kernel")


def kernels_for(cfg: GPTConfig, device) -> tuple[dict[str, str], str]:
    """({"loss_kernel": ..., "norm_kernel": ..., "fp8_kernel": ...} as the step runs
    them, why). "auto" takes plait's Triton kernels on a Hopper GPU: on an H200
    (2026-11-27) gpt2-124m's step ran 62.68 -> 61.10 ms with the loss and norm kernels
    (loss alone 62.19, norms alone 61.32), gpt2-1.3b's 312.4 -> 310.0 ms, the losses
    equal; FP8's kernel is priced by the census only (gpt2-1.3b compiled for an H100:
    304.0 -> 266.7 ms, docs/benchmarks.md); other GPUs are unmeasured, and off a GPU
    only Pallas's interpreter would run them."""
    asked = {key: getattr(cfg, key) for key in KERNEL_KEYS}
    if "auto" not in asked.values():
        return asked, ", ".join(f"model.{key}" for key in KERNEL_KEYS)
    pick = "pallas" if on_hopper(device) else "xla"
    why = "auto: a Hopper GPU" if pick == "pallas" else "auto: XLA's off a Hopper GPU"
    return {key: pick if v == "auto" else v for key, v in asked.items()}, why


def check_kernels(cfg, device) -> None:
    """Refuse `model.loss_kernel` or `model.norm_kernel` = "pallas" off an NVIDIA GPU, in
    one line (their Triton kernels run there; elsewhere only Pallas's interpreter would,
    far slower than XLA)."""
    asked = [key for key in KERNEL_KEYS if getattr(cfg, key, "xla") == "pallas"]
    if not asked or (device.platform == "gpu" and getattr(device, "compute_capability", None)):
        return
    key = asked[0]
    raise UserError(f"model.{key} = \"pallas\" runs a Triton kernel on NVIDIA GPUs, not "
                    f"{_device_text(device)}; use model.{key} = \"auto\" (the kernel where it "
                    "runs, XLA's elsewhere) or \"xla\"")


def check_attention(cfg, compute: str, device) -> None:
    """Refuse `model.attention = "cudnn"` where cuDNN's fused kernel cannot run, in one
    line (JAX raised "cuDNN is not detected" from inside the step's trace)."""
    if getattr(cfg, "attention", "xla") != "cudnn":
        return
    fix = "; use model.attention = \"auto\" (cuDNN where it runs, XLA's elsewhere) or \"xla\""
    if not _nvidia(device.platform, device.device_kind):
        raise UserError(f"model.attention = \"cudnn\" runs cuDNN's fused attention on "
                        f"NVIDIA GPUs, not {_device_text(device)}{fix}")
    if compute != "bfloat16":
        raise UserError(f"model.attention = \"cudnn\" runs in bfloat16, not precision.compute "
                        f"= \"{compute}\"; set precision.compute = \"bfloat16\"{fix[1:]}")
    head = cfg.head_size
    if not _cudnn_takes(head):
        raise UserError(f"model.attention = \"cudnn\" takes a head size that is a multiple of "
                        f"8 up to 128, not {head}{fix}")


def check_grouped(cfg: GPTConfig, compute: str, device, mesh_shape: dict[str, int]) -> None:
    """Refuse `model.moe.grouped = "pallas"` where its kernels cannot run, in one line."""
    moe = cfg.moe
    if moe is None or moe.capacity_factor or moe.grouped != "pallas":
        return
    obstacle = _pallas_obstacle(cfg, compute, device, mesh_shape)
    if obstacle is None:
        return
    what, detail = obstacle
    fix = "; use model.moe.grouped = \"auto\" or \"tiles\""
    message = {
        "device": "runs JAX's grouped GEMM kernels for Hopper GPUs (compute capability "
                  f"9.0), not {detail}{fix}",
        "compute": f"multiplies in bfloat16, not precision.compute = \"{detail}\"{fix}, or "
                   "set precision.compute = \"bfloat16\"",
        "expert": f"runs without an expert axis (its kernels take only rows of this rank's "
                  f"experts; an expert axis of {detail} all-gathers every rank's){fix}, or "
                  "drop the expert axis",
        "dims": f"needs the experts' dimensions in multiples of 64, not {detail}{fix}",
    }[what]
    raise UserError(f"model.moe.grouped = \"pallas\" {message}")


def _dispatch(moe, why: str = "model.moe.grouped") -> str:
    """How a mixture of experts' tokens reach their experts, in words (and why, where
    "auto" chose)."""
    if moe.capacity_factor:
        return f"capacity factor {moe.capacity_factor:g}"
    if why != "model.moe.grouped":
        return f"{_dispatch(moe)} ({why})"
    if moe.grouped == "ragged_dot":
        return "dropless through jax.lax.ragged_dot"
    if moe.grouped == "pallas":
        return "dropless through JAX's Pallas grouped GEMM kernels (Hopper)"
    if not moe.bulk and not moe.spill:
        return "dropless, every row through the loop over tiles"
    batched = [f"{moe.bulk:g} x a balanced expert's rows batched"] if moe.bulk else []
    if moe.spill:
        batched.append(f"{'the tiles past them' if moe.bulk else 'tiles'} batched as a layer "
                       f"needs them (up to {moe.spill:g} x all rows) with their experts' "
                       "weights gathered")
    return f"dropless, {', '.join(batched)}, the rest through the loop over tiles"


def start_up_lines(task) -> list[str]:
    """The lines a run prints after its header: the kernel and layout chosen and why, how
    the loss is formed, a mixture of experts' routing, a context axis's split."""
    layers = "scanned" if task.exp.model.scan_layers else "unrolled"
    n = task.exp.model.loss_chunks
    loss = "" if n == 1 else (
        f"; loss in {n} pieces of {task.exp.model.seq_len // n} positions per sequence "
        "(model.loss_chunks)")
    m = task.exp.model
    in_kernels = []
    if m.norm_kernel == "pallas" and m.norm == "layernorm":  # RMS norms have no kernel
        in_kernels.append("the LayerNorms")
    if m.loss_kernel == "pallas":
        in_kernels.append("the loss")
    if m.fp8_kernel == "pallas" and m.fp8_history:
        in_kernels.append("the FP8 operands' quantisation")
    listed = ", ".join(in_kernels[:-1]) + (" and " if len(in_kernels) > 1 else "") + (
        in_kernels[-1] if in_kernels else "")
    kernels = (f"; {listed} in plait's Triton kernels ({task.kernels_why})"
               if in_kernels else "")
    out = [f"plait: attention {task.attention} ({task.attention_why}); layers {layers} "
           f"({task.scan_why}){loss}{kernels}"]
    d = task.exp.data
    if task.kept_only:
        out.append(f"plait: the loss counts the targets that {d.path}'s loss mask keeps "
                   "(the responses, not the prompts), its mean over each whole batch")
    if task.documents:
        out.append(f"plait: each token attends only to the earlier tokens of its own "
                   f"document (data.document_mask: the documents of {d.path}'s index)")
    if d.source == "tokens" and d.path and Path(d.path).is_file() \
            and resolve_row_start(d.path, d.row_start) == "document":
        out.append(f"plait: each row starts where a document of {d.path} starts "
                   f"(data.row_start = {d.row_start}) and runs on into the next ones")
    moe = task.exp.model.moe
    if moe is not None:
        m = task.exp.model
        sparse = m.sparse_count
        routing = _dispatch(moe, task.grouped_why)
        X = task.mesh.shape.get("expert", 1)
        where = (f"{moe.experts // X} per rank of the expert axis ({X}), "
                 + ("all-to-all" if moe.capacity_factor else
                    "tokens all-gathered across it, outputs reduce-scattered back")
                 if X > 1 else "all on every device")
        from plait.parallel.experts import recomputed_in_a_stage

        beside = () if moe.capacity_factor else recomputed_in_a_stage(
            dict(task.mesh.shape), task.rules)
        if beside:
            where += (f"; each pipeline stage's backward runs the experts' forward again "
                      f"({', '.join(beside)} beside the pipeline)")
        out.append(f"plait: mixture of experts in {sparse} of {m.layers} layers: "
                   f"{moe.experts} experts, {moe.top_k} per token, {routing}; {where}; "
                   f"{gpt_counts.active_matmul_params(m) / 1e6:.2f}M matmul weights active per "
                   "token (FLOPs and MFU count those)")
    C = task.mesh.shape.get("context", 1)
    if C > 1:
        out.append(f"plait: context axis {C}: {task.exp.model.seq_len // C} tokens of each "
                   f"sequence per rank, balanced causal order; attention "
                   f"{task.context_attention} ({task.context_why})")
    return out
