"""DLRM with sharded embedding tables: equivalence, sparse updates, HLO, resume, errors."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import AS_TRAINED, ROOT, losses, make_mesh, plait_cmd, run

from plait import analysis
from plait.config_files import load_experiment
from plait.errors import UserError
from plait.parallel import embedding as emb
from plait.parallel.sparse_optim import OPTIMIZERS
from plait.tasks.dlrm import DLRMTask
from plait.train.metrics import auc

TINY = ROOT / "experiments" / "dlrm-tiny.toml"
QUIET = ['log.console="none"', "log.tensorboard=false", "log.every_steps=1",
         "checkpoint.enabled=false", "data.eval_batches=0"]


def exp_of(*sets: str, steps: int = 12):
    return load_experiment(TINY, [*QUIET, f"train.steps={steps}", *sets])


def step_losses(exp, mesh: str, steps: int) -> np.ndarray:
    job = DLRMTask(exp, make_mesh(mesh))
    source, state, out = job.source(), job.init_state(), []
    for k in range(steps):
        state, m = job.step_fn(state, job.batch(source, k))
        out.append(float(m["loss"]))
    return np.array(out)


@pytest.mark.parametrize("optimizer,pooling,cross", [("adagrad", "sum", 0), ("sgd", "mean", 0),
                                                     ("adam", "sum", 2)])
def test_every_sharding_kind_equals_one_device(optimizer, pooling, cross):
    sets = [f'embedding.optimizer="{optimizer}"', f'model.pooling="{pooling}"',
            f"model.cross_layers={cross}"]
    if optimizer == "sgd":  # plain SGD moves embeddings slowly: a rate where they matter
        sets.append("embedding.lr=20.0")
    reference = step_losses(exp_of(*sets), "data=1", 12)
    frozen = step_losses(exp_of(*sets[:3], "embedding.lr=1e-12"), "data=1", 12)
    # The tables learn: freezing them changes the curve (so equal curves mean equal updates).
    assert np.max(np.abs(frozen - reference)) > 1e-3
    # One program with each of the four tables laid out by another kind: a wrong update
    # of any kind changes that table's rows and so the curve.
    every_kind = 'embedding.overrides={"0" = "row", "1" = "table", "2" = "column", ' \
                 '"3" = "replicated"}'
    job_kinds = DLRMTask(exp_of(*sets, every_kind), make_mesh("data=2,fsdp=4")).tables.kinds
    assert sorted(job_kinds) == ["column", "replicated", "row", "table"]
    got = step_losses(exp_of(*sets, every_kind), "data=2,fsdp=4", 12)
    np.testing.assert_allclose(got, reference, rtol=1e-4)


def test_planner_mixes_kinds_and_matches_one_device():
    exp = exp_of('embedding.overrides={"0" = "row", "1" = "table"}')
    job = DLRMTask(exp, make_mesh("data=8"))
    assert job.tables.kinds == ("row", "table", "replicated", "replicated")
    auto = DLRMTask(exp_of(), make_mesh("data=8"))
    assert auto.tables.kinds == ("column", "column", "replicated", "replicated")
    np.testing.assert_allclose(step_losses(exp, "data=8", 10),
                               step_losses(exp_of(), "data=1", 10), rtol=1e-4)


def _dense_reference(opt: str, tables, ids, grads, lr, mean):
    """Dense table gradients (every row, zeros where not looked up) through a dense optimizer."""
    T = len(tables)
    out, touched = [], []
    for t in range(T):
        g = np.zeros_like(tables[t])
        for b in range(ids.shape[1]):
            bag = ids[t, b][ids[t, b] >= 0]
            for i in bag:
                g[i] += grads[t, b] / (max(len(bag), 1) if mean else 1)
        rows = np.unique(ids[t][ids[t] >= 0])
        touched.append(rows)
        if opt == "sgd":
            out.append(tables[t] - lr * g)
        elif opt == "adagrad":  # row-wise: one accumulator per row, mean of g^2 over the row
            acc = np.mean(g * g, axis=1, keepdims=True)
            out.append(tables[t] - lr * g / (np.sqrt(acc) + 1e-8))
        else:
            tx = optax.adam(lr, eps=1e-8)
            upd, _ = tx.update(jnp.asarray(g), tx.init(jnp.asarray(tables[t])))
            out.append(tables[t] + np.asarray(upd))
    return out, touched


# per_position: the CPU's scan over bag positions; False: every id at once (GPUs, TPUs).
@pytest.mark.parametrize("opt", ["sgd", "adagrad", "adam"])
@pytest.mark.parametrize("mean,per_position", [(False, True), (True, True), (False, False),
                                               (True, False)])
def test_sparse_update_equals_dense_optimizer_on_touched_rows(opt, mean, per_position):
    mesh = make_mesh("data=8")
    rows, dim, B, bag = (37, 64, 16, 40), 8, 16, 23  # 23: two unrolled turns and 3 more
    kinds = ("row", "table", "column", "replicated")
    lay = emb.TableLayout(rows, dim, kinds, 8, ("data",), (-1, 3, -1, -1))
    rng = np.random.default_rng(0)
    tables = [rng.normal(size=(r, dim)).astype(np.float32) for r in rows]
    # Few distinct ids, so rows repeat within and across bags (duplicates are merged).
    ids = np.stack([rng.integers(0, min(r, 6), size=(B, bag)) for r in rows]).astype(np.int32)
    ids[:, ::3, -2:] = -1  # shorter bags
    grads = rng.normal(size=(len(rows), B, dim)).astype(np.float32)
    buffers = jax.jit(lambda ts: emb.fuse(lay, ts))(tables)
    _, state_sh = emb.shardings(lay, mesh, opt)
    state = jax.tree.map(lambda s, sh: jnp.zeros(s.shape, s.dtype, device=sh),
                         emb.opt_state_shapes(lay, opt), state_sh)
    sopt = OPTIMIZERS[opt](0.1, by_position=per_position)
    new, _ = jax.jit(lambda b, s, i, g: emb.sparse_update(
        lay, mesh, sopt, b, s, i, g, jnp.float32(0.1), jnp.int32(0), mean))(
        buffers, state, jnp.asarray(ids), jnp.asarray(grads))
    got = [np.asarray(a) for a in emb.unfuse(lay, new)]
    want, touched = _dense_reference(opt, tables, ids, grads, 0.1, mean)
    for t in range(len(rows)):
        np.testing.assert_allclose(got[t][touched[t]], want[t][touched[t]], rtol=2e-5,
                                   atol=2e-6, err_msg=f"table {t} ({kinds[t]})")
        untouched = np.setdiff1d(np.arange(rows[t]), touched[t])
        np.testing.assert_array_equal(got[t][untouched], tables[t][untouched])


@pytest.mark.parametrize("per_position", [True, False])
def test_lookup_equals_dense_bags(per_position):
    mesh = make_mesh("data=8")
    rows, dim = (40, 24, 64, 16), 8
    lay = emb.TableLayout(rows, dim, ("row", "table", "column", "replicated"), 8, ("data",),
                     (-1, 5, -1, -1))
    rng = np.random.default_rng(1)
    tables = [rng.normal(size=(r, dim)).astype(np.float32) for r in rows]
    ids = np.stack([rng.integers(-1, r, size=(16, 3)) for r in rows]).astype(np.int32)
    buffers = jax.jit(lambda ts: emb.fuse(lay, ts))(tables)
    for mean in (False, True):
        bags = np.asarray(jax.jit(lambda b, i, m=mean: emb.pooled(
            lay, mesh, b, i, m, per_position))(buffers, jnp.asarray(ids)))
        for t in range(len(rows)):
            for b in range(16):
                sel = ids[t, b][ids[t, b] >= 0]
                want = tables[t][sel].sum(0) / (max(len(sel), 1) if mean else 1)
                np.testing.assert_allclose(bags[t, b], want, rtol=1e-5, atol=1e-6)


def test_step_off_the_cpu_has_no_loop_and_equals_the_cpu_step(monkeypatch):
    """Off the CPU the bags are gathered and scattered whole: the compiled step has no
    while loop (on a GPU each iteration is launched and waited on by the host), and
    its losses equal the per-position step's."""
    import plait.parallel.embedding as embedding_module
    import plait.tasks.dlrm as dlrm_module

    sets = ['embedding.optimizer="adagrad"', 'embedding.sharding="row"']
    per_position = step_losses(exp_of(*sets), "data=2,fsdp=2", 6)
    for module in (embedding_module, dlrm_module):
        monkeypatch.setattr(module, "by_position", lambda platform: False)
    job = DLRMTask(exp_of(*sets), make_mesh("data=2,fsdp=2"))
    assert " while(" not in job.compile(AS_TRAINED).as_text()
    np.testing.assert_allclose(step_losses(exp_of(*sets), "data=2,fsdp=2", 6), per_position,
                               rtol=1e-5)


def _collectives_and_temp(rows: int, kind: str):
    exp = exp_of(f"model.embedding_rows=[{rows}, {rows}, {rows}, {rows}]",
                 f'embedding.sharding="{kind}"', "data.ids_per_lookup=8")
    job = DLRMTask(exp, make_mesh("data=8"))
    r = analysis.analyze(job.compile(), {"data": 8})
    sizes = sorted((op["kind"], op["bytes"]) for op in r["collective_ops"])
    return sizes, r["memory"]["temp_bytes"], rows * exp.model.embedding_dim * 4


@pytest.mark.parametrize("kind", ["row", "table", "column", "replicated"])
def test_step_has_nothing_that_grows_with_the_tables(kind):
    small, temp_small, _ = _collectives_and_temp(4096, kind)
    big, temp_big, table_bytes = _collectives_and_temp(65536, kind)
    # The same collectives, of the same sizes, whatever the rows ...
    assert small == big
    assert all(b < table_bytes / 8 for _, b in big), big
    # ... and no temporary that grows with the table (16x the rows here).
    assert temp_big - temp_small < table_bytes / 8, (temp_small, temp_big)


def test_resume_under_another_mesh_and_plan_continues_the_curve(tmp_path):
    exp = load_experiment(TINY, [*QUIET, "train.steps=12", "checkpoint.enabled=true",
                                 "checkpoint.every_steps=6", "checkpoint.async_save=false"])
    full = losses(run(exp, "data=1", tmp_path / "one"))
    first = exp.model_copy(update={"train": exp.train.model_copy(update={"steps": 6})})
    run(first, "data=8", tmp_path / "split")
    rest = exp.model_copy(update={"embedding": exp.embedding.model_copy(
        update={"sharding": "table"})})
    second = run(rest, "data=2,fsdp=2", tmp_path / "split")
    np.testing.assert_allclose(losses(second), full[6:], rtol=1e-4)


def test_train_cli_reports_samples_and_auc(tmp_path):
    out = plait_cmd("train", str(TINY), "--mesh", "data=8", "--run-dir", str(tmp_path / "r"),
                    "--set", "log.console=\"line\"", "--set", "checkpoint.enabled=false")
    assert out.returncode == 0, out.stderr[-2000:]
    recs = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert recs[-1]["auc"] > 0.7 and recs[-1]["samples_per_s"] > 0
    assert "samples/s" in out.stdout and "held-out auc" in out.stdout


def test_auc_matches_pairwise_definition():
    rng = np.random.default_rng(3)
    labels = rng.integers(0, 2, 200)
    scores = np.round(rng.normal(size=200), 1)  # ties
    pos, neg = scores[labels == 1], scores[labels == 0]
    pairs = (pos[:, None] > neg[None, :]).mean() + 0.5 * (pos[:, None] == neg[None, :]).mean()
    assert abs(auc(labels, scores) - pairs) < 1e-12


@pytest.mark.parametrize("sets,needle", [
    (['embedding.overrides={"9" = "row"}'], "names table '9'"),
    (["model.bottom_mlp=[32, 8]"], "bottom_mlp must end in model.embedding_dim"),
    (['embedding.overrides={"0" = "column"}', "model.embedding_dim=12",
      "model.bottom_mlp=[32, 12]"], "column-wise"),
    (['sync.method="easgd"'], "sparse tables train synchronously"),
    (['sync.reduce="hierarchical"'], "sync.reduce"),
])
def test_user_errors(sets, needle):
    with pytest.raises(UserError, match=needle):
        DLRMTask(exp_of(*sets), make_mesh("data=8"))


def test_two_process_launch_equals_one_process(tmp_path):
    sets = ["--set", 'embedding.sharding="row"', "--set", "checkpoint.enabled=false",
            "--set", 'log.console="line"', "--set", "log.every_steps=1", "--steps", "8"]
    one = plait_cmd("train", str(TINY), "--mesh", "data=8", "--run-dir", str(tmp_path / "one"),
                    *sets)
    assert one.returncode == 0, one.stderr[-2000:]
    two = plait_cmd("launch", "--processes", "2", "--", "train", str(TINY), "--mesh", "data=8",
                    "--run-dir", str(tmp_path / "two"), *sets)
    assert two.returncode == 0, two.stderr[-3000:]
    # 4 row-wise tables of 4096 + 2048 + 64 + 100 rows, padded to 8 parts, x 16:
    # each process's 4 devices hold half of every table's rows.
    assert "row 50,496/100,992" in two.stdout
    assert "row 100,992/100,992" in one.stdout
    np.testing.assert_allclose(losses(tmp_path / "two"), losses(tmp_path / "one"), rtol=1e-5)


CRITEO_LINES = [
    "1\t5\t\t-3\t" + "\t".join(["7"] * 10) + "\t"
    + "\t".join(["ffffffff", "", "1a"] * 8 + ["0", "2"]),
    "0\tnot-a-number\t" + "\t".join(["1"] * 12) + "\t" + "\t".join(["a"] * 26),
    "0\t1\t2",
    "1\t" + "\t".join(["2"] * 13) + "\t" + "\t".join(["10"] * 26),
]


def test_criteo_reader_hashes_ids_and_skips_malformed_lines(tmp_path):
    from plait.data.criteo import CriteoTSV

    path = tmp_path / "day.tsv"
    path.write_text("\n".join(CRITEO_LINES) + "\n")
    rows = [7] * 26
    src = CriteoTSV(str(path), rows, batch=2, malformed="skip")
    b = src.rows(0, 0, 2)
    assert b["labels"].tolist() == [1.0, 1.0]  # line 2 and 3 are skipped: line 4 is next
    np.testing.assert_allclose(b["dense"][0, :3], [np.log(6), 0.0, 0.0], rtol=1e-6)
    assert b["ids"][0, :3, 0].tolist() == [0xFFFFFFFF % 7, 0, 0x1A % 7]
    assert (b["ids"] < 7).all() and src.skipped == 2
    with pytest.raises(UserError, match="line 2 is malformed"):
        CriteoTSV(str(path), rows, batch=2, malformed="stop").rows(0, 0, 2)


def test_cli_errors_are_one_line(tmp_path):
    cases = [
        (["train", str(TINY), "--mesh", "data=8", "--set", 'embedding.overrides={"4" = "row"}'],
         "names table '4'"),
        (["train", str(TINY), "--mesh", "data=4,tensor=2"], "data and fsdp axes only"),
        (["plan", str(TINY), "--mesh", "data=8", "--set", "embedding.memory_gib=0.00001",
          "--set", 'embedding.sharding="table"'], "does not fit"),
        (["train", str(TINY), "--mesh", "data=8", "--set", 'data.source="criteo"',
          "--set", f'data.path="{tmp_path}/missing.tsv"'], "not found"),
    ]
    for args, needle in cases:
        out = plait_cmd(*args, "--run-dir", str(tmp_path / "r")) if args[0] == "train" \
            else plait_cmd(*args)
        assert out.returncode == 2, (args, out.stderr[-1500:])
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], (args, out.stderr)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("name", ["dlrm-bench", "dlrm-kaggle", "dlrm-mlperf"])
def test_shipped_experiments_plan_over_8_devices(name):
    from plait.planner import plan_tables

    exp = load_experiment(ROOT / "experiments" / f"{name}.toml")
    plan = plan_tables(exp, 8, ("data", "fsdp"))
    per = plan.per_device_bytes(exp.embedding.optimizer)
    # Balanced within the planner's bound, and every table placed.
    replicated = sum(r * 4 * exp.model.embedding_dim for r, k in
                     zip(plan.layout.rows, plan.layout.kinds, strict=True) if k == "replicated")
    assert max(per) - replicated <= 1.25 * (sum(per) / 8 - replicated)
    assert len(plan.layout.kinds) == len(exp.model.embedding_rows)
    if name == "dlrm-bench":
        assert plan.layout.kinds == ("table",) * 8
        assert sorted(plan.layout.owners) == list(range(8))


def test_bce_gradient_is_sigmoid_minus_label_everywhere():
    """At a logit of exactly 0 too (a zero-initialised output sits there): d/dx = 0.5 - y."""
    import jax
    import jax.numpy as jnp

    from plait.models.dlrm import bce_with_logits

    x = jnp.asarray([0.0, 0.0, 3.0, -40.0, 40.0])
    y = jnp.asarray([1.0, 0.0, 1.0, 1.0, 0.0])
    grad = jax.grad(lambda x: bce_with_logits(x, y) * x.size)(x)
    np.testing.assert_allclose(grad, jax.nn.sigmoid(x) - y, rtol=1e-6, atol=1e-7)
    loss = bce_with_logits(x, y) * x.size
    want = np.sum(np.logaddexp(0, np.asarray(x)) - np.asarray(x) * np.asarray(y))
    np.testing.assert_allclose(loss, want, rtol=1e-6)


@pytest.mark.parametrize("initial", [0.0, 0.1])
def test_dense_adagrad_step_equals_the_formula(initial):
    """One Adagrad step from the accumulator's starting value (0: torch's and the
    reference DLRM's): w - lr g / sqrt(initial + g^2 + eps)."""
    import jax.numpy as jnp

    from plait.config import Experiment
    from plait.train.state import optimizer

    exp = Experiment.model_validate({"optimizer": {
        "name": "adagrad", "lr": 0.05, "adagrad_initial": initial, "eps": 1e-10,
        "min_lr_ratio": 1.0}})
    tx, _ = optimizer(exp)
    w = {"w": jnp.asarray([0.5, -1.0, 2.0])}
    g = {"w": jnp.asarray([0.2, -3.0, 1e-3])}
    updates, _ = tx.update(g, tx.init(w), w)
    want = -0.05 * np.asarray(g["w"]) / np.sqrt(initial + np.asarray(g["w"]) ** 2 + 1e-10)
    np.testing.assert_allclose(updates["w"], want, rtol=1e-5)
    if initial == 0.0:  # the first step is lr x sign(g), as torch.optim.Adagrad's
        np.testing.assert_allclose(np.abs(updates["w"]), 0.05, rtol=1e-3)
