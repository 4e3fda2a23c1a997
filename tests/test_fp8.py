"""FP8 matmuls (precision.matmul = "fp8"): the quantised matmul against a NumPy
emulation of delayed scaling, the scaling state through microbatches, meshes and
checkpoints, and the one-line refusals. CPUs have no FP8 units: the tests run XLA's
emulation (models.fp8.EMULATE_ENV), the same quantised numbers in float32."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import losses, make_mesh, run, step_in_process, tiny, write_experiment

from plait.models import fp8

E4M3_MAX, E5M2_MAX = 448.0, 57344.0


@pytest.fixture
def emulate(monkeypatch):
    monkeypatch.setenv(fp8.EMULATE_ENV, "1")


def _state(history: dict[str, np.ndarray]) -> fp8.Scaling:
    """A Scaling whose amax histories are `history` and whose scales are those the
    histories give (the state `put` leaves after those steps)."""
    s = fp8.Scaling(len(history["x"]))
    for k, h in history.items():
        getattr(s, f"{k}_amax")[...] = jnp.asarray(h, jnp.float32)
        getattr(s, f"{k}_scale")[...] = jnp.asarray([_np_scale(h, _MAX[k])], jnp.float32)
    return s


_MAX = {"x": 448.0, "w": 448.0, "g": 57344.0}


def _np_scale(history: np.ndarray, fmt_max: float) -> np.float32:
    """The scale from a history's largest amax (1 while it is empty)."""
    amax = np.max(history)
    return np.float32(amax / fmt_max) if amax > 0 else np.float32(1.0)


STEP = 5  # steps done before the one the emulation checks


def _np_qdq(x: np.ndarray, history: np.ndarray, fmt, fmt_max: float):
    """NumPy delayed scaling: the scale from the history's largest amax (1 while it is
    empty), x / scale clipped and rounded to the format, times the scale; and the next
    history (this step's amax in the place of the window's oldest, STEP mod its
    length)."""
    scale = _np_scale(history, fmt_max)
    q = np.clip(x / scale, -fmt_max, fmt_max).astype(fmt).astype(np.float32) * scale
    nxt = history.copy()
    nxt[STEP % len(history)] = np.abs(x).max()
    return q, scale, nxt


@pytest.mark.parametrize("empty", [False, True])
def test_the_quantised_matmul_and_its_gradients_equal_a_numpy_emulation(empty):
    from flax import nnx

    from plait.parallel.ops import dense

    rng = np.random.default_rng(0)
    x = rng.normal(0, 2.0, (3, 5, 16)).astype(np.float32)
    w = rng.normal(0, 0.05, (16, 24)).astype(np.float32)
    ct = rng.normal(0, 1e-3, (3, 5, 24)).astype(np.float32)
    H = 4
    hist = {k: np.zeros(H, np.float32) if empty else np.array(v, np.float32)
            for k, v in {"x": [7.5, 0.0, 9.0, 3.0], "w": [0.2, 0.15, 0.0, 0.1],
                         "g": [4e-3, 5e-3, 1e-3, 0.0]}.items()}
    def f(x, w, s):
        return dense(x, nnx.Param(w, logical_axes=("embed", "mlp"), fan_in=("embed",)), s)

    state = nnx.state(_state(hist))
    y, vjp = jax.vjp(lambda x, w, st: f(x, w, nnx.merge(nnx.graphdef(_state(hist)), st)),
                     jnp.asarray(x), jnp.asarray(w), state)
    dx, dw, dstate = vjp(jnp.asarray(ct))

    qx, sx, hx = _np_qdq(x, hist["x"], ml_dtypes.float8_e4m3fn, E4M3_MAX)
    qw, sw, hw = _np_qdq(w, hist["w"], ml_dtypes.float8_e4m3fn, E4M3_MAX)
    qg, sg, hg = _np_qdq(ct, hist["g"], ml_dtypes.float8_e5m2, E5M2_MAX)
    # The operands are exact fp8 values times a scale: the products are float32-exact
    # up to the summation's rounding.
    np.testing.assert_allclose(y, np.einsum("bti,io->bto", qx, qw), rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(dx, np.einsum("bto,io->bti", qg, qw), rtol=2e-6, atol=1e-9)
    np.testing.assert_allclose(dw, np.einsum("bti,bto->io", qx, qg), rtol=2e-6, atol=1e-9)
    if not empty:  # the rounding did something: the emulation is not the plain matmul
        assert np.abs(np.asarray(y) - x @ w).max() > 1e-4
    # The matmul reports each amax as its scale's "gradient"; the step's `put` makes
    # the next state from them: the history with this step's amax in it, and the
    # scale that history gives the next step.
    got = nnx.to_pure_dict(dstate)
    for k, a in {"x": x, "w": w, "g": ct}.items():
        np.testing.assert_allclose(got[f"{k}_scale"], [np.abs(a).max()], rtol=1e-6)
    before = {"fp8": {"m": nnx.to_pure_dict(state)}}
    after = fp8.put({"fp8": {"m": None}}, {"fp8": {"m": got}}, before,
                    jnp.int32(STEP))["fp8"]["m"]
    for k, nxt in {"x": hx, "w": hw, "g": hg}.items():
        np.testing.assert_allclose(after[f"{k}_amax"], nxt, rtol=1e-6)
        np.testing.assert_allclose(after[f"{k}_scale"], [_np_scale(nxt, _MAX[k])], rtol=1e-6)
    del sx, sw, sg  # the scales used: the state's, which the emulation recomputed


def _fp8(**train) -> dict:
    return {"precision": {"matmul": "fp8", "fp8_history": 4}, "model": ONE_LAYER,
            "train": {"global_batch": 8, **train}}


ONE_LAYER = {"layers": 1}  # attention and an MLP: every kind of FP8 matmul


def _scalings(params: dict) -> dict:
    return {m: params["blocks"]["0"][m]["fp8"] for m in ("attn", "mlp")}


def test_microbatches_and_meshes_keep_one_scaling_state(emulate):
    one, p1 = step_in_process(tiny(**_fp8(steps=3)), "data=1", 3)
    two, p2 = step_in_process(tiny(**_fp8(steps=3, microbatches=2)), "data=1", 3)
    sharded, p3 = step_in_process(tiny(**_fp8(steps=3)), "data=2,fsdp=2,tensor=2", 3)
    plain, _ = step_in_process(tiny(model=ONE_LAYER, train={"global_batch": 8, "steps": 3}),
                               "data=1", 3)
    s1, s2, s3 = _scalings(p1), _scalings(p2), _scalings(p3)
    # History after 3 steps of 4: [step 1, step 2, step 3, unseen]. Steps 1 and 2 ran
    # on the same weights everywhere (the first step's learning rate is 0 in warmup):
    # two microbatches see the batch's amax by their maximum, a mesh sees it whole.
    # Step 3's weights differ by a rounding: the amax there only nearly agrees (fp8
    # turns a last-bit difference into a quantisation step, and Adam makes that an
    # update of the learning rate's size).
    for name in s1:
        for w, s in s1[name].items():
            assert np.all(s["x_amax"][:3] > 0) and s["x_amax"][3] == 0
            for other in (s2, s3):
                for k in ("x_amax", "w_amax"):
                    np.testing.assert_allclose(other[name][w][k][:2], s[k][:2], rtol=1e-5)
                    np.testing.assert_allclose(other[name][w][k], s[k], rtol=5e-2)
            np.testing.assert_allclose(s3[name][w]["g_amax"][:2], s["g_amax"][:2], rtol=1e-4)
            if (name, w) == ("mlp", "w2"):
                # Each microbatch's loss is a mean over half the rows: gradients twice as
                # big (below the last matmul the first step's unscaled e5m2 rounding,
                # where doubling moves subnormals, blurs this by a few per cent).
                np.testing.assert_allclose(s2[name][w]["g_amax"][:2], 2 * s["g_amax"][:2],
                                           rtol=1e-4)
            # The state holds the scale step 4 would use: from steps 1-3's amax
            # (delayed scaling: step 3 used the one from steps 1-2).
            assert s["x_scale"][0] == pytest.approx(s["x_amax"].max() / E4M3_MAX, rel=1e-6)
    np.testing.assert_allclose(two, one, rtol=1e-3)
    np.testing.assert_allclose(sharded, one, rtol=1e-3)
    # Quantised, the curve stays near the unquantised one.
    np.testing.assert_allclose(one, plain, rtol=2e-3)
    assert not np.array_equal(one, plain)
    # The scaling state is not a weight: the optimizer, the norm, the counts skip it.
    from plait.models.gpt import abstract_model
    from plait.models.gpt_counts import param_count

    exp = tiny(**_fp8())
    assert abstract_model(exp.model).num_params() == param_count(exp.model)


CKPT = {"enabled": True, "every_steps": 3, "keep": 3, "async_save": False}


def test_resume_is_bit_exact_with_the_scaling_state(emulate, tmp_path, capsys):
    exp = tiny(checkpoint=CKPT, **_fp8(steps=6))
    full = losses(run(exp, "data=2,fsdp=2", tmp_path / "full"))
    part = tmp_path / "part"
    run(tiny(checkpoint=CKPT, **_fp8(steps=3)), "data=2,fsdp=2", part)
    run(exp, "data=2,fsdp=2", part)
    np.testing.assert_array_equal(losses(part), full)
    from plait.sample import load

    def scalings(d):  # as plait sample and export read the checkpoint
        return _scalings(jax.tree.map(np.asarray, load(d, 6)[2]))

    a, b = scalings(tmp_path / "full"), scalings(part)
    jax.tree.map(np.testing.assert_array_equal, a, b)
    assert a["attn"]["wqkv"]["x_amax"].shape == (4,)
    # Another precision resumes: the weights and moments carried over, the state
    # dropped (and, back in FP8, started afresh).
    said = {"console": "line"}
    capsys.readouterr()
    plain = tiny(checkpoint=CKPT, log=said, model=ONE_LAYER,
                 train={"global_batch": 8, "steps": 9})
    run(plain, "data=2,fsdp=2", part)
    assert "FP8 scaling state is dropped" in capsys.readouterr().out
    again = tiny(checkpoint=CKPT, log=said, **_fp8(steps=12))
    run(again, "data=2,fsdp=2", part)
    assert "FP8 scaling state starts afresh" in capsys.readouterr().out
    got = losses(part)
    assert len(got) == 12 and np.all(np.isfinite(got)) and got[-1] < got[0]


def test_refusals_are_one_line(tmp_path, capsys):
    from plait.cli import main

    # CPUs have no FP8 units: refused before the run directory is made.
    path = write_experiment(tmp_path / "fp8.toml", tiny(**_fp8(steps=2)))
    assert main(["train", str(path), "--mesh", "data=2", "--run-dir",
                 str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "needs FP8 matrix units" in err and "cpu" in err
    assert not (tmp_path / "run").exists()
    from plait.config_files import load_experiment
    from plait.errors import UserError

    dlrm = tmp_path / "dlrm.toml"
    dlrm.write_text('[model]\nkind = "dlrm"\n[precision]\nmatmul = "fp8"\n')
    with pytest.raises(UserError, match="applies to the decoders"):
        load_experiment(dlrm)
    both = tmp_path / "model.toml"
    both.write_text("[model]\nfp8_history = 16\n")
    with pytest.raises(UserError, match="set by \\[precision\\]"):
        load_experiment(both)
    # Written back, an FP8 experiment reads as itself.
    back = tmp_path / "back.toml"
    back.write_text(tiny(**_fp8()).to_toml())
    assert load_experiment(back).model.fp8_history == 4


def test_a_pipeline_or_local_sgd_with_fp8_is_refused_naming_which(emulate):
    """Each refusal names what the run asked for and its own fix (a DiLoCo run without a
    pipeline was told to drop the pipeline axis)."""
    from plait.errors import UserError
    from plait.tasks import make_task

    with pytest.raises(UserError, match="with a pipeline axis.*; drop the pipeline axis"):
        make_task(tiny(**{**_fp8(), "model": {"layers": 2}}), make_mesh("pipeline=2"))
    with pytest.raises(UserError, match='sync.method = "diloco".*; use sync.method = '
                                        '"allreduce", or set precision.matmul = "default"') as e:
        make_task(tiny(**_fp8(), sync={"method": "diloco"}), make_mesh("data=2"))
    assert "pipeline" not in str(e.value)


def test_the_gelu_of_an_fp8_matmul_stays_out_of_its_epilogue(emulate):
    """GPT-2's MLP under FP8 keeps its first matmul's output apart from the GELU (an
    optimization barrier in the lowered step): XLA:GPU otherwise folds the GELU into the FP8
    cuBLAS call with an auxiliary output and fails to compile it (models.fp8.apart).
    Without FP8, or with Llama's SwiGLU, nothing stands between them."""
    from plait.tasks import make_task

    def barriers(fp8_matmuls: bool, **model) -> int:
        extra = {k: v for k, v in _fp8().items() if k != "model"} if fp8_matmuls else {}
        task = make_task(tiny(model={"layers": 1, **model}, **extra), make_mesh("data=1"))
        return task.step_fn.lower(task.layout.abstract(), task.abstract_batch()
                                  ).as_text().count("optimization_barrier")

    # the step has barriers of its own (remat of the norms and the GELU; SwiGLU's
    # custom VJP has none); FP8 with a GELU adds its own, FP8 with SwiGLU none
    swiglu = {"mlp": "swiglu", "bias": False}
    assert barriers(True) > barriers(False)
    assert barriers(True, **swiglu) == barriers(False, **swiglu)


def test_the_optimizer_leaves_the_scaling_states_moments_as_they_were():
    """fp8.kept_moments: the optimizer's moments of the scaling state (of a zero
    gradient: zeros) are taken from the state before the update, so the step neither
    computes nor writes them; every other leaf keeps its update."""
    from plait.train.state import optimizer

    tx = optimizer(tiny(**_fp8()))[0]
    params = {"w": jnp.ones((4, 4)), "fp8": {"wo": {"x_scale": jnp.ones((1,)),
                                                   "x_amax": jnp.zeros((4,))}}}
    old = tx.init(params)
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5), params)
    _, new = tx.update(grads, old, params)
    kept = fp8.kept_moments(tx, new, old, params)
    for got, before, after, path in zip(jax.tree.leaves(kept), jax.tree.leaves(old),
                                        jax.tree.leaves(new),
                                        jax.tree_util.tree_flatten_with_path(kept)[0],
                                        strict=True):
        names = jax.tree_util.keystr(path[0])
        if "fp8" in names:
            np.testing.assert_array_equal(got, before)
            assert not np.array_equal(after, before)  # the update would have moved it
        else:
            np.testing.assert_array_equal(got, after)
