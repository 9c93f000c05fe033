"""The constrained-decoding cost table (benchmarks/bench_grammar.py) prints what it measured."""

from __future__ import annotations

from benchmarks.bench_grammar import render, schemas


def test_the_table_gives_each_schema_and_each_share_of_constrained_rows():
    p = {"p50": 1.0, "p99": 2.0, "max": 3.0, "n": 20}
    result = {"cpu": "AMD EPYC", "cores": 2, "flags": ["avx2"], "model": "m", "vocab_size": 49152, "vocabulary_s": 0.3,
              "compile": {name: {"compile": p, "matcher": p} for name, _ in schemas()},
              "mask": {name: p for name, _ in schemas()}, "rows": 32,
              "steps": {0: {**p, "p50": 80.0, "grammar_ms": 0.0}, 32: {**p, "p50": 88.0, "grammar_ms": 1.6}},
              "lone_steps": {0: {**p, "p50": 9.0, "grammar_ms": 0.0}, 1: {**p, "p50": 9.5, "grammar_ms": 0.1}},
              "held": {"compiling_max_ms": 4.0, "idle_max_ms": 3.0}}
    text = render(result)
    assert "| 300 fields | 1.00 ms | 2.00 ms | 3.00 ms | 1.00 ms | 1.000 ms | 2.000 ms |" in text
    assert "| 32 | 88.0 ms | 2.0 ms | 1.10x | 1.60 ms |" in text
    assert "| constrained | 9.5 ms | 2.0 ms | 0.10 ms |" in text
    assert {"clause animal", "clause weather", "anyOf of 300 objects"} <= {name for name, _ in schemas()}
    assert "vocabulary built in 0.30 s" in text and "4.0 ms (with nothing beside it: 3.0 ms)" in text
