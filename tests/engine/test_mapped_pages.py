"""Giving back the pages of file-mapped arrays (engine/drivers/cpu/platform/mapped.py): the
CPU driver reads a model's cached block codes once, into its products' own layout, and the
pages it read must then leave the process's resident set without changing what any array
reads or what a step computes."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest

from poot.engine.drivers.cpu import CpuDriver
from poot.engine.drivers.cpu.platform import mapped
from poot.engine.drivers.cpu.products.integer import integer_path
from poot.engine.drivers.cpu.runtime import shared
from poot.engine.models.gguf_loader import load_gguf
from poot.engine.plan import fit_plan

from ..models.helpers import Q, write_gguf
from .harness import feed_steps
from .test_huge_pages import _resident_bytes_at

pytestmark = pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc/self/smaps")
PAGE = mmap.PAGESIZE


def _mapped_file(path: Path, size: int) -> tuple[mmap.mmap, np.ndarray]:
    path.write_bytes(np.random.default_rng(0).integers(0, 255, size, np.uint8).tobytes())
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # as the loader maps its cache
    return mm, np.frombuffer(mm, np.uint8).reshape(-1, 4096)


def test_release_drops_the_pages_read_and_a_later_read_sees_the_same_bytes(tmp_path):
    mm, a = _mapped_file(tmp_path / "codes.bin", 64 * PAGE)
    before = int(a.sum(dtype=np.int64))  # every page read
    assert _resident_bytes_at(a.ctypes.data) >= 64 * PAGE
    assert mapped.mapping_of(a[3:, 5:]) is mm
    assert mapped.release([a[3:, 5:], a[:1]]) == len(mm)  # views of one mapping: advised once
    assert _resident_bytes_at(a.ctypes.data) == 0
    assert int(a.sum(dtype=np.int64)) == before


def test_release_leaves_arrays_in_ordinary_memory_alone():
    a = np.arange(1 << 20, dtype=np.int32)
    assert mapped.mapping_of(a) is None
    assert mapped.release([a, a[10:]]) == 0
    assert int(a[-1]) == (1 << 20) - 1


@pytest.mark.skipif(integer_path(shared()) is None, reason="products on block codes need the integer kernels")
def test_the_driver_gives_back_the_cached_codes_once_its_products_hold_them(tmp_path, monkeypatch):
    """After prepare, none of the cached codes' pages is resident, the driver keeps no joined
    copy of them, and its steps compute what a driver that kept every page computes."""
    path = tmp_path / "tiny-q4_1.gguf"
    write_gguf(path, seed=3, qtype=Q.Q4_1)
    model = load_gguf(path, cache=True, cache_dir=tmp_path / "cache")
    codes = next(iter(model.block_codes.values())).codes
    assert mapped.mapping_of(codes) is not None

    def prepared() -> CpuDriver:
        driver = CpuDriver(memory_bytes=1 << 30)
        driver.prepare(fit_plan(driver.device(), model.config, driver.weight_bytes(model), model.name), model)
        return driver

    steps = [[(0, [1, 2, 3, 4, 5]), (1, [7])], [(0, [9]), (1, [8, 6])]]
    given_back = prepared()
    assert given_back.products.coded and given_back._codes == (None, {})
    assert _resident_bytes_at(codes.ctypes.data) == 0
    got = feed_steps(given_back, [0, 1], steps)

    monkeypatch.setattr(mapped, "release", lambda arrays: 0)
    kept = prepared()
    assert _resident_bytes_at(codes.ctypes.data) > 0
    for a, b in zip(got, feed_steps(kept, [0, 1], steps), strict=True):
        np.testing.assert_array_equal(a, b)


TRIM_CHILD = r"""
import ctypes
from poot.engine.drivers.cpu.platform.host import trim_heap

libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.mallopt(-3, 64 << 20)  # M_MMAP_THRESHOLD: 32 MiB blocks from the heap, as glibc does once raised
libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: free() keeps what it frees, as a busy heap does

def heap_rss():
    rss, inside = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if "-" in head[0] and not head[0].endswith(":"):
            inside = head[-1] == "[heap]"
        elif inside and head[0] == "Rss:":
            rss += int(head[1]) * 1024
    return rss

big = libc.malloc(32 << 20)
ctypes.memset(big, 1, 32 << 20)  # resident
pin = libc.malloc(4096)  # above it: the heap's top cannot shrink past this
libc.free(big)
before = heap_rss()
print(trim_heap(), before - heap_rss())
"""


def test_trim_heap_hands_back_freed_memory_in_the_middle_of_the_heap():
    """32 MiB freed below a live block stays resident until trimmed (as preparing's large
    temporaries did, 0.29 GB at a 1B shape); trim_heap gives it back. A child process: the
    malloc settings it needs are the whole process's."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", TRIM_CHILD], capture_output=True, text=True, check=True)
    trimmed, given_back = out.stdout.split()
    assert trimmed == "True"
    assert int(given_back) >= 30 << 20, out.stdout
