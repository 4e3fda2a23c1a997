"""The Task interface is real: a model kind defined here, in a few lines, registered
through plait.tasks, trains, checkpoints and resumes bit-identically, with no change
to plait's source."""

from __future__ import annotations

import functools
from typing import ClassVar, Literal

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import make_mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from plait import tasks
from plait.config import Experiment, ModelSection
from plait.data import global_batch
from plait.errors import UserError
from plait.tasks.base import Task
from plait.train.loop import train
from plait.train.state import init_state, layout, optimizer
from plait.train.step import make_train_step


class LinearConfig(ModelSection):
    kind: Literal["linear"] = "linear"
    features: int = 8
    shape_keys: ClassVar[tuple[str, ...]] = ("features",)


class Teacher:
    """y = x . w* + noise, deterministic by (step, row)."""

    def __init__(self, features: int, seed: int):
        self.w = np.random.default_rng(seed).normal(size=features)

    def rows(self, step: int, start: int, stop: int) -> np.ndarray:
        x = np.asarray([np.random.default_rng([step, r]).normal(size=len(self.w))
                        for r in range(start, stop)], np.float32)
        return np.concatenate([x, (x @ self.w)[:, None]], axis=1).astype(np.float32)


class LinearTask(Task):
    def __init__(self, exp: Experiment, mesh):
        super().__init__(exp, mesh)
        f = exp.model.features
        rep = NamedSharding(mesh, P())
        self.tx, self.lr_schedule = optimizer(exp)
        shapes = {"w": jax.ShapeDtypeStruct((f,), jnp.float32)}
        self._layout = layout(shapes, {"w": rep}, self.tx, mesh)
        self.batch_shape = (1, exp.train.global_batch, f + 1)
        self.batch_sharding = NamedSharding(mesh, P(None, "data", None))

    layout = property(lambda self: self._layout)

    def init_state(self):
        return init_state(lambda: {"w": jnp.zeros(self.exp.model.features)}, self.tx,
                          self.layout)

    @functools.cached_property
    def step_fn(self):
        def loss(params, rows):
            return jnp.mean((rows[:, :-1] @ params["w"] - rows[:, -1]) ** 2)

        return make_train_step(self.mesh, self.layout, self.batch_sharding, self.tx,
                               self.lr_schedule, self.exp.optimizer.grad_clip, loss_fn=loss)

    def abstract_batch(self):
        return jax.ShapeDtypeStruct(self.batch_shape, jnp.float32, sharding=self.batch_sharding)

    def source(self):
        return Teacher(self.exp.model.features, self.exp.seed)

    def batch(self, source, step):
        return global_batch(source, step, self.batch_shape, self.batch_sharding)

    units_per_step = property(lambda self: self.exp.train.global_batch)

    def num_params(self):
        return self.exp.model.features


@pytest.fixture(autouse=True, scope="module")
def linear_kind():
    tasks.register("linear", LinearConfig, LinearTask)
    yield
    tasks.unregister("linear")


def _exp(steps: int) -> Experiment:
    return Experiment.model_validate({
        "name": "linear", "model": {"kind": "linear", "features": 8},
        "train": {"steps": steps, "global_batch": 16},
        "optimizer": {"name": "sgd", "lr": 0.1, "decay_steps": 100, "grad_clip": 0.0},
        "checkpoint": {"every_steps": 5, "keep": 2, "async_save": False},
        "log": {"every_steps": 1, "tensorboard": False, "console": "none"}})


def test_a_registered_kind_trains_and_resumes_bit_identically(tmp_path):
    exp = _exp(20)
    assert type(exp.model) is LinearConfig and exp.data.source == "synthetic"
    full = train(exp, make_mesh("data=4"), tmp_path / "full")
    losses = [r["loss"] for r in full["records"]]
    assert losses[-1] < 0.2 * losses[0]  # it learns the teacher
    part = tmp_path / "part"
    train(_exp(12), make_mesh("data=4"), part)  # saves at 5, 10 and its last step, 12
    resumed = train(exp, make_mesh("data=4"), part)
    assert resumed["records"][0]["step"] == 13
    np.testing.assert_array_equal([r["loss"] for r in resumed["records"]], losses[12:])
    moved = tmp_path / "moved"
    train(_exp(12), make_mesh("data=4"), moved)
    other_mesh = train(exp, make_mesh("data=2"), moved)  # resharded on load
    # another mesh sums in another order: float32 rounding of a loss near 1e-3 of its start
    np.testing.assert_allclose([r["loss"] for r in other_mesh["records"]], losses[12:],
                               rtol=1e-5, atol=1e-6 * losses[0])
    # The run directory remembers the kind: another shape of it is refused in one line.
    other = Experiment.model_validate({**_exp(30).model_dump(), "model": {
        "kind": "linear", "features": 4}})
    with pytest.raises(UserError, match=r"model.features = 8 there, 4 now"):
        train(other, make_mesh("data=4"), part)


def test_unknown_kind_and_its_keys_are_one_line_errors(tmp_path):
    from plait.config_files import validate

    with pytest.raises(UserError, match=r"unknown model.kind 'lineer'; known kinds: .*linear"):
        validate({"model": {"kind": "lineer"}}, "x.toml")
    with pytest.raises(UserError, match=r"unknown config key 'model.layers' \(a linear model\)"):
        validate({"model": {"kind": "linear", "layers": 2}}, "x.toml")
    with pytest.raises(UserError, match=r'data.source = "tokens" is not read by a linear model'):
        validate({"model": {"kind": "linear"}, "data": {"source": "tokens"}}, "x.toml")
