"""Large CPU buffers backed by 2 MiB pages (transparent huge pages).

Looking embedding rows up and updating them is random access over gigabytes:
with 4 KiB pages nearly every row is a TLB miss and a page walk, and on a CPU
those walks, not the arithmetic, bound the bag pooling and the sparse update
(dlrm-bench on the 2-core CPU: bags 260 -> 170 ms, update 433 -> 318 ms in
2 MiB pages; docs/benchmarks.md). Linux gives an anonymous mapping huge pages
only when asked (`/sys/kernel/mm/transparent_hugepage/enabled` is usually
`madvise`), and XLA's allocator does not ask, so plait asks for the buffers
that matter once they exist: madvise(MADV_HUGEPAGE) marks the range,
madvise(MADV_COLLAPSE) (Linux >= 6.1) moves its pages into huge pages instead
of whenever khugepaged gets to them. MADV_COLLAPSE refuses a 2 MiB block whose
pages the kernel is still handling (EINVAL, EAGAIN) and takes it a moment
later, so it runs block by block, a few passes, on a background thread: the
contents never change, the step may already run, and startup does not wait
(2 GiB took 2-25 s here, by free memory). A kernel or machine that refuses costs nothing but
the speed.

Only the 2 MiB-aligned inside of each buffer is advised; buffers on other
platforms (GPU memory) are left alone. Donated steps keep updating the same
buffer, so advising after the state is made or restored is enough.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import time
from collections.abc import Iterable

import jax

PAGE = 2 << 20
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25
MIN_BYTES = 4 * PAGE  # smaller buffers fit the TLB's reach anyway
STALLS = 5


def _madvise():
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _inside(ptr: int, nbytes: int) -> tuple[int, int]:
    """The 2 MiB-aligned range inside [ptr, ptr + nbytes)."""
    start = -(-ptr // PAGE) * PAGE
    end = (ptr + nbytes) // PAGE * PAGE
    return start, max(end - start, 0)


def supported() -> bool:
    return sys.platform.startswith("linux")


def _collapse(ranges: list[tuple[int, int]]) -> None:
    """MADV_COLLAPSE block by block, again for the blocks refused (the kernel takes a
    few hundred MiB per pass here), until none is left or STALLS passes in a row moved
    nothing (what stays is khugepaged's)."""
    madvise = _madvise()
    left = [(s + off, PAGE) for s, n in ranges for off in range(0, n, PAGE)]
    stalls = 0
    while left and stalls < STALLS:
        before = len(left)
        left = [(a, n) for a, n in left if madvise(a, n, MADV_COLLAPSE) != 0]
        stalls = stalls + 1 if len(left) == before else 0
        if left:
            time.sleep(0.05)


def advise(arrays: Iterable[jax.Array], wait: bool = False) -> int:
    """Ask for huge pages under every CPU shard of `arrays` of at least MIN_BYTES: mark
    them now, move them on a background thread (or before returning, with `wait`).
    Returns the bytes marked."""
    if not supported():
        return 0
    arrays = jax.block_until_ready(list(arrays))  # written: a page not there cannot move
    ranges = []
    for a in arrays:
        for shard in a.addressable_shards:
            if shard.device.platform != "cpu" or shard.data.nbytes < MIN_BYTES:
                continue
            start, length = _inside(shard.data.unsafe_buffer_pointer(), shard.data.nbytes)
            if length:
                ranges.append((start, length))
    if not ranges:
        return 0
    madvise = _madvise()
    ranges = [(s, n) for s, n in ranges if madvise(s, n, MADV_HUGEPAGE) == 0]
    if wait:
        _collapse(ranges)
    elif ranges:
        threading.Thread(target=_collapse, args=(ranges,), name="plait-hugepages",
                         daemon=True).start()
    return sum(n for _, n in ranges)


def note(advised: int, what: str) -> str | None:
    """One header line for what advise() did, or None when it did nothing."""
    if not advised:
        return None
    return f"plait: {what} moving to 2 MiB pages ({advised / 2**30:.2f} GiB, in the background)"
