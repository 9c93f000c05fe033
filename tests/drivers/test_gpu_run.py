"""The prepared GPU runs (ci/gpu_ptx.sh, ci/gpu_rocm.sh) and their benchmark, as far as a
machine without a GPU can take them: each run stops at once, saying why, and the benchmark
measures a backend."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def gpu_here() -> bool:
    if importlib.util.find_spec("cupy") is None:
        return False
    try:  # CuPy for a platform this machine lacks does not import
        import cupy

        return bool(cupy.is_available())
    except Exception:
        return False


@pytest.mark.skipif(gpu_here(), reason="a GPU is here: the run would run, not stop")
@pytest.mark.parametrize("script, platform", [("gpu_ptx.sh", "CUDA"), ("gpu_rocm.sh", "ROCm")])
def test_the_gpu_run_stops_with_a_reason_where_no_device_exists(tmp_path, script, platform):
    out = tmp_path / "out"
    run = subprocess.run(["bash", f"ci/{script}", "run", str(out)], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHON": sys.executable}, timeout=120)
    assert run.returncode == 2, run.stdout + run.stderr
    said = run.stdout + run.stderr  # the run sends both to its log, and on through tee
    assert f"no {platform} device here" in said and "nothing was run" in said
    assert "Traceback" not in said
    assert f"no {platform} device here" in (out / "run.log").read_text()


@pytest.mark.parametrize("script", ["gpu_ptx.sh", "gpu_rocm.sh"])
def test_the_gpu_script_refuses_an_unknown_verb(script):
    run = subprocess.run(["bash", f"ci/{script}", "go"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert run.returncode == 2 and "usage:" in run.stderr


def test_the_step_benchmark_measures_a_backend_against_its_bound(tmp_path):
    """The benchmark the GPU run ends with, on the NumPy driver and the synthetic model."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_gpu_step
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    path = tmp_path / "bench.json"
    assert bench_gpu_step.main(["--backend", "numpy", "--model", "synthetic", "--context", "24", "--rows", "1,4",
                                "--steps", "2", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    rows = [r["rows"] for r in result["rows"]]
    assert rows[:2] == [1, 4] and rows[-1] == result["plan"]["rows"]
    assert all(r["step_ms"] > 0 and r["bound_ms"] > 0 and r["x_bound"] > 0 for r in result["rows"])
    assert result["compiles_after"] == result["compiles_before"]  # decode steps of any width compile nothing
