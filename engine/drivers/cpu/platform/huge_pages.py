"""Large arrays on 2 MiB pages where Linux lends them (transparent huge pages, which most
distributions leave in `madvise` mode: only memory that asks gets them).

The KV pool is read block by block wherever its blocks lie, and a step reads every weight:
on 4 KiB pages each of those pages costs a TLB entry, and the pool is far larger than the
TLB covers. Measured on SmolLM2 (2-core Zen 4 VM): its decode attention alone (30 layers, 32
rows of 256 keys, float16 KV, a 4096-block pool) took 18.2 ms on 4 KiB pages against 14.5 on
2 MiB pages with each row's blocks scattered over the pool, 11.4 against 11.0 with them in
turn; a whole 32-row step (bench_smollm2.py --scatter) 60.4-61.0 against 58.8-59.0 ms.
"""

from __future__ import annotations

import mmap

import numpy as np

HUGE_PAGE = 2 << 20


def empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """np.empty, but from an anonymous mapping that starts on a 2 MiB boundary and asks for
    huge pages (MADV_HUGEPAGE) when the array spans at least one; a plain np.empty where the
    platform has no such advice. The memory reads as zeros until written."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    nbytes = count * dtype.itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < HUGE_PAGE or advice is None:
        return np.empty(shape, dtype)
    # Private and anonymous: Python's default (shared) is shared memory, which this advice
    # does not reach. The extra page is room to start on a page boundary.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(advice)
    except OSError:  # a kernel built without transparent huge pages: plain pages, still correct
        pass
    raw = np.frombuffer(region, np.uint8)
    start = -raw.ctypes.data % HUGE_PAGE
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def placed(a: np.ndarray) -> np.ndarray:
    """`a`'s values on huge pages: a C-contiguous copy in memory from empty(), or `a` itself
    where it is C-contiguous and smaller than one huge page (no copy for nothing)."""
    if a.nbytes < HUGE_PAGE and a.flags.c_contiguous:
        return a
    out = empty(a.shape, a.dtype)
    out[...] = a
    return out
