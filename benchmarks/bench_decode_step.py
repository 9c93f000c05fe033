"""One decode step against the number of active rows, and the loop's own overhead.

    .venv/bin/python -m pytest benchmarks/bench_decode_step.py --benchmark-columns=mean,stddev,rounds

The table pytest-benchmark prints gives the step time per row count; the summary test prints
the ratio of each to the one-row step (the point of batching: 32 rows should cost far less
than 32 one-row steps) and the share of an iteration spent outside the driver.
"""

import time

import numpy as np
import pytest

from poot.engine.drivers.base import RowWork, StepPlan
from tests.engine.harness import greedy, make_engine, run_until_idle, submit

ROWS = [1, 2, 4, 8, 16, 32]
CONTEXT = 128


def decode_batch(engine, rows):
    plan = engine.plan
    per_row = plan.blocks_for(CONTEXT + 1)
    batch = []
    for r in range(rows):
        table = list(range(r * per_row, (r + 1) * per_row))
        engine.driver.step(StepPlan.opening({r: table}))
        batch.append(RowWork(r, np.array([65 + r % 26], np.int32), CONTEXT, table, 1))
    return batch


@pytest.fixture(scope="module")
def engine():
    return make_engine()


@pytest.mark.parametrize("rows", ROWS)
def test_decode_step(benchmark, engine, rows):
    batch = decode_batch(engine, rows)
    benchmark.group = "decode step, synthetic model, 128-token context"
    benchmark.extra_info["rows"] = rows
    benchmark(engine.driver.step, batch)


def _mean_step(engine, rows, repeats=30):
    batch = decode_batch(engine, rows)
    engine.driver.step(StepPlan(batch))
    t = time.perf_counter()
    for _ in range(repeats):
        engine.driver.step(StepPlan(batch))
    return (time.perf_counter() - t) / repeats


def test_batching_ratio_and_loop_overhead(engine, capsys):
    one = _mean_step(engine, 1)
    lines = ["rows  step_ms  x_one_row  per_row_vs_alone"]
    for rows in ROWS:
        t = _mean_step(engine, rows)
        lines.append(f"{rows:4d}  {t * 1e3:7.3f}  {t / one:9.2f}  {t / rows / one:16.3f}")
    # Loop overhead: time of whole iterations minus the driver's share, with all rows decoding.
    inner = engine.driver.step
    spent = [0.0]

    def timed(batch):
        t = time.perf_counter()
        try:
            return inner(batch)
        finally:
            spent[0] += time.perf_counter() - t

    engine.driver.step = timed
    for _ in range(engine.plan.rows):
        submit(engine, "overhead " * 4, greedy(64, ignore_eos=True))
    t = time.perf_counter()
    run_until_idle(engine)
    total = time.perf_counter() - t
    engine.driver.step = inner
    share = (total - spent[0]) / total
    lines.append(f"loop overhead outside the driver: {share:.1%} of each iteration "
                 f"({engine.plan.rows} rows, 64 tokens each)")
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    assert 0 < share < 1
