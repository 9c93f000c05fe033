"""Each request's Finished says how long it waited for a row and how long its prefill took."""

from __future__ import annotations

import time

from poot.engine import Engine
from poot.engine.drivers.cpu import CpuDriver
from poot.engine.models.synthetic import synthetic_llama
from poot.engine.plan import Plan

from .harness import greedy, run_until_idle, submit


def one_row_engine() -> Engine:
    model = synthetic_llama(0)
    plan = Plan("numpy", 1, 256, 16, 16, 32, model.name, idle_token_budget=32)
    driver = CpuDriver()
    driver.prepare(plan, model)
    return Engine(model, driver, plan, None)


def test_a_request_behind_a_full_row_reports_its_queue_time():
    engine = one_row_engine()
    first, _ = submit(engine, [40] * 10, greedy(6, ignore_eos=True))
    second, _ = submit(engine, [41] * 70, greedy(2, ignore_eos=True))
    engine.iteration()  # the first takes the only row; the second waits
    time.sleep(0.05)
    run_until_idle(engine)
    a, b = first.finished, second.finished
    assert a.queued_s is not None and b.queued_s is not None
    assert b.queued_s >= 0.05 and b.queued_s > a.queued_s, (a.queued_s, b.queued_s)
    assert a.prefill_s > 0 and b.prefill_s > 0


def test_a_request_cancelled_while_waiting_has_no_prefill_time():
    engine = one_row_engine()
    submit(engine, [40] * 10, greedy(6, ignore_eos=True))
    rec, handle = submit(engine, [41] * 10, greedy(2))
    engine.iteration()
    handle.cancel()
    run_until_idle(engine)
    assert rec.finished.reason == "cancelled"
    assert rec.finished.queued_s is None and rec.finished.prefill_s is None
