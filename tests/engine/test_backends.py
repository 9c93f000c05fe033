"""The engine's behaviour on every backend: the same loop must give the same answers
whichever driver runs its steps. Backends come from tests/backends.py
(POOT_TEST_BACKENDS); one without an adapter here is skipped, saying what to install."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant

from poot.engine import SamplingParams
from poot.engine.drivers.base import RowWork, StepPlan
from tests.backends import driver_factory, params

from .harness import greedy, logit_tolerance, make_engine, run_until_idle, submit
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
        driver.step(StepPlan.opening({0: table}))
        out = None
        for start in range(0, len(prompt), chunk):
            piece = prompt[start : start + chunk]
            last = start + len(piece) == len(prompt)
            out = driver.step(StepPlan([RowWork(0, piece, start, table, 1 if last else 0)]))
        driver.step(StepPlan.closing([0]))
        return out.logits[0]

    one_shot = logits(len(prompt))
    atol = logit_tolerance(driver, engine.model.config, 1e-5)
    for chunk in (1, 3, 7, 16, 33):
        np.testing.assert_allclose(logits(chunk), one_shot, atol=atol, rtol=0)


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
        # Rows picked on the device (sampled) and on the host (logprobs) share steps too.
        submit(engine, "sampled", SamplingParams(max_tokens=3, temperature=0.9, top_k=9, top_p=0.9, seed=n))
        submit(engine, "scored", greedy(2, logprobs=1))
        run_until_idle(engine)
    assert engine.metrics()["engine_compiles"] == compiles


# Requests whose tokens the driver may pick (greedy, and seeded sampling with every cut)
# beside requests that need the host's logits (logprobs, penalties, bias, min_tokens until it
# is reached, a prompt being scored).
MIXED = [
    ("a", greedy(12, ignore_eos=True)),
    ("the quick", SamplingParams(max_tokens=12, temperature=0.8, seed=1, ignore_eos=True)),
    ("brown fox", SamplingParams(max_tokens=12, temperature=1.1, top_k=20, seed=2, ignore_eos=True)),
    ("jumps over", SamplingParams(max_tokens=12, temperature=0.9, top_p=0.8, seed=3, ignore_eos=True)),
    ("the lazy", SamplingParams(max_tokens=12, temperature=1.0, top_k=40, top_p=0.9, seed=4)),
    ("dog " * 5, SamplingParams(max_tokens=12, temperature=0.7, seed=5, logprobs=2)),
    ("x" * 30, SamplingParams(max_tokens=12, temperature=0.7, seed=6, frequency_penalty=0.5)),
    ("min", SamplingParams(max_tokens=12, temperature=0.7, seed=7, min_tokens=4, ignore_eos=True)),
    ("echo me", SamplingParams(max_tokens=6, temperature=0.7, seed=8, prompt_logprobs=1)),
    ("bias", greedy(8, logit_bias=((65, 5.0),))),
]


def run_mixed(backend, device_picks: bool, requests=MIXED):
    """Each request's events, with how many steps mixed rows picked on the device and on the host."""
    engine = make_engine(driver_class=functools.partial(driver_factory(backend), device_picks=device_picks))
    inner, mixed = engine.driver.step, []

    def step(plan):
        kinds = {w.pick is not None for w in plan.rows if w.num_logits}
        mixed.append(kinds == {True, False})
        return inner(plan)

    engine.driver.step = step
    recs = [submit(engine, prompt, params)[0] for prompt, params in requests]
    run_until_idle(engine)
    return [r.events for r in recs], sum(mixed)


def test_rows_picked_by_the_driver_give_what_the_host_gives(backend):
    """A step's rows that need nothing but the sampler are picked by the driver, the others
    on the host, in the same step: every request sees exactly what it sees when the host
    picks every row (tokens, text, logprobs, prompt scores)."""
    on_device, mixed = run_mixed(backend, True)
    on_host, _ = run_mixed(backend, False)
    assert mixed > 0
    assert on_device == on_host


def test_a_seed_gives_the_same_tokens_on_every_backend(backend):
    sampled = [(p, q) for p, q in MIXED if q.seed is not None and q.temperature > 0]
    here, _ = run_mixed(backend, True, sampled)
    there, _ = run_mixed("numpy", True, sampled)
    tokens = [[e.token_ids for e in events if hasattr(e, "token_ids")] for events in here]
    assert tokens == [[e.token_ids for e in events if hasattr(e, "token_ids")] for events in there]
    assert len({tuple(t for ids in r for t in ids) for r in tokens}) == len(sampled)


def test_the_plan_names_the_backend_and_its_adapter(backend):
    engine = engine_on(backend)
    assert engine.plan.backend == backend
    assert engine.plan.adapter  # a GPU adapter, or the CPU the NumPy driver times its products on
    if backend == "numpy":
        assert engine.plan.adapter.endswith(" cores")


def test_the_state_machine_holds(backend):
    """The loop's state machine on this backend, with the driver's side of it: the rows it
    was told are open, with the changes the next step plan carries, are exactly the running
    requests' rows, each with its block table."""
    factory = driver_factory(backend)

    class OnBackend(LoopMachine):
        @initialize(memory=st.sampled_from([SMALL_DEVICE, 1 << 30]))
        def start(self, memory):
            self.engine = make_engine(memory_bytes=memory, driver_class=factory)
            self.setup()

        @invariant()
        def the_driver_knows_the_open_rows(self):
            running = {q.row: q.block_table for q in self.engine.scheduler.running}
            opens, closes = self.engine.row_changes.pending()
            told = {row: table for row, table in self.engine.driver.open_rows.items() if row not in closes}
            told.update({o.row: list(o.block_table) for o in opens})
            assert told == running

    OnBackend.TestCase.settings = settings(max_examples=30, stateful_step_count=15,
                                           deadline=None, suppress_health_check=list(HealthCheck))
    OnBackend.TestCase().runTest()
