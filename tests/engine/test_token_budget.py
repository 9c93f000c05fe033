"""The per-step token budget: beside a decoding row, prefill chunks keep to the plan's
token_budget (the decoding rows' tokens first); with no row decoding there is nobody to
stall, so a chunk may take the plan's larger idle_token_budget."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st
from poot_mutants.engine_parts import LaxStepCheck, NoPrefillBudget

from poot.engine import Engine
from poot.engine.drivers.cpu import CpuDriver
from poot.engine.models.synthetic import synthetic_llama
from poot.engine.plan import DeviceInfo, Plan, fit_plan, idle_prefill_chunk, weight_read_tokens

from .harness import greedy, run_until_idle, submit


def budget_engine(token_budget: int, idle_token_budget: int, rows: int = 4, positions: int = 256,
                  driver_class=CpuDriver, **parts) -> Engine:
    model = synthetic_llama(0)
    plan = Plan("numpy", rows, positions, 16, rows * positions // 16, token_budget, model.name,
                idle_token_budget=idle_token_budget)
    driver = driver_class()
    driver.prepare(plan, model)
    return Engine(model, driver, plan, None, **parts)


def record_steps(engine: Engine) -> list[list[tuple[bool, int]]]:
    """Each step as (prefilling?, tokens fed) per row, as the scheduler handed it out."""
    steps: list[list[tuple[bool, int]]] = []
    schedule = engine.scheduler.schedule

    def recorded(*args, **kwargs):
        out = schedule(*args, **kwargs)
        steps.append([(s.seq.prefilling, len(s.work.tokens)) for s in out])
        return out
    engine.scheduler.schedule = recorded
    return steps


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(37 * i + salt) % 200 + 40 for i in range(n)]


def test_a_prompt_alone_is_prefilled_in_chunks_of_the_idle_budget():
    engine = budget_engine(token_budget=16, idle_token_budget=48)
    steps = record_steps(engine)
    submit(engine, prompt(130), greedy(2, ignore_eos=True))
    run_until_idle(engine)
    chunks = [n for step in steps for prefilling, n in step if prefilling]
    assert chunks == [48, 48, 34]


def test_beside_a_decoding_row_prefill_keeps_to_the_token_budget():
    engine = budget_engine(token_budget=16, idle_token_budget=48)
    rec, _ = submit(engine, prompt(5), greedy(60, ignore_eos=True))
    while not rec.token_ids:
        engine.iteration()
    steps = record_steps(engine)
    submit(engine, prompt(100, salt=1), greedy(1))
    run_until_idle(engine)
    chunks = [n for step in steps for prefilling, n in step if prefilling]
    assert chunks and max(chunks) == 15, chunks  # the budget less the decoding row's token
    assert sum(chunks) == 100


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(1, 200), min_size=1, max_size=6),
       max_tokens=st.lists(st.integers(1, 12), min_size=6, max_size=6),
       arrivals=st.lists(st.integers(0, 6), min_size=6, max_size=6),
       budgets=st.sampled_from([(8, 8), (8, 40), (24, 64), (16, 160)]))
def test_every_step_keeps_to_the_budget_that_applies(lengths, max_tokens, arrivals, budgets):
    """Whatever arrives when: a step with a decoding row feeds at most token_budget tokens,
    one without feeds at most idle_token_budget, and every request still finishes."""
    token_budget, idle = budgets
    engine = budget_engine(token_budget, idle)
    steps = record_steps(engine)
    records = []
    pending = sorted(zip(arrivals, lengths, max_tokens, strict=False))
    tick = 0
    while pending or engine.in_flight():
        while pending and pending[0][0] <= tick:
            _, n, m = pending.pop(0)
            records.append(submit(engine, prompt(n, salt=len(records)), greedy(m, ignore_eos=True))[0])
        engine.iteration()
        tick += 1
        assert tick < 2000
    for step in steps:
        fed = sum(n for _, n in step)
        decoding = any(not prefilling for prefilling, _ in step)
        assert fed <= (token_budget if decoding else idle), step
    assert all(r.finished is not None and r.finished.reason == "length" for r in records)


def test_the_idle_budget_is_a_whole_number_of_product_widths_above_the_token_budget():
    model = synthetic_llama(5)
    device = DeviceInfo("numpy", "cpu", 1 << 30, parallel_rows=32, flops_per_byte=11.0, token_multiple=16)
    plan = fit_plan(device, model.config, 0)
    assert plan.idle_token_budget % 16 == 0
    assert plan.idle_token_budget >= idle_prefill_chunk(device) > weight_read_tokens(device)
    assert plan.idle_token_budget > plan.token_budget
    # A plan made without one (an older client's, a test's) falls back to the token budget.
    bare = dataclasses.replace(plan, idle_token_budget=0)
    assert bare.prefill_budget(decoding=False) == bare.token_budget
    assert plan.prefill_budget(decoding=True) == plan.token_budget
    assert plan.prefill_budget(decoding=False) == plan.idle_token_budget


def test_the_step_tokens_histogram_splits_steps_by_whether_a_row_was_decoding():
    """/metrics' engine_step_tokens: what the conformance suite reads to check the budget
    beside decoding rows from outside (counting steps cannot: a decoding row steps on its
    own while a request is still on its way)."""
    engine = budget_engine(token_budget=16, idle_token_budget=48)
    rec, _ = submit(engine, prompt(5), greedy(60, ignore_eos=True))
    while not rec.token_ids:
        engine.iteration()
    submit(engine, prompt(100, salt=1), greedy(1))
    run_until_idle(engine)
    hist = engine.metrics()["engine_step_tokens"]
    assert 16 in hist["bounds"] and 48 in hist["bounds"]
    beside, alone = hist["decoding"], hist["idle"]
    assert alone["count"] == 1 and alone["sum"] == 5  # the first prompt's one step
    assert beside["sum"] == 100 + 60 - 1  # the second prompt's chunks and every decode token
    at_budget = hist["bounds"].index(16)
    assert beside["buckets"][at_budget] == beside["count"], "a decoding step went over the budget"


def test_no_prefill_budget_shows_in_the_histogram():
    engine = budget_engine(token_budget=16, idle_token_budget=48, driver_class=LaxStepCheck,
                           scheduler=NoPrefillBudget)
    rec, _ = submit(engine, prompt(5), greedy(30, ignore_eos=True))
    while not rec.token_ids:
        engine.iteration()
    submit(engine, prompt(100, salt=1), greedy(1))
    run_until_idle(engine)
    hist = engine.metrics()["engine_step_tokens"]
    beside = hist["decoding"]
    assert beside["buckets"][hist["bounds"].index(16)] < beside["count"]


def test_prefill_at_most_doubles_a_step_beside_few_decoding_rows():
    """Beside D decoding rows a step feeds at most 2D + prefill_beside_decoding tokens: a
    step's cost goes as prefill_beside_decoding + its tokens, so prefill at most doubles what the decoding rows'
    own step would cost, however few they are (with 4 rows decoding SmolLM2 on two cores, an
    80-token step took 4.8x a 4-token one)."""
    model = synthetic_llama(0)
    plan = Plan("numpy", 8, 256, 16, 8 * 256 // 16, 40, model.name, idle_token_budget=64, prefill_beside_decoding=6)
    assert [plan.step_budget(d) for d in range(0, 9)] == [64, 8, 10, 12, 14, 16, 18, 20, 22]
    driver = CpuDriver()
    driver.prepare(plan, model)
    engine = Engine(model, driver, plan, None)
    recs = [submit(engine, prompt(3, salt=i), greedy(80, ignore_eos=True))[0] for i in range(3)]
    while not all(r.token_ids for r in recs):
        engine.iteration()
    steps = record_steps(engine)
    submit(engine, prompt(120, salt=9), greedy(1))
    run_until_idle(engine)
    mixed = [step for step in steps if any(p for p, _ in step) and any(not p for p, _ in step)]
    assert mixed, "the long prompt was never prefilled beside the decoding rows"
    for step in mixed:
        decoding = sum(1 for p, _ in step if not p)
        assert sum(n for _, n in step) <= 2 * decoding + 6, step


def test_the_step_budget_rounds_down_to_the_product_width():
    """Products padded to a width cost the padded width, so the cap rounds down to a whole
    number of widths, but never to the decoding rows' own tokens or below."""
    model = synthetic_llama(0)
    plan = Plan("numpy", 32, 256, 16, 32 * 256 // 16, 80, model.name, idle_token_budget=176,
                prefill_beside_decoding=22, token_multiple=16)
    assert plan.step_budget(1) == 16 and plan.step_budget(4) == 16
    assert plan.step_budget(8) == 32 and plan.step_budget(12) == 32
    assert plan.step_budget(20) == 48 and plan.step_budget(31) == 80 and plan.step_budget(32) == 80
    assert all(plan.step_budget(d) <= plan.token_budget for d in range(1, 33))
    assert all(plan.step_budget(d) > d for d in range(1, 33))
    assert all(plan.step_budget(d) % 16 == 0 for d in range(1, 33))
    tiny = dataclasses.replace(plan, prefill_beside_decoding=4)  # 2 * 7 + 4 = 18 rounds to 16; 2 * 5 + 4 = 14 cannot
    assert tiny.step_budget(7) == 16 and tiny.step_budget(5) == 14


def test_a_fitted_plan_caps_prefill_beside_decoding_rows():
    model = synthetic_llama(5)
    device = DeviceInfo("numpy", "cpu", 1 << 30, parallel_rows=32, flops_per_byte=11.0, token_multiple=16)
    plan = fit_plan(device, model.config, 0)
    assert plan.prefill_beside_decoding == weight_read_tokens(device)
    assert plan.as_dict()["prefill_chunk"] == plan.prefill_beside_decoding  # the name /health publishes
    assert plan.token_multiple == 16
    assert plan.token_budget == (2 * 32 + plan.prefill_beside_decoding) // 16 * 16
    assert plan.step_budget(32) == plan.token_budget
