"""Wherever numba is installed, the CPU kernels build and pass their known-input check.

Every test in test_cpu_kernels.py skips when the kernels are unavailable, and the driver
falls back to plain NumPy without a word: a kernel change that breaks the build (a
signature the check no longer matches, a compiler error) would otherwise look green."""

from __future__ import annotations

import importlib.util

import pytest

from poot.engine.drivers import cpu_kernels


@pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="numba is not installed")
def test_installed_numba_builds_every_kernel():
    assert cpu_kernels.available(), cpu_kernels.unavailable_reason()
