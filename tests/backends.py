"""The backends the engine's backend-parametrized tests run on, and a driver for each.

`POOT_TEST_BACKENDS` (comma-separated; default numpy,wgpu,vulkan,ptx,rocm) chooses them:
`tox -e vulkan` sets it to vulkan alone, `tox -e ptx` to ptx. A backend with no adapter or
device on this machine is skipped with the reason its driver gives, which says what to
install or what is missing (ptx and rocm: CuPy, its platform, a device).
"""

from __future__ import annotations

import functools
import os

import pytest

# Mesa prints a warning per process without it; lavapipe's threads fight BLAS's on a small
# machine, so both get a fixed count unless the environment set one.
os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")
os.environ.setdefault("LP_NUM_THREADS", "2")

ALL = ("numpy", "wgpu", "vulkan", "ptx", "rocm")
CUPY = ("ptx", "rocm")


def selected() -> list[str]:
    names = [b.strip() for b in os.environ.get("POOT_TEST_BACKENDS", ",".join(ALL)).split(",") if b.strip()]
    unknown = set(names) - set(ALL)
    if unknown:
        raise ValueError(f"POOT_TEST_BACKENDS names unknown backends: {', '.join(sorted(unknown))}")
    return names


@functools.cache
def missing(backend: str) -> str | None:
    """Why `backend` cannot run here, or None."""
    if backend == "numpy":
        return None
    if backend in CUPY:
        from poot.engine.drivers import cupy_device

        try:
            cupy_device.check_arch(cupy_device.probe(backend), backend)
            cupy_device.check_toolchain(backend)
        except cupy_device.NoDevice as e:
            return str(e)
        return None
    from poot.engine.drivers.wgpu_driver import NoAdapter, pick_adapter

    try:
        pick_adapter(backend)
    except NoAdapter as e:
        return str(e)
    return None


def driver_factory(backend: str):
    """A callable(memory_bytes=...) -> driver on `backend`, or a skip."""
    reason = missing(backend)
    if reason:
        pytest.skip(reason)
    if backend == "numpy":
        from poot.engine.drivers.cpu import CpuDriver

        return CpuDriver
    if backend in CUPY:
        from poot.engine.drivers.cupy_driver import CupyDriver

        return functools.partial(CupyDriver, backend)
    from poot.engine.drivers.wgpu_driver import WgpuDriver

    return functools.partial(WgpuDriver, backend)


def params():
    """pytest.param per selected backend, marked with its name (`-m vulkan`)."""
    return [pytest.param(b, id=b) for b in selected()]
