"""The library comparison benchmark (benchmarks/bench_libraries.py): its products are checked
against float64, and its closing lines do the arithmetic they claim."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import bench_libraries as bench


@pytest.fixture(scope="module")
def model(smollm2):
    return bench._model()


def test_openblas_measures_every_plan_shape_and_agrees_with_float64(model):
    config, prepared, plan = model
    lib = bench.OpenBLAS(config, prepared)
    assert lib.check() < 1e-5
    times = {}
    for tokens in (1, plan.rows, 48):
        run = lib.products(tokens, min(tokens, plan.rows))
        times[tokens] = min(bench._timeit(run, 0.0, min_repeats=1, warmup=False))
    assert all(t > 0 for t in times.values())


def test_a_wrong_library_is_caught_by_the_check(model):
    config, prepared, _ = model

    class Off(bench.OpenBLAS):
        def product(self, w, head):
            return lambda x: (w @ x) * np.float32(1.001)

    assert Off(config, prepared).check() > 1e-4


def test_an_absent_library_is_listed_not_measured(monkeypatch):
    def absent(config, prepared):
        raise bench.Unavailable("not installed (nothing)")

    monkeypatch.setattr(bench, "_model", lambda: (None, None, type("P", (), {"rows": 4, "token_budget": 8,
                                                                            "max_step_tokens": 16})()))
    monkeypatch.setitem(bench.CLASSES, "torch", absent)
    assert bench.measure("torch", 32, 0.0) == {"library": "torch", "unavailable": "not installed (nothing)"}


def test_closing_lines_do_their_arithmetic():
    gemm, bandwidth = 100e9, 10e9
    plan = {"rows": 4, "token_budget": 8, "idle": 16, "kv_bytes_per_token": 1000}
    fast = {"library": "fast", "error": 1e-7, "plan": plan, "attention": {"s": 0.1, "flops": 1e9},
            "products": {"4": {"s": 0.2, "flops": 10e9}, "16": {"s": 0.4, "flops": 30e9},
                         "32": {"s": 0.5, "flops": 40e9}}}
    slow = {"library": "slow", "error": 1e-7, "plan": plan, "attention": None,
            "products": {"4": {"s": 0.4, "flops": 10e9}, "16": {"s": 0.2, "flops": 30e9},
                         "32": {"s": 1.0, "flops": 40e9}}}
    text = bench.table([fast, slow, {"library": "gone", "unavailable": "not installed (x)"}], gemm, bandwidth,
                       prompt=32, context=250)
    lines = text.splitlines()
    assert any(line.startswith("gone") and "not installed (x)" in line for line in lines)
    # full rows: 10 GFLOP in 0.2 s = 50%; the KV read is 4 * 250 * 1000 B / 10 GB/s = 0.1 ms.
    full = next(line for line in lines if line.startswith("full rows (4)"))
    assert "(fast) reach 50%" in full and "0.1 ms" in full and ") 50%," in full
    one_step = next(line for line in lines if "in one step" in line)
    assert "(fast) 500 ms" in one_step and "(fast) 100 ms" in one_step
    assert "= 67% of the GEMM ceiling" in one_step  # 40 GFLOP / 0.6 s / 100 GFLOP/s
    chunks = next(line for line in lines if "in chunks of 16" in line)
    assert "(slow) 400 ms" in chunks  # 0.2 s per 16 tokens, twice
    assert "= 80% of the GEMM ceiling" in chunks  # 40 GFLOP / 0.5 s


def test_rounds_keep_each_cells_fastest_time():
    a = {"library": "x", "error": 1e-7, "attention": {"s": 0.3, "flops": 1}, "products": {"1": {"s": 0.2, "flops": 1},
                                                                                         "4": {"s": 0.5, "flops": 1}}}
    b = {"library": "x", "error": 2e-7, "attention": {"s": 0.2, "flops": 1}, "products": {"1": {"s": 0.4, "flops": 1},
                                                                                         "4": {"s": 0.1, "flops": 1}}}
    merged = bench.merge(bench.merge(None, a), b)
    assert [merged["products"][t]["s"] for t in ("1", "4")] == [0.2, 0.1]
    assert merged["attention"]["s"] == 0.2 and merged["error"] == 2e-7
    # A round in which the library failed keeps the rounds that measured it.
    assert bench.merge(merged, {"library": "x", "unavailable": "failed"}) is merged
