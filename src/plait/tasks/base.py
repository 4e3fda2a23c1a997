"""The Task interface: what a model kind gives the loop, inspect, the sweep and checkpoints.

A Task is one model kind on one mesh, built from an experiment after checking
that the two fit. Its state is a pytree of arrays laid out by `layout` (what
lives in memory) and `canonical_layout` (what checkpoints hold, the same for
every mesh, so a run resumes on another one); its step is one jitted function
(state, batch) -> (state, {"loss", "grad_norm", "lr"}).

Subclasses must provide `layout`, `init_state`, `step_fn`, `abstract_batch`,
`source`, `batch`, `units_per_step` and `num_params`; the rest has defaults.
The class-level `sweep_*` hooks let `plait sweep` enumerate and price mesh
shapes without building a Task per shape.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Protocol

import jax
from jax.experimental.compilation_cache import compilation_cache
from jax.sharding import Mesh

from plait.config import Experiment
from plait.train.state import StateLayout

Metrics = dict[str, float]


class Source(Protocol):
    """A deterministic data source: rows [start, stop) of the global batch of `step`."""

    def rows(self, step: int, start: int, stop: int) -> Any: ...


class Evaluator(Protocol):
    """Held-out metrics of a state (e.g. {"auc": 0.8}), computed on the task's mesh."""

    def __call__(self, state: dict) -> Metrics: ...


@contextlib.contextmanager
def _persistent_cache(allowed: bool):
    """Compile with JAX's persistent compilation cache on (as configured) or off.

    On this JAX (0.10.2), an XLA:CPU executable *loaded* from the persistent
    cache gives run-to-run different results for a pipeline whose stages nest the
    2-D / 2.5-D / 3-D tensor modes' shard_maps (a fresh compile of the same
    program is deterministic); see docs/architecture.md, "Determinism, checkpoints
    and resume". Such a step is compiled fresh instead, at the cost of its compile
    time.
    """
    if allowed or not jax.config.jax_enable_compilation_cache:
        yield
        return
    # JAX decides once per process whether the cache is in use; reset that decision.
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
        compilation_cache.reset_cache()


class Task(abc.ABC):
    """One model kind on one mesh (see the module docstring)."""

    # What `units_per_step` counts, as the logs name it: tokens, samples.
    unit: ClassVar[str] = "samples"
    # Mesh axes `plait sweep` factors the devices over (others stay 1).
    sweep_axes: ClassVar[tuple[str, ...]] = ("data", "fsdp")
    # Config keys that choose the optimizer state a checkpoint holds: a run resumed
    # with another value is refused (its state does not read as the other's).
    optimizer_keys: ClassVar[tuple[str, ...]] = ("optimizer.name",)

    @classmethod
    def sweep_axes_for(cls, exp: Experiment) -> tuple[str, ...]:
        """The axes `plait sweep` factors this experiment's devices over."""
        return cls.sweep_axes

    def __init__(self, exp: Experiment, mesh: Mesh):
        self.exp, self.mesh = exp, mesh

    # ------------------------------------------------------------------ state
    @property
    @abc.abstractmethod
    def layout(self) -> StateLayout:
        """Shapes and shardings of the state in memory."""

    @property
    def canonical_layout(self) -> StateLayout:
        """Shapes and shardings of the state in checkpoints (default: as in memory)."""
        return self.layout

    @abc.abstractmethod
    def init_state(self) -> dict:
        """A fresh state, created in its shards."""

    def to_checkpoint(self, state: dict) -> dict:
        """The state as checkpoints hold it (canonical_layout)."""
        return state

    def from_checkpoint(self, state: dict) -> dict:
        """A restored canonical state, laid out for this mesh."""
        return state

    # ------------------------------------------------------------------ step
    @property
    @abc.abstractmethod
    def step_fn(self) -> Callable:
        """jit(step)(state, batch) -> (state, {"loss", "grad_norm", "lr"}), state donated."""

    @abc.abstractmethod
    def abstract_batch(self) -> Any:
        """ShapeDtypeStructs (with shardings) of one batch, for ahead-of-time compiles."""

    def compile(self, compiler_options: dict | None = None):
        """Ahead-of-time compile of the step for the state and batch layouts."""
        lowered = self.step_fn.lower(self.layout.abstract(), self.abstract_batch())
        with _persistent_cache(not self.cache_unsafe()):
            return lowered.compile(compiler_options) if compiler_options else lowered.compile()

    def restore_plan(self, saved_config: dict) -> tuple[Any, Callable[[dict], dict], str | None]:
        """How to read a checkpoint written with `saved_config` (its resolved config):
        (abstract canonical state to restore, conversion to this run's canonical state,
        a one-line notice or None)."""
        return self.canonical_layout.abstract(), lambda state: state, None

    def cache_unsafe(self) -> bool:
        """Whether this step must not come from JAX's persistent compilation cache
        (see `_persistent_cache`)."""
        return False

    def branch_weights(self) -> dict[int, list[float]] | None:
        """How often each branch of a conditional in the step runs (plait.analysis)."""
        return None

    def branches_diverge(self) -> bool:
        """Whether ranks run different branches of the step's conditionals at the same
        time (a pipeline's per-tick switch): a collective inside one then waits for
        ranks that never reach it unless only the ranks taking that branch join it."""
        return False

    def memory_fixes(self) -> str:
        """What a user can change when the step does not fit the devices' memory (the
        end of the one-line refusal, plait.train.memory)."""
        return ("lower train.global_batch, or raise train.microbatches (the same batch "
                "in that many passes, gradients accumulated), or split the state over more "
                "devices (fsdp); plait sweep --devices N ranks the shapes that fit")

    def phases(self) -> dict[str, dict[int, list[float]]]:
        """Named kinds of step whose collectives differ (branch weights of each), for
        `plait inspect` to report apart; {} when every step is alike."""
        return {}

    # ------------------------------------------------------------------ data
    @abc.abstractmethod
    def source(self) -> Source:
        """The data source of the experiment (each process reads only its rows)."""

    @abc.abstractmethod
    def batch(self, source: Source, step: int) -> Any:
        """The global batch of `step`, sharded as `abstract_batch` says."""

    def evaluator(self, source: Source) -> Evaluator | None:
        """Held-out evaluation logged with the training metrics, or None."""
        return None

    def run_files(self, source: Source, run_dir: Path) -> dict[str, Path]:
        """Files the run directory keeps a copy of, by name (e.g. the tokenizer its token
        file was made with, which `plait sample` decodes with); a UserError where the data
        does not go with what `run_dir` already holds (asked before anything is written)."""
        return {}

    # ------------------------------------------------------------------ figures
    @property
    @abc.abstractmethod
    def units_per_step(self) -> int:
        """Tokens or samples one step trains on (for throughput)."""

    @abc.abstractmethod
    def num_params(self) -> int: ...

    def flops_per_unit(self) -> float | None:
        """Model FLOPs per trained unit, forward and backward (MFU); None if not defined."""
        return None

    def describe(self, state: dict) -> list[str]:
        """Lines the run log prints after its header (e.g. where the tables live); `state`
        may be the abstract one (layout.abstract()): a fresh state is made after the step
        compiles."""
        return []

    def state_notes(self) -> list[str]:
        """Lines about the state just made or restored (a DLRM's tables moving to 2 MiB
        pages)."""
        return []

    def placement_report(self) -> dict | None:
        """Where the task's largest state lives, worked out without compiling (`plait
        plan`: a DLRM's embedding tables); None where the sharding rules say it all."""
        return None

    def report(self, analysis: dict) -> dict:
        """Extra fields of `plait inspect`'s report, given the compiled step's analysis."""
        return {}

    # ------------------------------------------------------------------ sweep
    @classmethod
    def param_count(cls, cfg) -> int:
        """Parameters of a model of this kind from its config alone (no arrays built);
        may be a lower bound. Used to refuse what cannot fit before building it."""
        return 0

    @classmethod
    def batch_memory(cls, exp: Experiment) -> tuple[int, str, str]:
        """(bytes, what they are, what to change): a lower bound on what one microbatch
        takes on the whole mesh, from the config alone; 0 where the kind does not say.
        With param_count, it refuses a batch that cannot fit before anything is built
        (XLA cannot even compile some: a scatter of more than 2**31 rows)."""
        return 0, "", ""

    @classmethod
    def sweep_variants(cls, exp: Experiment, sizes: dict[str, int]) -> list[dict[str, Any]]:
        """The settings (dotted config keys) worth sweeping on a mesh of these sizes, e.g.
        pipeline schedules; [{}] for none. A UserError says why the sizes do not fit."""
        return [{}]

    @classmethod
    def sweep_programs(cls, exp: Experiment, sizes: dict[str, int]
                       ) -> tuple[list[Experiment], float | None]:
        """What to compile to price `exp`: ([exp], None) compiles it as is; ([a, b], t)
        compiles two cheaper experiments whose figures are linear in a size, with exp's
        figures at a + t (b - a) (e.g. a scanned model at two depths)."""
        return [exp], None

    def sweep_extras(self) -> dict:
        """Figures the sweep's cost model adds to the compiled ones (e.g. memory traffic)."""
        return {}
