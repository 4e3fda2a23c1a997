"""The experiment schema: every key a user can write lives in one of the pydantic
models below, so the schema is the documentation (reading files, `--set` and the
one-line errors: plait.config_files)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import tomli_w
from pydantic import Field, SerializeAsAny, field_validator, model_validator

from plait import kinds
from plait.model_schema import (  # noqa: F401 - the schema's names, re-exported
    DLRMConfig,
    GPTConfig,
    LlamaConfig,
    ModelSection,
    NonNegFloat,
    NonNegInt,
    NonNegSteps,
    PosFloat,
    PosInt,
    RopeScaling,
    Section,
    Steps,
)

# An Adam / momentum decay rate: 1 or more never forgets (Adam's bias correction
# divides by 1 - b**t = 0: NaN on the first step).
DecayRate = Annotated[float, Field(ge=0, lt=1)]

# Seeds numpy's generators (non-negative) and JAX's keys (int64).
MAX_SEED = 2**63 - 1

# How an embedding table can be laid over devices (plait.parallel.embedding runs each).
TABLE_PLACEMENTS = ("table", "row", "column", "replicated")


class DataConfig(Section):
    # Where batches come from; each model kind names the sources it reads (the GPT:
    # synthetic, tokens; the DLRM: clicks, criteo (a TSV file), criteo_bin (a directory
    # made by `plait data criteo`)). Default: the kind's first.
    source: str | None = None
    path: str | None = None
    # Held-out data. GPT: a token file (like data.path) whose loss and perplexity are
    # logged; unset: no evaluation. DLRM on Criteo: the held-out day (a TSV file or a
    # converted directory, read as data.source reads data.path) that AUC is measured on;
    # unset: batches of the training data far past any step trained.
    eval_path: str | None = None
    dtype: Literal["uint16", "uint32"] = "uint16"
    # GPT token files: where a row starts. anywhere: at random offsets; document: where
    # a document of the file's index starts (plait data writes it for records), so each
    # row's first example is seen whole; auto: document for a file with a loss mask
    # (fine-tuning records), anywhere otherwise.
    row_start: Literal["auto", "anywhere", "document"] = "auto"
    # GPT token files with a document index: each token attends only to the earlier
    # tokens of its own document, not to the documents packed before it in its row.
    document_mask: bool = False
    # Synthetic streams: each token has this many possible successors.
    successors: PosInt = 4
    # DLRM: ids per embedding bag (the most, when ids_fixed is false: then 1..this).
    ids_per_lookup: PosInt = 1
    ids_fixed: bool = True
    # Synthetic clicks: how ids are drawn (power law: id popularity ~ 1 / rank^alpha).
    popularity: Literal["uniform", "powerlaw"] = "uniform"
    powerlaw_alpha: PosFloat = 1.05
    # Criteo TSV lines that do not parse: skip them (counted) or stop the run.
    malformed: Literal["skip", "stop"] = "skip"
    # Held-out batches scored at each evaluation (0 = no evaluation).
    eval_batches: NonNegInt = 2
    # Evaluate at the log steps that are multiples of this, and at the last step
    # (0 = at every log step).
    eval_every_steps: NonNegSteps = 0


class EmbeddingConfig(Section):
    """DLRM embedding tables: how each is laid over the mesh (plait.parallel.embedding)."""

    # For every table: auto (the planner decides), or one of TABLE_PLACEMENTS.
    sharding: Literal[("auto", *TABLE_PLACEMENTS)] = "auto"
    # Per-table overrides: table index (as a string) -> placement, e.g. {"0" = "row"}.
    overrides: dict[str, Literal[TABLE_PLACEMENTS]] = {}
    # Sparse optimizer of the tables (only looked-up rows change): sgd, row-wise
    # adagrad (one accumulator per row, as TorchRec and MLPerf) or adam on rows.
    optimizer: Literal["sgd", "adagrad", "adam"] = "sgd"
    lr: PosFloat | None = None  # default: optimizer.lr
    eps: PosFloat = 1e-8
    # The planner replicates tables up to this size (MiB with optimizer state).
    replicate_below_mib: NonNegFloat = 1.0
    # Memory per device for tables and state (GiB); 0 = the device's (on CPU: the
    # host's memory shared by its simulated devices).
    memory_gib: NonNegFloat = 0.0
    # On CPUs (Linux), keep the tables in 2 MiB pages: random row access over
    # gigabytes is bound by TLB misses in 4 KiB pages (plait.hugepages).
    huge_pages: bool = True


class TrainConfig(Section):
    steps: Steps = 100
    global_batch: PosInt = 8
    microbatches: PosInt = 1
    # A step whose loss or gradient norm is NaN/Inf: "stop" the run before anything of
    # that state is saved, or "skip" its update (the batch is consumed, the state kept)
    # and stop only after more than `max_skipped` such steps in a row.
    on_nonfinite: Literal["stop", "skip"] = "stop"
    max_skipped: PosInt = 10


class PipelineConfig(Section):
    """Used when the mesh has a `pipeline` axis larger than 1."""

    # One of plait.parallel.schedules.SCHEDULES (gpipe, 1f1b, interleaved, chimera, zb-h1).
    schedule: str = "1f1b"
    # Microbatches per step the pipeline splits the global batch into; 0 = pipeline size.
    microbatches: NonNegInt = 0
    # Stages per rank for the schedules that interleave them (v); 0 = the schedule's
    # default (interleaved: 2, the others 1).
    virtual_stages: NonNegInt = 0
    # Recompute each stage's forward in its backward instead of keeping residuals.
    recompute: bool = False

    @field_validator("schedule")
    @classmethod
    def _known_schedule(cls, name: str) -> str:
        from plait.parallel.schedules import SCHEDULES

        if name not in SCHEDULES:
            raise ValueError(f"unknown pipeline schedule; choose one of {', '.join(SCHEDULES)}")
        return name


class ContextConfig(Section):
    """Used when the mesh has a `context` axis larger than 1 (plait.parallel.context)."""

    # How attention reaches the keys and values of the other ranks' tokens: "ring"
    # passes each rank's block around the axis (ppermute, online softmax, blocks the
    # causal mask hides skipped); "allgather" gathers every key and value per layer.
    attention: Literal["ring", "allgather"] = "ring"


class OptimizerConfig(Section):
    name: Literal["adamw", "sgd", "adagrad"] = "adamw"
    lr: PosFloat = 3e-4
    warmup_steps: NonNegSteps = 0
    # The learning rate after warmup, each ending at lr * min_lr_ratio on step
    # decay_steps and staying there: "cosine"; "linear" (transformers' default for
    # fine-tuning); "wsd", warmup-stable-decay: lr held, then a linear cooldown over the
    # last `cooldown_fraction` of decay_steps (a run can be extended before its
    # cooldown without a bend in its lr); "constant": lr throughout, no decay.
    schedule: Literal["cosine", "linear", "wsd", "constant"] = "cosine"
    cooldown_fraction: Annotated[float, Field(gt=0, le=1)] = 0.2
    decay_steps: Steps | None = None
    # The last learning rate as a share of lr: at most lr itself.
    min_lr_ratio: Annotated[float, Field(ge=0, le=1)] = 0.1
    weight_decay: NonNegFloat = 0.1
    b1: DecayRate = 0.9
    b2: DecayRate = 0.95
    eps: PosFloat = 1e-8
    # Adagrad's accumulator of squared gradients starts here: optax's 0.1, or 0 as
    # torch.optim.Adagrad and the reference DLRM do (the DLRM experiments).
    adagrad_initial: NonNegFloat = 0.1
    grad_clip: NonNegFloat = 1.0


class SyncConfig(Section):
    """How data replicas agree. "allreduce": one model, gradients all-reduced every step.
    "easgd" (Sync EASGD) and "diloco": each data replica keeps its own model and
    optimizer state, takes `period` local steps with no gradient exchange, then meets a
    center model sharded over the data axis (plait.parallel.local_sgd)."""

    method: Literal["allreduce", "easgd", "diloco"] = "allreduce"
    period: Steps = 4  # EASGD's tau / DiLoCo's H: local steps between exchanges
    # EASGD's elasticity: each replica moves this share of the way to the center (past
    # it above 1; the center moves by beta = P * alpha)
    alpha: Annotated[float, Field(gt=0, le=1)] = 0.1
    outer_lr: PosFloat = 0.7  # DiLoCo's outer learning rate
    outer_momentum: DecayRate = 0.9  # DiLoCo's outer Nesterov momentum
    # "allreduce"'s gradient reduction: "hierarchical" reduces within each host first
    # (the data axis has parts across and within hosts: data=S@dcn,data=F), "flat" is
    # one all-reduce over data; "auto" is hierarchical wherever it applies.
    reduce: Literal["auto", "flat", "hierarchical"] = "auto"


class PrecisionConfig(Section):
    compute: Literal["float32", "bfloat16"] = "float32"
    # The decoder's dense matmuls (attention projections, MLPs): "default" computes
    # them in `compute`; "fp8" quantises inputs and weights to float8 e4m3 and their
    # output gradients to e5m2, each scaled by the largest magnitude of its last
    # `fp8_history` steps (delayed scaling; the state is checkpointed). Needs FP8
    # matrix units (compute capability 8.9+: Ada, Hopper, Blackwell). models.fp8.
    matmul: Literal["default", "fp8"] = "default"
    fp8_history: PosInt = 1024


class CheckpointConfig(Section):
    enabled: bool = True
    every_steps: NonNegSteps = 100
    keep: PosInt = 3
    async_save: bool = True


class LogConfig(Section):
    every_steps: Steps = 10
    tensorboard: bool = True
    console: Literal["auto", "bar", "line", "none"] = "auto"


class Experiment(Section):
    name: str = "experiment"
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] = 0
    # A subclass of ModelSection, chosen by the table's `kind` (plait.tasks).
    model: SerializeAsAny[ModelSection] = GPTConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    pipeline: PipelineConfig = PipelineConfig()
    context: ContextConfig = ContextConfig()
    embedding: EmbeddingConfig = EmbeddingConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    precision: PrecisionConfig = PrecisionConfig()
    sync: SyncConfig = SyncConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    log: LogConfig = LogConfig()
    # Default mesh of the experiment: axis name -> size (see plait.mesh).
    mesh: dict[str, int] | None = None

    @field_validator("mesh", mode="before")
    @classmethod
    def _sizes_only(cls, raw: Any) -> Any:
        if isinstance(raw, dict) and isinstance(raw.get("dcn"), dict):
            raise ValueError("an experiment's [mesh] holds axis sizes only; give the parts "
                             "across hosts with --mesh (data=2@dcn,fsdp=-1) or in a mesh "
                             "file's [mesh.dcn]")
        return raw

    @field_validator("model", mode="before")
    @classmethod
    def _model_of_its_kind(cls, raw: Any) -> Any:
        if isinstance(raw, dict):
            return model_class(raw.get("kind", "gpt")).model_validate(raw)
        return raw

    @model_validator(mode="after")
    def _source_of_the_model(self) -> Experiment:
        sources = self.model.data_sources
        if self.data.source is None:
            self.data.source = sources[0]
        elif self.data.source not in sources:
            raise ValueError(
                f"data.source = \"{self.data.source}\" is not read by a {self.model.kind} "
                f"model; use one of {', '.join(sources)}")
        return self

    @model_validator(mode="after")
    def _fp8_of_the_model(self) -> Experiment:
        """precision.matmul = "fp8" gives each dense matmul of the decoder its scaling
        state (model.fp8_history, which nothing else sets)."""
        fp8 = self.precision.matmul == "fp8"
        if "fp8_history" not in type(self.model).model_fields:
            if fp8:
                raise ValueError(f"precision.matmul = \"fp8\" applies to the decoders "
                                 f"(gpt, llama), not a {self.model.kind} model; use "
                                 "precision.matmul = \"default\"")
            return self
        want = self.precision.fp8_history if fp8 else 0
        if self.model.fp8_history not in (0, want):
            raise ValueError("model.fp8_history is set by [precision]: write matmul = "
                             "\"fp8\" and fp8_history there instead")
        if self.model.fp8_history != want:
            self.model = self.model.model_copy(update={"fp8_history": want})
        return self

    def to_toml(self) -> str:
        raw = self.model_dump(exclude_none=True)
        raw["model"].pop("fp8_history", None)  # derived from [precision]
        return tomli_w.dumps(raw)


def model_class(kind: str) -> type[ModelSection]:
    """The `[model]` schema of a model kind, from the kind registry."""
    return kinds.config_class(kind)
