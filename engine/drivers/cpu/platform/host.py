"""The host as the plan sees it: the memory a driver may fill, the CPU's name, and which CPU
NumPy's BLAS took it for."""

from __future__ import annotations

import ctypes
import os
import platform
from pathlib import Path


def host_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def usable_cores() -> int:
    """The cores this process may run on (its affinity, which a container or taskset narrows),
    or every core where the platform cannot say."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_name() -> str:
    """The CPU as /proc/cpuinfo names it, with the cores this process may use: the plan
    names it, since the products are chosen by timing on it."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{name}, {usable_cores()} cores"


def blas_core() -> str:
    """The CPU whose kernels NumPy's OpenBLAS runs (its DYNAMIC_ARCH choice, made when NumPy
    loaded it; OPENBLAS_CORETYPE set before then picks another), or "" where that cannot be
    read (another BLAS, another build)."""
    import numpy as np

    for library in sorted((Path(np.__file__).parent.parent / "numpy.libs").glob("*openblas*")):
        try:
            lib = ctypes.CDLL(str(library))
        except OSError:
            continue
        for name in ("scipy_openblas_get_corename64_", "scipy_openblas_get_corename", "openblas_get_corename64_",
                     "openblas_get_corename"):
            corename = getattr(lib, name, None)
            if corename is not None:
                corename.restype = ctypes.c_char_p
                return (corename() or b"").decode()
    return ""


def trim_heap() -> bool:
    """Hands the free memory of the C heap back to the system (glibc's malloc_trim): preparing
    frees large temporaries (the codes' layout, the float32 copies the product choice times),
    and glibc, having raised its mmap threshold as large blocks came and went, kept them in
    the heap. At a Llama 3.2 1B shape 0.29 GB of free heap stayed resident after warm-up.
    False where the C library has no malloc_trim (not glibc)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True

