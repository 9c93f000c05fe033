"""The product paths' table (benchmarks/bench_product_paths.py) prints what the choice timed."""

from __future__ import annotations

from benchmarks.bench_product_paths import render


def test_the_table_marks_the_chosen_path_and_brackets_the_pruned_ones():
    result = {"cpu": "AMD EPYC", "cores": 2, "flags": ["avx2", "fma"], "isa": "avx2", "mkl": "auto",
              "openblas": "Zen", "shapes": [{"shape": "960x576 x30", "busy": 0.02, "timed": True, "rows": [
                  {"tokens": 1, "chosen": "avx2", "ms": {"avx2": 0.05, "mkl": 0.4, "openblas": 0.1}, "pruned": ["mkl"]},
                  {"tokens": 64, "chosen": "mkl", "ms": {"avx2": 1.5, "mkl": 1.0, "openblas": 1.1}, "pruned": []}]}]}
    text = render(result)
    assert "MKL: auto; OpenBLAS: Zen" in text and "960x576 x30, ms per product; others took 2% of the CPUs" in text
    assert "| tokens | avx2 | mkl | openblas |" in text
    assert "| 1 | 0.050* | [0.400] | 0.100 |" in text
    assert "| 64 | 1.500 | 1.000* | 1.100 |" in text
