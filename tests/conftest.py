"""Tests run on 8 simulated CPU devices, fixed before JAX starts."""

import os
import sys
from pathlib import Path

import jax
import pytest

jax.config.update("jax_num_cpu_devices", 8)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).parent))

# Many tests compile the same step on the same mesh: share compiled programs.
from helpers import CACHE_DIR, TEST_XLA_FLAGS  # noqa: E402

from plait import xla_flags  # noqa: E402

# Before the backend starts (helpers.TEST_XLA_FLAGS says why), and as a `plait`
# subprocess of a test has them: the compile cache's key hashes every flag (one given
# twice too: pytest-xdist's workers inherit the controller's variable) and the compile
# options XLA read from the variable when its backend started (plait's own defaults
# among them), so only then does a subprocess find what this process compiled.
if TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = " ".join(
        x for x in (os.environ.get("XLA_FLAGS", ""), TEST_XLA_FLAGS) if x)
xla_flags.apply_defaults()

jax.config.update("jax_compilation_cache_dir", CACHE_DIR)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

# Start the backend now: every test then sees the same fixed 8-device process,
# whatever order the tests run in.
assert len(jax.devices()) == 8


@pytest.fixture(scope="session")
def tiny_reference(tmp_path_factory):
    """The losses of `helpers.tiny` over its 12 steps on one device, XLA's loss and norms:
    the reference of every test that trains it on another mesh, in pieces or on a kernel
    (one run per test worker, not one per file)."""
    from helpers import losses, run, tiny

    return losses(run(tiny(), "data=1", tmp_path_factory.mktemp("ref")))


@pytest.fixture(scope="session")
def whole_loss(tiny_reference):
    """The first 6 of tiny_reference: the tests that train 6 steps (the learning-rate
    schedule does not depend on the run's length: helpers.tiny)."""
    return tiny_reference[:6]


@pytest.fixture(scope="session")
def four_layer_reference(tmp_path_factory):
    """The losses of `helpers.tiny` with 4 layers, 12 steps on one device: the reference
    of the pipelines (a layer a stage on pipeline=4) and the stacked layout."""
    from helpers import losses, run, tiny

    return losses(run(tiny(model={"layers": 4}), "data=1", tmp_path_factory.mktemp("ref4")))


def pytest_addoption(parser):
    parser.addoption("--compile-times", metavar="DIR", default=None,
                     help="write each test's wall time and JAX trace/lower/compile seconds "
                          "under DIR (tests/compile_times.py; benchmarks/suite_times.py sums)")


def pytest_configure(config):
    out = config.getoption("--compile-times")
    if out:
        from compile_times import CompileTimes

        config.pluginmanager.register(CompileTimes(Path(out).resolve()), "compile-times")
