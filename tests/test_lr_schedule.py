"""The learning-rate schedules: each against its formula written out here, the
optimizer stepping by them, and a run logging them."""

import json
import math

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import losses, run, tiny

from plait.config import OptimizerConfig
from plait.train.state import lr_schedule, optimizer, schedule_text


def _expected(schedule: str, step: int, lr: float, warmup: int, decay: int,
              floor: float, cooldown: float) -> float:
    """What each schedule promises in docs/config.md, step by step."""
    if step < warmup:
        return lr * step / warmup
    if schedule == "constant":
        return lr
    start = {"linear": warmup, "cosine": warmup,
             "wsd": decay - max(round(cooldown * decay), 1)}[schedule]
    t = min(max((step - start) / (decay - start), 0.0), 1.0)
    if schedule == "cosine":
        return floor + (lr - floor) * 0.5 * (1 + math.cos(math.pi * t))
    return lr + (floor - lr) * t


@pytest.mark.parametrize("warmup", [0, 3])
@pytest.mark.parametrize("schedule", ["cosine", "linear", "wsd", "constant"])
def test_each_schedule_follows_its_formula(schedule, warmup):
    opt = OptimizerConfig(lr=2e-3, warmup_steps=warmup, decay_steps=20, min_lr_ratio=0.1,
                          schedule=schedule, cooldown_fraction=0.25)
    f = lr_schedule(opt, steps=50)
    got = [float(f(s)) for s in range(26)]
    want = [_expected(schedule, s, 2e-3, warmup, 20, 2e-4, 0.25) for s in range(26)]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-9)
    if schedule == "wsd":  # held at lr until the last 5 steps of 20, then down
        assert got[warmup:16] == pytest.approx([2e-3] * (16 - warmup))
        assert got[16] < 2e-3 and got[20] == pytest.approx(2e-4)


def test_wsd_cooldown_never_reaches_into_the_warmup():
    """A cooldown longer than what is left after warmup starts where warmup ends."""
    opt = OptimizerConfig(lr=1.0, warmup_steps=8, decay_steps=10, min_lr_ratio=0.0,
                          schedule="wsd", cooldown_fraction=1.0)
    got = [float(lr_schedule(opt, 10)(s)) for s in range(12)]
    np.testing.assert_allclose(got, [s / 8 for s in range(8)] + [1.0, 0.5, 0.0, 0.0],
                               atol=1e-7)


def test_the_optimizer_steps_by_the_schedule():
    """SGD's update on a unit gradient is minus the schedule's value at each step."""
    from plait.config import Experiment

    exp = Experiment.model_validate({"name": "s", "model": {"kind": "gpt"}, "optimizer": {
        "name": "sgd", "lr": 0.5, "warmup_steps": 2, "decay_steps": 10, "schedule": "wsd",
        "cooldown_fraction": 0.5}})
    tx, sched = optimizer(exp)
    params = {"w": jnp.zeros(3)}
    state = tx.init(params)
    for step in range(12):
        upd, state = tx.update({"w": jnp.ones(3)}, state, params)
        np.testing.assert_allclose(upd["w"], -float(sched(step)), rtol=1e-6)


def test_a_run_logs_the_schedule_it_steps_by(tmp_path):
    exp = tiny(train={"steps": 6}, optimizer={
        "lr": 1e-2, "warmup_steps": 1, "decay_steps": 6, "schedule": "wsd",
        "cooldown_fraction": 0.5, "min_lr_ratio": 0.0})
    summary = run(exp, "data=1", tmp_path / "r")
    lrs = [r["lr"] for r in summary["records"]]
    # Steps 1..6 are logged; the lr of step s is the schedule at s - 1.
    np.testing.assert_allclose(lrs, [0.0, 1e-2, 1e-2, 1e-2, 1e-2 * 2 / 3, 1e-2 / 3],
                               rtol=1e-5, atol=1e-9)
    assert np.isfinite(losses(summary)).all()
    # The run's header says it in words.
    assert schedule_text(exp.optimizer, 6) == (
        "adamw, lr 0.01: warmup 1 steps, then held to step 3, then linear to 0 at step 6")
    # A run shorter than its warmup (a smoke test of a long config) never reaches the lr:
    # said, with the most it reaches (step 4 trains at the schedule's step 3: 3/8 of it).
    short = exp.optimizer.model_copy(update={"warmup_steps": 8})
    assert schedule_text(short, 4).endswith(
        "(the run's 4 steps end inside the warmup: the lr reaches 0.00375 at most)")
    assert "inside the warmup" not in schedule_text(short, 9)


def test_a_wsd_run_extended_from_before_its_cooldown_holds_then_cools_down_later(tmp_path,
                                                                               capsys):
    """The reason to choose wsd: resume from a checkpoint of the stable phase with a later
    decay_steps, and the lr goes on at its peak (no bend) and cools down at the new end."""
    from helpers import write_experiment

    from plait.cli import main

    raw = tiny(train={"steps": 8}, checkpoint={"enabled": True, "every_steps": 2,
                                               "keep": 4, "async_save": False},
               optimizer={"lr": 1e-2, "warmup_steps": 2, "decay_steps": None,
                          "schedule": "wsd", "cooldown_fraction": 0.25,
                          "min_lr_ratio": 0.0})
    exp = write_experiment(tmp_path / "t.toml", raw)
    run_dir = tmp_path / "r"
    args = ["train", str(exp), "--mesh", "data=2", "--run-dir", str(run_dir)]
    def lrs():
        return [json.loads(x)["lr"] for x in
                (run_dir / "metrics.jsonl").read_text().splitlines()]

    assert main(args) == 0  # the lr of step s is the schedule at s - 1: cooldown 2 of 8
    np.testing.assert_allclose(lrs(), [0.0, 5e-3] + [1e-2] * 5 + [5e-3], atol=1e-9)
    assert main(args + ["--from-step", "4", "--steps", "12",
                        "--set", "optimizer.decay_steps=12"]) == 0
    # Steps 5-12 again from the checkpoint of step 4, at the peak until the cooldown, now
    # 3 of 12 steps (the records after step 4 are the new run's).
    np.testing.assert_allclose(lrs(), [0.0, 5e-3] + [1e-2] * 8 + [1e-2 * 2 / 3, 1e-2 / 3],
                               atol=1e-9)
