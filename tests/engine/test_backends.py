"""The engine's behaviour on every backend: the same loop must give the same answers
whichever driver runs its steps. Backends come from tests/backends.py
(POOT_TEST_BACKENDS); one without an adapter here is skipped, saying what to install."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant

from poot.engine.drivers.base import RowWork
from tests.backends import driver_factory, params

from .harness import greedy, make_engine, run_until_idle, submit
from .test_state_machine import SMALL_DEVICE, LoopMachine

pytestmark = pytest.mark.parametrize("backend", params())


def engine_on(backend, **kw):
    return make_engine(driver_class=driver_factory(backend), **kw)


def test_each_request_gets_the_same_tokens_batched_as_alone(backend):
    prompts = ["a", "the quick brown fox", "x" * 37, "rows at different lengths " * 3]
    alone = []
    for p in prompts:
        engine = engine_on(backend)
        rec, _ = submit(engine, p, greedy(6, ignore_eos=True))
        run_until_idle(engine)
        alone.append(rec.token_ids)
    engine = engine_on(backend)
    recs = [submit(engine, p, greedy(6, ignore_eos=True))[0] for p in prompts]
    run_until_idle(engine)
    assert [r.token_ids for r in recs] == alone


def test_chunked_prefill_equals_one_shot(backend):
    engine = engine_on(backend)
    driver, plan = engine.driver, engine.plan
    prompt = np.random.default_rng(0).integers(0, 256, 61).astype(np.int32)
    table = list(range(plan.blocks_for(len(prompt))))

    def logits(chunk):
        driver.open_row(0, table)
        out = None
        for start in range(0, len(prompt), chunk):
            piece = prompt[start : start + chunk]
            last = start + len(piece) == len(prompt)
            out = driver.step([RowWork(0, piece, start, table, 1 if last else 0)])
        driver.close_row(0)
        return out.logits[0]

    one_shot = logits(len(prompt))
    for chunk in (1, 3, 7, 16, 33):
        np.testing.assert_allclose(logits(chunk), one_shot, atol=1e-5, rtol=0)


@pytest.mark.parametrize("stage", ["queued", "prefilling", "decoding"])
def test_cancellation_releases_the_request_within_one_iteration(backend, stage):
    engine = engine_on(backend)
    prompt = "z" * (engine.plan.token_budget + 20)  # prefill takes two steps
    rec, handle = submit(engine, prompt, greedy(50, ignore_eos=True))
    if stage != "queued":
        engine.iteration()
        assert engine.metrics()["engine_requests_running"] == 1
    if stage == "decoding":
        while not rec.token_ids:
            engine.iteration()
    handle.cancel()
    engine.iteration()
    assert rec.finished is not None and rec.finished.reason == "cancelled"
    m = engine.metrics()
    assert m["engine_requests_running"] == 0 and m["kv_blocks_reserved"] == 0
    assert not engine.in_flight() and not engine.driver.open_rows


def test_compile_count_is_constant_from_prepare_whatever_comes_after(backend):
    engine = engine_on(backend)
    compiles = engine.metrics()["engine_compiles"]
    assert compiles > 0
    for n in (1, 3, 8):
        for i in range(n):
            submit(engine, "p" * (1 + 37 * i % 200), greedy(1 + i % 5))
        run_until_idle(engine)
    assert engine.metrics()["engine_compiles"] == compiles


def test_the_plan_names_the_backend_and_its_adapter(backend):
    engine = engine_on(backend)
    assert engine.plan.backend == backend
    assert bool(engine.plan.adapter) == (backend != "numpy")


def test_the_state_machine_holds(backend):
    """The loop's state machine on this backend, with the driver's side of it: the rows it
    was told are open are exactly the running requests' rows, each with its block table."""
    factory = driver_factory(backend)

    class OnBackend(LoopMachine):
        @initialize(memory=st.sampled_from([SMALL_DEVICE, 1 << 30]))
        def start(self, memory):
            self.engine = make_engine(memory_bytes=memory, driver_class=factory)
            self.setup()

        @invariant()
        def the_driver_knows_the_open_rows(self):
            running = {q.row: q.block_table for q in self.engine.scheduler.running}
            assert self.engine.driver.open_rows == running

    OnBackend.TestCase.settings = settings(max_examples=30, stateful_step_count=15,
                                           deadline=None, suppress_health_check=list(HealthCheck))
    OnBackend.TestCase().runTest()
