"""Embedding tables in 2 MiB pages on CPUs: asked for, moved, contents and losses unchanged."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import make_mesh
from test_dlrm import exp_of

from plait import hugepages
from plait.tasks.dlrm import DLRMTask

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
    reason="needs Linux with transparent huge pages not disabled")

# 2 tables x 80,000 rows x 64 floats: 40 MiB, several 2 MiB blocks.
BIG = ["model.embedding_rows=[80000, 80000]", "model.embedding_dim=64",
       "model.bottom_mlp=[32, 64]", 'embedding.sharding="table"', 'embedding.optimizer="sgd"',
       "embedding.lr=5.0"]


def _mappings():
    """(lo, hi, {field: value}) for each mapping of this process, from /proc/self/smaps."""
    mapping = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head, _, rest = line.partition(" ")
        if "-" in head and not head.endswith(":"):
            if mapping:
                yield mapping
            lo, hi = (int(x, 16) for x in head.split("-"))
            mapping = (lo, hi, {})
        elif mapping:
            mapping[2][head.rstrip(":")] = rest.strip()
    if mapping:
        yield mapping


def vm_flags(ptr: int) -> list[str]:
    """The VmFlags of the mapping holding `ptr` (hg: MADV_HUGEPAGE was applied)."""
    for lo, hi, fields in _mappings():
        if lo <= ptr < hi:
            return fields["VmFlags"].split()
    raise AssertionError(f"no mapping holds {ptr:#x}")


def huge_bytes(start: int, length: int) -> int:
    """Bytes of [start, start + length) in huge pages now (the kernel's account)."""
    total = 0
    for lo, hi, fields in _mappings():
        overlap = min(hi, start + length) - max(lo, start)
        if overlap > 0:
            total += min(int(fields["AnonHugePages"].split()[0]) * 1024, overlap)
    return total


def _buffer(state: dict) -> jax.Array:
    return jax.tree.leaves(state["tables"])[0]


def _ptr(a: jax.Array) -> int:
    return a.addressable_shards[0].data.unsafe_buffer_pointer()


def test_advise_moves_a_buffer_into_huge_pages_without_changing_it():
    a = jax.device_put(jnp.arange(16 * 2**20 // 4, dtype=jnp.float32).reshape(-1, 64) * 0.5,
                       jax.devices()[0])
    before = np.asarray(a).copy()
    marked = hugepages.advise([a], wait=True)
    start, length = hugepages._inside(_ptr(a), a.nbytes)
    assert marked == length >= 6 * hugepages.PAGE
    assert "hg" in vm_flags(start)
    assert huge_bytes(start, length) > 0  # the kernel moved at least part of it
    np.testing.assert_array_equal(np.asarray(a), before)
    small = jnp.ones((1000, 64))
    assert hugepages.advise([small]) == 0  # below MIN_BYTES: left alone


@pytest.mark.parametrize("huge", [True, False])
def test_dlrm_tables_are_asked_into_huge_pages_and_the_step_keeps_them(huge):
    job = DLRMTask(exp_of(*BIG, f"embedding.huge_pages={str(huge).lower()}"),
                   make_mesh("data=1"))
    state = job.init_state()
    ptr = _ptr(_buffer(state))
    inside, _ = hugepages._inside(ptr, _buffer(state).nbytes)  # the advised 2 MiB blocks
    assert ("hg" in vm_flags(inside)) is huge
    assert (job.pages_note is not None) is huge
    if huge:
        assert "2 MiB pages" in job.state_notes()[-1]
    source = job.source()
    for k in range(3):  # the donated step updates the same buffer: the advice stays
        state, _ = job.step_fn(state, job.batch(source, k))
    assert _ptr(_buffer(state)) == ptr


def test_losses_equal_with_and_without_huge_pages():
    """The pages move on a background thread while the steps run: nothing changes."""
    def losses(huge: bool) -> np.ndarray:
        job = DLRMTask(exp_of(*BIG, f"embedding.huge_pages={str(huge).lower()}"),
                       make_mesh("data=1"))
        state, source, out = job.init_state(), job.source(), []
        for k in range(6):
            state, m = job.step_fn(state, job.batch(source, k))
            out.append(float(m["loss"]))
        return np.array(out), np.asarray(_buffer(state))

    (l_on, t_on), (l_off, t_off) = losses(True), losses(False)
    np.testing.assert_array_equal(l_on, l_off)
    np.testing.assert_array_equal(t_on, t_off)
