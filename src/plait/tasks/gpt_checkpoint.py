"""How a decoder's train state lies on disk (GPTTask's checkpoint side): one entry per
layer whatever a pipeline or stacked layers do in memory, conversions both ways (the
parameters alone too, for readers), and how to read a checkpoint of another replica
count (sync.method) or precision.matmul."""

from __future__ import annotations

import functools

import jax

from plait import models, sharding
from plait.models import fp8
from plait.models.gpt import abstract_model
from plait.parallel import local_sgd
from plait.train.state import StateLayout, layout, map_params, optimizer


class DecoderCheckpoints:
    """The checkpoint side of GPTTask: it reads the task's exp, mesh, model, rules, layout,
    pipeline, stacked and local (set by GPTTask.__init__)."""

    @property
    def _converts(self) -> bool:
        """Whether memory and checkpoints lay the layers out differently."""
        return self.pipeline is not None or self.stacked

    @functools.cached_property
    def canonical_layout(self) -> StateLayout:
        """One entry per layer, whatever the pipeline or the stacked layers do in memory."""
        if not self._converts:
            return self.layout
        shapes, shardings = self._per_layer_params
        if self.local:
            return self.local.state_layout(shapes, shardings, optimizer(self.exp)[0])
        return layout(shapes, shardings, optimizer(self.exp)[0], self.mesh)

    @functools.cached_property
    def _per_layer_params(self) -> tuple[dict, dict]:
        return self._params_on_disk()

    def _params_on_disk(self, **model_update) -> tuple[dict, dict]:
        """(shapes, shardings) of the parameters as a checkpoint holds them, one entry per
        layer (with `model_update`: of a model with those settings changed)."""
        per_layer = abstract_model(self.exp.model.model_copy(
            update={"scan_layers": False, **model_update}))
        return (per_layer.shapes(),
                sharding.param_shardings(per_layer.variables(), self.mesh, self.rules))

    def restore_plan(self, saved_config: dict):
        plan = local_sgd.restore_plan(saved_config, self.exp.sync, self.local,
                                      self._per_layer_params, optimizer(self.exp)[0],
                                      self.canonical_layout.shardings)
        return plan or self._fp8_restore_plan(saved_config) or super().restore_plan(
            saved_config)

    def laid_out_params(self, params: dict) -> dict:
        """Canonical parameters (one entry per layer) as this mesh holds them (stacked,
        pipelined), with no optimizer state: what a reader of the model scores."""
        return jax.jit(self._laid_out, out_shardings=self.layout.params)(params)

    def _laid_out(self, given: dict | None = None) -> dict:
        """Parameters as this mesh holds them: new ones, or `given` (canonical; imported
        weights, whose FP8 scaling state, if any, starts fresh)."""
        if given is None:
            p = self.model.init(self.exp.seed)
        else:
            given = fp8.carry_over({"params": given},
                                   {"params": self._per_layer_params[0]})["params"]
            p = models.stack(given, "blocks") if self.stacked else given
        return self.pipeline.from_canonical(p) if self.pipeline else p

    def params_plan(self, record: dict):
        """How a reader of the model (plait sample, export, eval; a task of one model)
        takes its parameters, one entry per layer, out of the checkpoint whose JSON
        record is `record`: (abstract state to restore, state -> parameters, a notice
        or None). Imported weights are read alone, a checkpoint of data replicas
        (EASGD, DiLoCo) gives its center."""
        if record.get("params_only"):
            abstract = fp8.without_state(self.canonical_layout.abstract()["params"])
            return {"params": abstract}, lambda state: state["params"], None
        saved = record.get("config") or {}
        params = self.canonical_layout.abstract()["params"]  # without the optimizer state
        method = (saved.get("sync") or {}).get("method", "allreduce")
        if method != "allreduce":  # the center is laid out as one model's parameters
            return ({"sync": {"center": params}}, lambda state: state["sync"]["center"],
                    f"the {method} center, the model the data replicas meet at")
        if saved and self._fp8_restore_plan(saved) is not None:  # converted whole
            abstract, adapt, note = self.restore_plan(saved)
            return abstract, lambda state: adapt(state)["params"], note
        return {"params": params}, lambda state: state["params"], None

    def _fp8_restore_plan(self, saved_config: dict):
        """A checkpoint of another precision.matmul (or fp8_history): the weights and
        optimizer moments carried over, the FP8 scaling state fresh or dropped."""
        saved = ((saved_config or {}).get("model") or {}).get("fp8_history", 0)
        now = self.exp.model.fp8_history
        if saved == now or self.local:
            return None
        written = layout(*self._params_on_disk(fp8_history=saved), optimizer(self.exp)[0],
                         self.mesh)
        target = self.canonical_layout
        convert = jax.jit(functools.partial(fp8.carry_over, shapes=target.shapes),
                          out_shardings=target.shardings)
        note = ("FP8 scaling state starts afresh (the checkpoint was written with "
                "precision.matmul = \"default\")" if not saved else
                "the checkpoint's FP8 scaling state is dropped (precision.matmul = "
                "\"default\" now)" if not now else
                f"FP8 amax histories start afresh (fp8_history {saved} there, {now} now)")
        return written.abstract(), convert, note

    def _map_model(self, state: dict, fn) -> dict:
        """Apply a model-params conversion to the state: per replica where there are
        replicas (sync.method easgd / diloco), and to their center."""
        if not self.local:
            return map_params(state, self._model_params, fn)
        out = map_params(state, self._model_params, jax.vmap(fn))
        out["sync"] = {k: fn(v) for k, v in state["sync"].items()}
        return out

    def _model_params(self, tree) -> bool:
        return isinstance(tree, dict) and "blocks" in tree

    @functools.cached_property
    def _to_checkpoint(self):
        def convert(state):
            if self.pipeline:
                state = self.pipeline.map_state(state, self.pipeline.to_canonical)
            if self.stacked:
                state = self._map_model(state, lambda p: models.unstack(p, "blocks"))
            return state

        return jax.jit(convert, out_shardings=self.canonical_layout.shardings)

    @functools.cached_property
    def _from_checkpoint(self):
        def convert(state):
            if self.stacked:
                state = self._map_model(state, lambda p: models.stack(p, "blocks"))
            if self.pipeline:
                state = self.pipeline.map_state(state, self.pipeline.from_canonical)
            return state

        return jax.jit(convert, out_shardings=self.layout.shardings)

    def to_checkpoint(self, state: dict) -> dict:
        return self._to_checkpoint(state) if self._converts else state

    def from_checkpoint(self, state: dict) -> dict:
        return self._from_checkpoint(state) if self._converts else state
