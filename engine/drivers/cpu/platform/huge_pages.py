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

import ctypes
import mmap
import sys
import threading

import numpy as np

HUGE_PAGE = 2 << 20


# Maps every page of a range now, written (as zeros, in a private anonymous mapping), in one
# call: Linux 5.14 and later.
MADV_POPULATE_WRITE = 23


def empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """np.empty, but from an anonymous mapping that starts on a 2 MiB boundary and asks for
    huge pages (MADV_HUGEPAGE) when the array spans at least one; a plain np.empty where the
    platform has no such advice. The memory reads as zeros until written."""
    return _mapped(shape, dtype)[0]


def zeros(shape: tuple[int, ...], dtype) -> np.ndarray:
    """empty(), every page mapped now and zero (+0.0 in any float type)."""
    pending = Zeroing(shape, dtype)
    pending.wait()
    return pending.array


class Zeroing:
    """empty()'s memory being mapped and zeroed beside whatever the caller does next:
    `array` may be handed around at once, but read or written only after `wait()`.

    The kernel maps the range in one call (MADV_POPULATE_WRITE), on a thread of its own that
    holds no lock Python needs; where it cannot (before Linux 5.14, or elsewhere), `wait()`
    writes the zeros itself. For SmolLM2's 1.5 GB KV pool the call took 0.2-0.3 s, writing
    the zeros 0.4-0.8 s; either took 4-6 s in a VM touching memory its host had taken back."""

    def __init__(self, shape: tuple[int, ...], dtype):
        self.array, region, start = _mapped(shape, dtype)
        self._populated = False
        self._thread = None
        madvise = _libc_madvise()
        if region is not None and madvise is not None:
            length = -(-self.array.nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
            address = self.array.ctypes.data

            def populate() -> None:
                self._populated = madvise(address, length, MADV_POPULATE_WRITE) == 0

            self._region = region  # kept mapped until the call returns
            self._thread = threading.Thread(target=populate, name="poot-zeroing", daemon=True)
            self._thread.start()

    def wait(self) -> np.ndarray:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if not self._populated:
            self.array.fill(0)
            self._populated = True
        return self.array


def _libc_madvise():
    """libc's madvise (ctypes lets the calling thread go while it runs), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def _mapped(shape: tuple[int, ...], dtype) -> tuple[np.ndarray, mmap.mmap | None, int]:
    """(the array, its mapping or None, where it starts in the mapping)."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    nbytes = count * dtype.itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < HUGE_PAGE or advice is None:
        return np.empty(shape, dtype), None, 0
    # Private and anonymous: Python's default (shared) is shared memory, which this advice
    # does not reach. The extra page is room to start on a page boundary.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(advice)
    except OSError:  # a kernel built without transparent huge pages: plain pages, still correct
        pass
    raw = np.frombuffer(region, np.uint8)
    start = -raw.ctypes.data % HUGE_PAGE
    return raw[start : start + nbytes].view(dtype).reshape(shape), region, start


def placed(a: np.ndarray) -> np.ndarray:
    """`a`'s values on huge pages: a C-contiguous copy in memory from empty(), or `a` itself
    where it is C-contiguous and smaller than one huge page (no copy for nothing)."""
    if a.nbytes < HUGE_PAGE and a.flags.c_contiguous:
        return a
    out = empty(a.shape, a.dtype)
    out[...] = a
    return out
