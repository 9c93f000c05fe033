"""Wherever numba is installed, the CPU kernels build and pass their known-input check.

Every test in test_cpu_kernels.py skips when the kernels are unavailable, and the driver
falls back to plain NumPy with no more than a warning in the log: a kernel change that
breaks the build (a signature the check no longer matches, a compiler error) would otherwise
look green."""

from __future__ import annotations

import importlib.util

import pytest

from poot.engine.drivers.cpu.runtime import shared

runtime = shared()


@pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="numba is not installed")
def test_installed_numba_builds_every_kernel():
    assert runtime.available(), runtime.unavailable_reason()


@pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="numba is not installed")
def test_every_kernel_releases_the_gil():
    """The engine thread runs the kernels while the server's event loop streams tokens and
    answers /health: a kernel that held the GIL would stop that loop for its whole run."""
    from numba.core.registry import CPUDispatcher

    runtime.compile()
    modules = list(runtime.kernels)  # every kernel module of engine/drivers/cpu/kernels/
    kernels = {name: f for module in modules for name, f in vars(module).items()
               if isinstance(f, CPUDispatcher) and not f.targetoptions.get("inline") == "always"}
    assert len(kernels) >= 10
    holding = sorted(name for name, f in kernels.items() if not f.targetoptions.get("nogil"))
    assert not holding, f"kernels that hold the GIL: {holding}"


def test_a_driver_without_its_kernels_says_so_in_the_log(monkeypatch, caplog):
    """Several times slower on the plain NumPy path: the operator reads why in the log."""
    from poot.engine.drivers.cpu import CpuDriver
    from poot.engine.models.synthetic import synthetic_llama
    from poot.engine.plan import fit_plan

    monkeypatch.setattr(runtime, "available", lambda: False)
    monkeypatch.setattr(runtime, "error", "ImportError: no numba here")
    model = synthetic_llama(0)
    driver = CpuDriver(memory_bytes=1 << 30)
    with caplog.at_level("WARNING", logger="poot.engine"):
        driver.prepare(fit_plan(driver.device(), model.config, 0, model.name), model)
    assert driver.products is None
    assert "no numba here" in caplog.text and "plain NumPy path" in caplog.text
