"""FP8 matmuls with their operands quantised by parallel.fp8_cast (model.fp8_kernel =
"pallas"), in Pallas's interpreter on CPUs: the kernel's output against a NumPy
emulation, the matmul and its gradients against the quantize-dequantize pattern's
(models.fp8), and training through it on a mesh against the pattern's."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import assert_refused_off_a_gpu, step_in_process, tiny

from plait.models import fp8
from plait.parallel import fp8_cast, fp8_kernel
from plait.parallel.kernel_place import Placement

FORMATS = {"e4m3": (fp8.E4M3, ml_dtypes.float8_e4m3fn, 448.0),
           "e5m2": (fp8.E5M2, ml_dtypes.float8_e5m2, 57344.0)}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_the_kernel_quantises_transposes_and_measures_as_numpy_does(fmt):
    """Blocks past both edges (200 x 96 in 128 x 64 blocks), values past the format's
    largest (clipped), a scale not exact in bfloat16 (rounded first, as flax's quantize
    does)."""
    q_dtype, np_dtype, top = FORMATS[fmt]
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((200, 96)) * 4).astype(np.float32)
    x[3, 5] = 1e4  # past e4m3's range at this scale: clipped
    xb = jnp.asarray(x, jnp.bfloat16)
    scale = jnp.asarray([0.0123], jnp.float32)
    q, qt, amax = fp8_cast.cast_transpose(xb, scale, q_dtype, 1, Placement(None, None, True))
    s = np.float32(ml_dtypes.bfloat16(0.0123))
    xs = np.asarray(xb, np.float32)
    want = np.clip(xs / s, -top, top).astype(np_dtype)
    assert q.dtype == q_dtype and q.shape == x.shape and qt.shape == x.T.shape
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), want.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(qt).view(np.uint8), want.T.view(np.uint8))
    assert float(amax) == np.abs(xs).max()
    assert float(np.asarray(q, np.float32).max()) == (top if fmt == "e4m3" else
                                                      float(want.astype(np.float32).max()))


def _dense(x, w, state, kernel: bool):
    from flax import nnx

    from plait.parallel.ops import dense

    s = fp8.Scaling(4, kernel)
    nnx.update(s, state)
    return dense(x, nnx.Param(w, logical_axes=("heads", "head_dim", "embed"),
                              fan_in=("heads", "head_dim")), s)


def _np_qdq(a: np.ndarray, scale: float, dtype, fmt: str) -> np.ndarray:
    """NumPy's quantised a and back: a / scale (the scale in the compute dtype) clipped
    and rounded once to the format, times the scale (in the compute dtype)."""
    _, np_dtype, top = FORMATS[fmt]
    s = np.float32(np.asarray(jnp.asarray(scale, dtype), np.float32))
    back = np.clip(a / s, -top, top).astype(np_dtype).astype(np.float32) * s
    return np.asarray(jnp.asarray(back, dtype), np.float32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_kernels_matmul_and_gradients_equal_a_numpy_emulation(dtype):
    """Two contracted dimensions (an attention output's heads x head_dim), scales set:
    the product and both gradients are NumPy's products of the quantised operands, and
    the amaxes are reported as the scales' gradients. In float32 all equal the
    quantize-dequantize pattern's (models.fp8, held to NumPy in tests/test_fp8.py); in
    bfloat16 the pattern may round x / scale to bfloat16 before FP8, a value one FP8
    step off where that lands on a tie."""
    from flax import nnx

    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(0, 2.0, (3, 5, 4, 8)), dtype)
    w = jnp.asarray(rng.normal(0, 0.05, (4, 8, 24)), dtype)
    ct = jnp.asarray(rng.normal(0, 1e-3, (3, 5, 24)), dtype)
    scales = {"x": 0.02, "w": 3e-4, "g": 2e-8}
    state = nnx.state(fp8.Scaling(4))
    for q, scale in scales.items():
        state[f"{q}_scale"][...] = jnp.asarray([scale], jnp.float32)
    out = {}
    for kernel in (False, True):
        y, vjp = jax.vjp(lambda x, w, st, k=kernel: _dense(x, w, st, k), x, w, state)
        out[kernel] = (y, *vjp(ct))
    y, dx, dw, ds = out[True]
    f32 = [np.asarray(a, np.float32) for a in (x, w, ct)]
    qx, qw = (_np_qdq(a, scales[k], dtype, "e4m3") for a, k in zip(f32[:2], "xw", strict=True))
    qg = _np_qdq(f32[2], scales["g"], dtype, "e5m2")
    want = (np.einsum("btij,ijo->bto", qx, qw), np.einsum("bto,ijo->btij", qg, qw),
            np.einsum("btij,bto->ijo", qx, qg))
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == jnp.float32 else {"rtol": 1e-2, "atol": 1e-6}
    for got, ref in zip((y, dx, dw), want, strict=True):
        assert got.dtype == dtype
        np.testing.assert_allclose(np.asarray(got, np.float32), ref, **tol)
    for q, a in zip("xwg", f32, strict=True):
        assert float(ds[f"{q}_scale"][...][0]) == np.abs(a).max()
        np.testing.assert_array_equal(ds[f"{q}_amax"][...], 0)
    if dtype == jnp.float32:
        for got, ref in zip(out[True], out[False], strict=True):
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
                np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-12)
    # the scales did something: not the plain product
    assert np.abs(np.asarray(y, np.float32) - np.einsum("btij,ijo->bto", *f32[:2])).max() > 1e-3


def _steps(kernel: str, mesh: str, n: int):
    return step_in_process(tiny(precision={"matmul": "fp8", "fp8_history": 4},
                                model={"layers": 1, "fp8_kernel": kernel},
                                train={"global_batch": 8, "steps": n}), mesh, n)


def test_training_through_the_kernel_equals_the_pattern_on_a_mesh(monkeypatch):
    """data x fsdp: each device quantises its own tokens (the weight gathered), the
    amaxes are the whole batch's, and the losses, the scaling state and every parameter
    after three steps are the quantize-dequantize pattern's -- with GELU and its
    gradient folded into the passes around the MLP's products (b1's gradient their
    column sums) and q / k / v's gradients quantised side by side (their bias's
    gradient the column sums); every matmul of the layer ran the kernel."""
    monkeypatch.setenv(fp8.EMULATE_ENV, "1")
    traced = []
    cast = fp8_kernel.cast_transpose

    def spy(a, scale, q_dtype, lead, at, pre=None, bias=None):
        traced.append((lead, "dgelu" if pre is not None else "gelu" if bias is not None
                       else ""))
        return cast(a, scale, q_dtype, lead, at, pre, bias)

    monkeypatch.setattr(fp8_kernel, "cast_transpose", spy)
    parts = fp8_kernel.cast_transpose_parts
    monkeypatch.setattr(fp8_kernel, "cast_transpose_parts",
                        lambda *a: traced.append((2, "parts")) or parts(*a))
    xla, p_xla = _steps("xla", "data=2,fsdp=2", 3)
    assert not traced
    pallas, p_pallas = _steps("pallas", "data=2,fsdp=2", 3)
    # four matmuls, each x and w forward and its output's gradient backward (traced once
    # each): x and the gradients with two leading (token) dimensions, w with its
    # contracted ones (two for the attention's output projection, one for the others);
    # the MLP's second input its GELU's output, its first gradient GELU's gradient; the
    # fused q / k / v projection's gradient its three parts side by side
    assert sorted(traced) == sorted([(1, "")] * 3 + [(2, "")] * 6 + [
        (2, "gelu"), (2, "dgelu"), (2, "parts")]), traced
    np.testing.assert_allclose(pallas, xla, rtol=1e-6)
    # every parameter after two updates (the first step's learning rate is 0): the
    # weights, the biases (b1's gradient the kernel's column sums) and the scaling state
    flat = jax.tree_util.tree_flatten_with_path(p_xla)[0]
    got = dict(jax.tree_util.tree_flatten_with_path(p_pallas)[0])
    for path, v in flat:
        np.testing.assert_allclose(got[path], v, rtol=1e-5, atol=1e-7, err_msg=str(path))
    for m in ("attn", "mlp"):
        for state in p_xla["blocks"]["0"][m]["fp8"].values():
            assert all(np.all(v[:3] > 0) for k, v in state.items() if k.endswith("_amax"))


def test_the_kernel_asked_off_a_gpu_is_refused_in_one_line(tmp_path, capsys):
    """`model.fp8_kernel = "pallas"` runs a Triton kernel: on a CPU `plait train` ends in
    one line naming the setting and the fix, status 2, before making a run directory."""
    assert_refused_off_a_gpu(tiny(model={"fp8_kernel": "pallas"}), "fp8_kernel", tmp_path,
                             capsys)
