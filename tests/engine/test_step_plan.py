"""The step plan is the one way the engine reaches a driver: rows taken and left travel in it
(engine/row_changes.py keeps them until a plan carries them), a refused plan changes nothing,
and a plan sent again after a refusal leaves the driver as one sending did."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poot.engine import Engine
from poot.engine.drivers.cpu import CpuDriver
from poot.engine.models.synthetic import synthetic_llama
from poot.engine.row_changes import RowChanges
from poot.engine.step import RowOpen, RowWork, StepPlan, StepRefused

from .harness import greedy, make_engine, run_until_idle, submit

ROWS = 4


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["open", "close", "send"]), st.integers(0, ROWS - 1)), max_size=40))
def test_the_rows_a_driver_was_told_are_the_rows_taken(ops):
    """Whatever opens, closes and sends come in whatever order: once the pending changes
    are applied as a plan applies them (closes, then opens), the driver's rows are the ones
    taken, each with its latest table; a row taken and left between two sends is never told."""
    changes, taken, driver_rows = RowChanges(), {}, {}
    version = 0
    for op, row in ops:
        if op == "open" and row not in taken:
            version += 1
            taken[row] = (version,)
            changes.open(row, [version])
        elif op == "close" and row in taken:
            del taken[row]
            changes.close(row)
        elif op == "send":
            opens, closes = changes.pending()
            plan = StepPlan((), opens, closes)
            assert plan.open_after(driver_rows) == set(taken)
            for r in closes:
                driver_rows.pop(r, None)
            driver_rows.update({o.row: o.block_table for o in opens})
            changes.delivered()
            assert driver_rows == taken and not changes
    closes = changes.pending()[1]
    assert len(closes) == len(set(closes))  # a row is told closed once


def opened_driver():
    driver = CpuDriver(memory_bytes=1 << 28)
    Engine.create(synthetic_llama(0), driver=driver)
    return driver


def test_a_refused_plan_opens_and_closes_nothing():
    driver = opened_driver()
    driver.step(StepPlan.opening({0: [0, 1]}))
    too_many = StepPlan([RowWork(r, np.array([1], np.int32), 0, [r], 1) for r in range(driver.plan.rows + 1)],
                        opens=[RowOpen(1, (2,))], closes=[0])
    with pytest.raises(StepRefused, match="exceeds the plan"):
        driver.step(too_many)
    assert driver.open_rows == {0: [0, 1]}
    with pytest.raises(StepRefused, match="row 2 was not opened"):
        driver.step(StepPlan([RowWork(2, np.array([1], np.int32), 0, [3], 1)], opens=[RowOpen(1, (2,))]))
    with pytest.raises(StepRefused, match="outside"):
        driver.step(StepPlan.opening({driver.plan.rows: [4]}))
    assert driver.open_rows == {0: [0, 1]}


def test_a_plan_opens_and_closes_before_its_rows_run_and_again_is_the_same():
    driver = opened_driver()
    plan = StepPlan.opening({1: [3]}, [RowWork(1, np.array([5, 6], np.int32), 0, [3], 1)])
    first = driver.step(plan).logits
    driver.step(StepPlan(closes=[1]))
    again = StepPlan.opening({1: [3]})
    driver.step(again)
    driver.step(again)  # told twice, as after a refused step: the same row, the same table
    assert driver.open_rows == {1: [3]}
    np.testing.assert_array_equal(driver.step(StepPlan([RowWork(1, np.array([5, 6], np.int32), 0, [3], 1)])).logits,
                                  first)
    assert driver.step(StepPlan.closing([1])).picked == [] and driver.open_rows == {}


def test_the_engine_reaches_the_driver_through_step_plans_alone():
    """Rows are opened and closed inside step() alone, before the rows of that plan run; the
    rows a finished request left are told by the next plan, an idle one if nothing else runs."""
    engine = make_engine()
    driver, calls, inside = engine.driver, [], []
    for name in ("_open_row", "_close_row", "run_step"):
        inner = getattr(driver, name)
        setattr(driver, name, lambda *a, inner=inner, name=name: calls.append((name, bool(inside))) or inner(*a))
    step = driver.step

    def traced(plan):
        inside.append(plan)
        try:
            return step(plan)
        finally:
            inside.pop()

    driver.step = traced
    submit(engine, "hello there", greedy(3, ignore_eos=True))
    submit(engine, "and again", greedy(2, ignore_eos=True))
    run_until_idle(engine)
    assert driver.open_rows and engine.row_changes  # left, and not yet told
    engine.iteration()  # nothing to run: the plan only closes
    assert driver.open_rows == {} and not engine.row_changes
    names = [n for n, _ in calls]
    assert all(within for _, within in calls), calls
    assert names.count("_open_row") == 2 and names.count("_close_row") == 2
    assert names.index("_open_row") < names.index("run_step")
