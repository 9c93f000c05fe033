"""The loop's observable rules: admission order, waiting for room, no preemption,
constant compiles, cancellation within one iteration, stop rules, bad input."""

import pytest
from poot_mutants.engine_parts import DieFreesBlocks, RecompileOnBatchChange, YoungestFirst

from poot.engine import InvalidRequest, SamplingParams
from poot.engine.events import Finished, Rejected, Tokens

from .harness import greedy, make_engine, run_until_idle, submit


def test_a_request_runs_to_max_tokens_and_returns_everything():
    engine = make_engine()
    rec, _ = submit(engine, "hello", greedy(12, ignore_eos=True))
    run_until_idle(engine)
    assert rec.finished.reason == "length"
    assert len(rec.token_ids) == 12 == rec.finished.completion_tokens
    assert engine.pool.num_free == engine.plan.num_blocks  # cached prefix blocks count as room
    assert engine.metrics()["kv_blocks_reserved"] == 0


def test_admission_is_oldest_first_and_the_oldest_that_does_not_fit_blocks_younger_ones():
    engine = make_engine()
    rows = engine.plan.rows
    fill = [submit(engine, "x" * 4, greedy(40, ignore_eos=True))[0] for _ in range(rows)]
    engine.iteration()
    assert engine.metrics()["engine_requests_running"] == rows
    old, _ = submit(engine, "old", greedy(4, ignore_eos=True))
    young, _ = submit(engine, "young", greedy(4, ignore_eos=True))
    engine.iteration()
    assert not old.token_ids and not young.token_ids  # no row: both wait, nothing preempted
    assert all(r.finished is None for r in fill)
    run_until_idle(engine)
    assert old.finished.reason == young.finished.reason == "length"


def first_token_iterations(engine, waiting=6):
    """Fills every row with requests that retire one per iteration, queues `waiting` more,
    and returns the iteration at which each queued request (oldest first) got its first token."""
    for i in range(engine.plan.rows):
        submit(engine, "f", greedy(2 + i, ignore_eos=True))
    engine.iteration()
    queued = [submit(engine, "w", greedy(30, ignore_eos=True))[0] for _ in range(waiting)]
    seen = [None] * waiting
    for it in range(400):
        engine.iteration()
        for i, rec in enumerate(queued):
            if rec.token_ids and seen[i] is None:
                seen[i] = it
        if all(s is not None for s in seen):
            break
    run_until_idle(engine)
    return seen


def test_older_requests_are_opened_before_younger_ones_when_rows_free_up():
    seen = first_token_iterations(make_engine())
    assert seen == sorted(seen) and len(set(seen)) == len(seen)


def test_youngest_first_mutation_breaks_the_admission_order_check():
    seen = first_token_iterations(make_engine(scheduler=YoungestFirst))
    assert seen != sorted(seen)


def test_a_request_that_finds_no_kv_room_waits_and_starts_when_room_frees():
    # A small device: room for about two full-length sequences (a float16 KV cache).
    engine = make_engine(memory_bytes=2 << 20)
    plan = engine.plan
    big = plan.positions - 8
    a, _ = submit(engine, "a" * 4, greedy(big, ignore_eos=True))
    b, _ = submit(engine, "b" * 4, greedy(big, ignore_eos=True))
    c, _ = submit(engine, "c" * 4, greedy(big, ignore_eos=True))
    engine.iteration()
    blocks_each = plan.blocks_for(4 + big)
    admitted = plan.num_blocks // blocks_each
    assert 1 <= admitted < 3, "the test needs a pool that holds fewer than three"
    running = engine.metrics()["engine_requests_running"]
    assert running == admitted
    run_until_idle(engine)
    for rec in (a, b, c):
        assert rec.finished.reason == "length" and len(rec.token_ids) == big


@pytest.mark.parametrize("packed", [False, True], ids=["blas", "mkl"])
def test_compile_count_is_constant_from_prepare_whatever_comes_after(packed, monkeypatch):
    """Whatever the step's shape (prefill chunks of any length, decode batches of any
    size), nothing compiles after the driver prepared. With MKL's packed products (every
    weight of the tiny model packed) a product's result is a view of a padded array: the
    kernels that take it must not build a second version for that layout."""
    from poot.engine.drivers.cpu.platform import mkl as mkl_products

    if packed:
        if not mkl_products.available():
            pytest.skip(mkl_products.unavailable_reason())
        monkeypatch.setattr(mkl_products, "MIN_PACKED_WEIGHTS", 1)
    engine = make_engine()
    if packed:
        assert engine.driver.products.packed > 0
    compiles = engine.metrics()["engine_compiles"]
    submit(engine, "warm", greedy(2))
    run_until_idle(engine)
    for n in (1, 3, 7, 32):
        for i in range(n):
            submit(engine, "p" * (1 + 37 * i % 200), greedy(1 + i % 9))
        run_until_idle(engine)
    assert engine.metrics()["engine_compiles"] == compiles


def test_recompile_mutation_is_caught_by_the_compile_count_check():
    engine = make_engine(driver_class=RecompileOnBatchChange)
    submit(engine, "warm", greedy(2))
    run_until_idle(engine)
    compiles = engine.metrics()["engine_compiles"]
    for i in range(3):
        submit(engine, "p" * (i + 1), greedy(3))
    run_until_idle(engine)
    assert engine.metrics()["engine_compiles"] != compiles


@pytest.mark.parametrize("stage", ["queued", "prefilling", "decoding"])
def test_cancellation_releases_the_request_within_one_iteration(stage):
    engine = make_engine()
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
    assert not engine.in_flight()


def test_a_stop_string_ends_the_output_before_it_and_is_never_streamed():
    engine = make_engine()
    probe, _ = submit(engine, "The quick brown fox", greedy(40, ignore_eos=True))
    run_until_idle(engine)
    text = probe.text
    stop = text[17:21]  # a string the model is known to produce, likely across tokens
    assert len(stop) == 4
    rec, _ = submit(engine, "The quick brown fox", greedy(40, ignore_eos=True, stop=(stop,)))
    run_until_idle(engine)
    assert rec.finished.reason == "stop"
    assert rec.text == text[: text.index(stop)]
    streamed = "".join(e.text for e in rec.events if isinstance(e, Tokens))
    assert stop not in streamed + rec.finished.text


def test_eos_ends_a_request_with_reason_stop_and_no_eos_text():
    from poot.engine import Engine
    from poot.engine.drivers.cpu import CpuDriver
    from poot.engine.models.synthetic import synthetic_llama

    # Its own model: the test edits the weights.
    engine = Engine.create(synthetic_llama(0), driver=CpuDriver(memory_bytes=1 << 30))
    probe, _ = submit(engine, "eos", greedy(3, ignore_eos=True))
    run_until_idle(engine)
    first, second = probe.token_ids[:2]
    # Make EOS the model's choice after the first token: its head row becomes the second
    # token's row, doubled, so its logit is twice the winning (positive) one.
    eos = next(iter(engine.model.tokenizer.eos_token_ids))
    head = engine.driver.weights["lm_head"]
    head[eos] = 2 * head[second]
    rec, _ = submit(engine, "eos", greedy(10))
    run_until_idle(engine)
    assert rec.token_ids in ([first, eos], [eos])  # EOS may win already at the first token
    assert rec.finished.reason == "stop" and rec.finished.completion_tokens == len(rec.token_ids)
    assert rec.text == engine.model.tokenizer.decode(rec.token_ids[:-1])
    ignoring, _ = submit(engine, "eos", greedy(4, ignore_eos=True))
    run_until_idle(engine)
    assert ignoring.finished.reason == "length"


@pytest.mark.parametrize("prompt, params, param", [
    ("", greedy(4), "prompt"),
    ([], greedy(4), "prompt"),
    ("a" * 600, greedy(4), "max_tokens"),
    ("hi", greedy(600), "max_tokens"),
    ([1, 2, 99999], greedy(4), "prompt"),
    ([1, "a"], greedy(4), "prompt"),
])
def test_requests_that_can_never_fit_are_rejected_without_touching_state(prompt, params, param):
    engine = make_engine()
    rec, _ = submit(engine, prompt, params)
    engine.iteration()
    assert isinstance(rec.finished, Rejected) and rec.finished.param == param
    assert not rec.accepted and not engine.in_flight()
    assert engine.metrics()["kv_blocks_reserved"] == 0


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(max_tokens=-3), dict(max_tokens=2.5),
                                 dict(max_tokens=True), dict(temperature=-1), dict(top_p=0),
                                 dict(top_k=-1), dict(seed="x"), dict(stop=("",))])
def test_invalid_sampling_parameters_are_refused_at_submission(bad):
    engine = make_engine()
    with pytest.raises(InvalidRequest):
        engine.submit("hi", SamplingParams(**bad), lambda e: None)
    assert not engine.in_flight()


def test_a_refused_step_fails_only_its_requests_and_serving_goes_on():
    engine = make_engine()
    rec, _ = submit(engine, "one", greedy(20, ignore_eos=True))
    engine.iteration()
    engine.inject_fault("refuse")
    engine.iteration()
    assert rec.finished.reason == "error"
    assert engine.health().status == "ok"
    assert engine.metrics()["kv_blocks_reserved"] == 0
    after, _ = submit(engine, "two", greedy(5, ignore_eos=True))
    run_until_idle(engine)
    assert after.finished.reason == "length"


@pytest.mark.parametrize("kind, cause", [("fault", "fault"), ("panic", "panicked")])
def test_a_fault_or_a_panic_fails_everything_and_the_engine_is_dead(kind, cause):
    import threading

    engine = make_engine()
    done = threading.Event()
    recs = []
    for _ in range(3):
        rec, _ = submit(engine, "abc", greedy(200, ignore_eos=True))
        recs.append(rec)
    engine.inject_fault(kind)
    engine.start()
    for _ in range(200):
        if all(r.finished for r in recs):
            break
        done.wait(0.02)
    assert all(r.finished.reason == "error" for r in recs)
    health = engine.health()
    assert health.status == "dead" and health.cause == cause and health.reason
    from poot.engine import EngineDead

    with pytest.raises(EngineDead):
        engine.submit("more", greedy(2), lambda e: None)
    engine.stop()


def test_every_event_stream_is_accepted_tokens_then_one_finished():
    engine = make_engine()
    recs = [submit(engine, "q" * (i + 1), greedy(1 + i % 5))[0] for i in range(10)]
    run_until_idle(engine)
    for rec in recs:
        kinds = [type(e).__name__ for e in rec.events]
        assert kinds[0] == "Accepted" and kinds[-1] == "Finished"
        assert set(kinds[1:-1]) <= {"Tokens"}
        assert isinstance(rec.finished, Finished)


def test_a_prompt_the_tokenizer_chokes_on_is_rejected_and_the_loop_goes_on(monkeypatch):
    engine = make_engine()
    real = engine.model.tokenizer.encode

    def encode(text):
        if text == "poison":
            raise RuntimeError("tokenizer bug")
        return real(text)

    monkeypatch.setattr(engine.model.tokenizer, "encode", encode)
    bad, _ = submit(engine, "poison", greedy(4))
    good, _ = submit(engine, "fine", greedy(4, ignore_eos=True))
    run_until_idle(engine)
    assert isinstance(bad.finished, Rejected) and bad.finished.param == "prompt"
    assert good.finished.reason == "length"
    assert engine.health().status == "ok"


def run_into_a_fault(engine) -> tuple[int, int]:
    """Three requests decoding, then a step that faults; returns (free blocks, running) just
    before the fault. The loop runs on this thread until the fault kills the engine."""
    for i in range(3):
        submit(engine, "r" * (5 + i), greedy(40, ignore_eos=True))
    for _ in range(3):
        engine.iteration()
    before = engine.pool.num_free, len(engine.scheduler.running)
    engine.inject_fault("fault")
    engine._run()  # returns once the fault has killed the engine
    assert engine.health().status == "dead" and engine.health().cause == "fault"
    return before


def test_a_half_applied_step_releases_nothing():
    engine = make_engine()
    free, running = run_into_a_fault(engine)
    assert running == 3
    assert engine.pool.num_free == free and len(engine.scheduler.running) == running
    m = engine.metrics()
    assert m["engine_requests_running"] == 3 and m["kv_blocks_reserved"] > 0


def test_a_die_that_frees_every_block_is_caught():
    engine = make_engine(engine_class=DieFreesBlocks)
    free, running = run_into_a_fault(engine)
    assert engine.pool.num_free > free and not engine.scheduler.running
