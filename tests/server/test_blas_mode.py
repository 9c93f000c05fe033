"""poot-serve held to AVX2 (POOT_CPU_ISA=avx2) holds NumPy's OpenBLAS to AVX2's kernels too:
OpenBLAS picks them by the CPU as NumPy loads, before the driver can, so the command sets
OPENBLAS_CORETYPE first; the driver warns wherever a process still runs past the mode."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from poot import extras
from poot.engine.drivers.cpu import target
from poot.engine.drivers.cpu.platform.host import blas_core


@pytest.mark.parametrize(("mode", "core"), [("avx2", "Haswell"), ("AVX2 ", "Haswell"), ("native", None), ("", None)])
def test_the_serve_command_asks_openblas_for_the_modes_kernels(monkeypatch, mode, core):
    monkeypatch.setenv(target.VARIABLE, mode)
    monkeypatch.delenv("OPENBLAS_CORETYPE", raising=False)
    monkeypatch.setattr(extras, "_run", lambda *args: 0)
    assert extras.serve() == 0
    assert os.environ.get("OPENBLAS_CORETYPE") == core


def test_a_core_the_operator_named_is_kept(monkeypatch):
    monkeypatch.setenv(target.VARIABLE, "avx2")
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Zen")
    monkeypatch.setattr(extras, "_run", lambda *args: 0)
    extras.serve()
    assert os.environ["OPENBLAS_CORETYPE"] == "Zen"


def test_openblas_runs_the_core_it_was_asked_for_and_the_driver_says_when_it_goes_past_avx2():
    probe = "from poot.engine.drivers.cpu.platform.host import blas_core; print(blas_core())"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OPENBLAS_CORETYPE": "Haswell"})
    assert done.returncode == 0, done.stderr
    if not blas_core():
        pytest.skip("NumPy's BLAS here does not name its core")
    assert done.stdout.strip() == "Haswell"
    assert target.blas_warning("avx2", "Haswell") == ""
    assert "OPENBLAS_CORETYPE=Haswell" in target.blas_warning("avx2", "SkylakeX")
    assert target.blas_warning("native", "SkylakeX") == ""
