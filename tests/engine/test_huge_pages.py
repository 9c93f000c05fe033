"""The KV pool and large weight codes on 2 MiB pages (engine/drivers/cpu/platform/huge_pages.py)."""

import re
from pathlib import Path

import numpy as np
import pytest

from poot.engine.drivers.cpu.platform import huge_pages
from poot.engine.drivers.cpu.platform.huge_pages import HUGE_PAGE

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    """The bracketed mode of transparent huge pages (always, madvise, never), None without."""
    try:
        found = re.search(r"\[(\w+)\]", THP.read_text())
    except OSError:
        return None
    return found.group(1) if found else None


def _huge_bytes_at(address: int) -> int:
    """AnonHugePages of the mapping holding `address`, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head.group(1), 16) <= address < int(head.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_large_array_starts_on_a_huge_page_and_behaves_as_np_empty():
    a = huge_pages.empty((3, 1 << 20), np.uint16)
    b = huge_pages.empty((3, 1 << 20), np.uint16)
    assert a.shape == (3, 1 << 20) and a.dtype == np.uint16 and a.flags.c_contiguous and a.flags.writeable
    assert a.ctypes.data % HUGE_PAGE == 0 and b.ctypes.data % HUGE_PAGE == 0
    assert not a.any()  # fresh anonymous memory
    a[...] = 7
    b[...] = 9
    assert (a == 7).all() and (b == 9).all()  # two arrays, two regions


def test_a_small_array_is_a_plain_one():
    a = huge_pages.empty((5, 7), np.float32)
    assert a.shape == (5, 7) and a.dtype == np.float32 and a.flags.owndata


def test_placed_keeps_every_value():
    src = np.random.default_rng(1).standard_normal((1024, 700)).astype(np.float32)
    got = huge_pages.placed(src)
    assert got.ctypes.data % HUGE_PAGE == 0 and np.array_equal(got, src)


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="no transparent huge pages on this kernel")
def test_the_kernel_backs_it_with_huge_pages():
    """The point of it: touched, the array sits on 2 MiB pages (AnonHugePages in smaps)."""
    a = huge_pages.empty((4 * HUGE_PAGE,), np.uint8)
    a.fill(1)
    assert _huge_bytes_at(a.ctypes.data) >= 2 * HUGE_PAGE


def test_the_numpy_drivers_kv_pool_is_allocated_there():
    from poot.engine.drivers.cpu import CpuDriver
    from poot.engine.models.synthetic import synthetic_llama
    from poot.engine.plan import fit_plan

    model = synthetic_llama(3)
    driver = CpuDriver(memory_bytes=1 << 30)
    driver.prepare(fit_plan(driver.device(), model.config, 0, model.name), model)
    layers = [kv for kv in driver.kv if kv is not None]
    assert layers and all(kv.nbytes >= HUGE_PAGE for kv in layers)
    assert all(kv.ctypes.data % HUGE_PAGE == 0 for kv in layers)
