"""Gives back the pages of file-mapped arrays that have been laid out elsewhere.

A model's block codes come mapped from the loader's cache (one byte a weight, plus their
scales); the products read them once, into the kernels' own layout (two codes a byte), and
never again. Each page read stays in the process's resident set while the file is mapped:
1.4 GB of a Llama 3.2 1B-shaped model, twice what its products hold. MADV_DONTNEED drops
those pages from this process; they stay in the page cache for the next start, and a read
after it maps them again from the file. The arrays are never written (a write to a
copy-on-write page dropped this way would be lost), so nothing changes but the resident set.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable

import numpy as np


def mapping_of(array: np.ndarray) -> mmap.mmap | None:
    """The mmap an array's memory lies in, where it is a view of one."""
    base = array
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    return base if isinstance(base, mmap.mmap) else None


def release(arrays: Iterable[np.ndarray]) -> int:
    """Drops the resident pages of every mapping the arrays lie in; returns the bytes of the
    mappings advised. Arrays in ordinary memory are left alone."""
    seen: dict[int, mmap.mmap] = {}
    for array in arrays:
        mapping = mapping_of(array)
        if mapping is not None and not mapping.closed:
            seen.setdefault(id(mapping), mapping)
    advised = 0
    for mapping in seen.values():
        try:
            mapping.madvise(mmap.MADV_DONTNEED)
        except (AttributeError, OSError, ValueError):  # not Linux, or an empty mapping
            continue
        advised += len(mapping)
    return advised
