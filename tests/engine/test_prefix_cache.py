"""Prefix reuse: whole prompt blocks registered at release, mapped (shared, never copied) by
later requests with the same prefix, evicted least recently used first when room is needed,
and output identical with and without a hit."""

from __future__ import annotations

import pytest
from poot_mutants.engine_parts import LeakBlockOnCancel, NoCancelPrefix, NoPrefixRegistration, NoPrefixReuse

from poot.engine import Engine, SamplingParams
from poot.engine.drivers.cpu import CpuDriver
from poot.engine.models.synthetic import synthetic_llama
from poot.engine.plan import Plan
from poot.engine.prefix_cache import PrefixCache

from .harness import greedy, make_engine, run_until_idle, submit

BS = 16


def planned_engine(num_blocks: int = 8, rows: int = 4, token_budget: int = 64, block_size: int = BS,
                   positions: int = 128, seed: int = 0, engine_class: type[Engine] = Engine, **parts) -> Engine:
    """An engine on an explicit plan: a small pool and budget put eviction and chunked
    prefill within reach of short prompts."""
    model = synthetic_llama(seed)
    plan = Plan("numpy", rows, positions, block_size, num_blocks, token_budget, model.name)
    driver = CpuDriver()
    driver.prepare(plan, model)
    return engine_class(model, driver, plan, None, **parts)


def tokens(n: int, salt: int = 0) -> list[int]:
    return [(31 * i + 7 * salt + 3) % 256 for i in range(n)]


def run(engine, prompt, params=None):
    rec, _ = submit(engine, prompt, params or greedy(4, ignore_eos=True))
    run_until_idle(engine)
    return rec


def assert_pool_whole(engine):
    pool = engine.pool
    assert all(c == 0 for c in pool.ref_counts)
    assert len(pool.free_ids) + pool.num_cached == pool.num_blocks


# ---- registration ---------------------------------------------------------------------------


def test_a_finished_request_registers_its_prompts_whole_blocks_and_never_a_partial_one():
    engine = make_engine()
    run(engine, tokens(2 * BS + 5))
    m = engine.metrics()
    assert m["prefix_registered_tokens"] == 2 * BS
    assert m["kv_blocks_cached"] == 2
    assert m["prefix_skipped_releases"] == 0
    assert_pool_whole(engine)


def test_a_prefix_already_registered_is_not_counted_again():
    engine = make_engine()
    run(engine, tokens(3 * BS))
    run(engine, tokens(3 * BS))
    assert engine.metrics()["prefix_registered_tokens"] == 3 * BS


def test_a_request_cancelled_mid_prefill_registers_only_the_blocks_it_filled():
    engine = planned_engine(num_blocks=16, token_budget=40, positions=256)
    rec, handle = submit(engine, tokens(6 * BS), greedy(4))
    engine.iteration()  # one 40-token chunk: 2 whole blocks filled, the third half
    handle.cancel()
    run_until_idle(engine)
    assert rec.finished.reason == "cancelled"
    assert engine.metrics()["prefix_registered_tokens"] == 2 * BS
    assert engine.prefix_cache.match(tokens(6 * BS)) == engine.prefix_cache.match(tokens(2 * BS + 1))
    assert len(engine.prefix_cache.match(tokens(6 * BS))) == 2
    assert_pool_whole(engine)


def test_a_request_cancelled_before_it_opened_registers_nothing():
    engine = planned_engine(rows=1)
    submit(engine, tokens(10, 1), greedy(8, ignore_eos=True))
    engine.iteration()
    rec, handle = submit(engine, tokens(3 * BS), greedy(4))
    engine.iteration()
    handle.cancel()
    run_until_idle(engine)
    assert rec.finished.reason == "cancelled" and not rec.token_ids
    assert engine.metrics()["prefix_registered_tokens"] == 0


# ---- reuse ----------------------------------------------------------------------------------


def test_a_later_request_maps_the_cached_blocks_of_its_prefix_and_skips_their_prefill():
    engine = make_engine()
    system = tokens(4 * BS)
    run(engine, system + tokens(9, 1))
    rec, _ = submit(engine, system + tokens(20, 2), greedy(4, ignore_eos=True))
    engine.iteration()
    (seq,) = engine.scheduler.running
    assert seq.num_cached == 4 * BS
    assert seq.block_table[:4] == engine.prefix_cache.match(system + [0])
    run_until_idle(engine)
    assert rec.finished.cached_tokens == 4 * BS
    m = engine.metrics()
    assert m["prefix_cache_hit_tokens"] == 4 * BS
    assert m["prefix_cache_hit_rate"] == pytest.approx(4 * BS / (4 * BS + 9 + 4 * BS + 20))


def test_hits_stop_before_the_last_prompt_token():
    engine = make_engine()
    prompt = tokens(3 * BS)  # whole blocks only: all three are registered
    run(engine, prompt)
    assert engine.metrics()["prefix_registered_tokens"] == 3 * BS
    rec = run(engine, prompt)
    assert rec.finished.cached_tokens == 2 * BS  # the last token's block is computed again
    rec = run(engine, prompt + [1])
    assert rec.finished.cached_tokens == 3 * BS


def test_shared_blocks_are_reference_counted_not_copied():
    engine = make_engine()
    system = tokens(2 * BS)
    run(engine, system + [9])
    a, _ = submit(engine, system + [1, 2, 3], greedy(6, ignore_eos=True))
    b, _ = submit(engine, system + [4, 5], greedy(6, ignore_eos=True))
    engine.iteration()
    qa, qb = engine.scheduler.running
    assert qa.block_table[:2] == qb.block_table[:2]
    assert all(engine.pool.ref_counts[i] == 2 for i in qa.block_table[:2])
    assert not set(qa.block_table[2:]) & set(qb.block_table[2:])
    assert engine.metrics()["kv_blocks_reserved"] == len(set(qa.block_table) | set(qb.block_table))
    run_until_idle(engine)
    assert a.finished.cached_tokens == b.finished.cached_tokens == 2 * BS
    assert_pool_whole(engine)


def test_a_different_model_name_shares_nothing():
    engine = make_engine()
    run(engine, tokens(3 * BS))
    other = PrefixCache(engine.pool, engine.plan, "another-model")
    assert other.match(tokens(3 * BS)) == []
    assert engine.prefix_cache.match(tokens(3 * BS)) != []


def test_a_colliding_digest_is_caught_by_the_stored_tokens(monkeypatch):
    import poot.engine.prefix_cache as pc

    monkeypatch.setattr(pc, "block_key", lambda parent, toks: b"same")  # every block collides
    engine = make_engine()
    run(engine, tokens(2 * BS, 1) + [0])
    rec = run(engine, tokens(2 * BS, 2) + [0])
    assert rec.finished.cached_tokens == 0


@pytest.mark.parametrize("params", [greedy(24, ignore_eos=True),
                                    SamplingParams(max_tokens=24, temperature=0.9, seed=11, ignore_eos=True)],
                         ids=["greedy", "sampled"])
def test_output_is_identical_with_and_without_a_cache_hit(params):
    system, question = tokens(5 * BS + 3, 4), tokens(11, 5)
    cold = run(make_engine(), system + question, params)
    engine = make_engine()
    run(engine, system + tokens(7, 6), params)  # registers the system prompt's blocks
    warm = run(engine, system + question, params)
    assert cold.finished.cached_tokens == 0 and warm.finished.cached_tokens == 5 * BS
    assert warm.token_ids == cold.token_ids
    assert warm.text == cold.text


# ---- room and eviction ----------------------------------------------------------------------


def test_cached_blocks_count_as_room_and_are_evicted_least_recently_used_first():
    engine = planned_engine(num_blocks=8)
    a, b = tokens(2 * BS + 1, 1), tokens(2 * BS + 1, 2)
    run(engine, a, greedy(1))  # 3 blocks each while running; 2 stay cached
    run(engine, b, greedy(1))
    assert engine.metrics()["kv_blocks_cached"] == 4
    rec = run(engine, tokens(4 * BS + 6, 3), greedy(1))  # 5 blocks: 4 free + 1 evicted
    assert rec.finished.reason == "length"
    cache = engine.prefix_cache
    assert len(cache.match(a)) == 1  # a's tail went first: a is older, and tails go before heads
    assert len(cache.match(b)) == 2
    assert_pool_whole(engine)


def test_reservation_counts_only_the_blocks_needed_after_reuse():
    engine = planned_engine(num_blocks=8)
    prompt = tokens(5 * BS + 1, 1)
    run(engine, prompt, greedy(1))  # 5 cached, 3 free
    holder, _ = submit(engine, tokens(5, 2), greedy(20, ignore_eos=True))  # holds 2 blocks
    engine.iteration()
    rec, _ = submit(engine, prompt, greedy(1))  # needs 6 blocks: 5 hits + 1 of the 1 left
    engine.iteration()
    assert rec.finished is not None or len(engine.scheduler.running) == 2
    assert holder.finished is None
    run_until_idle(engine)
    assert rec.finished.cached_tokens == 5 * BS
    assert_pool_whole(engine)


def test_a_hit_on_a_cached_block_is_not_counted_as_room_twice():
    engine = planned_engine(num_blocks=8)
    prompt = tokens(5 * BS + 1, 1)
    run(engine, prompt, greedy(1))  # 5 cached, 3 free
    holder, _ = submit(engine, tokens(5, 2), greedy(40, ignore_eos=True))  # holds 3: none free
    engine.iteration()
    rec, _ = submit(engine, prompt, greedy(1))  # 5 hits, but the 6th block has no room
    engine.iteration()
    assert not rec.token_ids and len(engine.scheduler.running) == 1
    run_until_idle(engine)
    assert rec.finished.reason == "length" and rec.finished.cached_tokens == 5 * BS
    assert_pool_whole(engine)


# ---- deliberate defects: the checks above can fail ---------------------------------------------------


def test_leak_block_on_cancel_breaks_the_whole_pool_when_idle():
    engine = planned_engine(prefix_cache=LeakBlockOnCancel)
    _, handle = submit(engine, tokens(40), greedy(8))
    engine.iteration()
    handle.cancel()
    run_until_idle(engine)
    pool = engine.pool
    assert len(pool.free_ids) + pool.num_cached == pool.num_blocks - 1


def test_no_prefix_reuse_never_hits():
    engine = make_engine(prefix_cache=NoPrefixReuse)
    run(engine, tokens(3 * BS + 1))
    rec = run(engine, tokens(3 * BS + 1))
    assert rec.finished.cached_tokens == 0
    assert engine.metrics()["prefix_cache_hit_rate"] == 0.0


def test_no_prefix_registration_registers_nothing():
    engine = make_engine(prefix_cache=NoPrefixRegistration)
    run(engine, tokens(3 * BS + 1))
    assert engine.metrics()["prefix_registered_tokens"] == 0
    assert run(engine, tokens(3 * BS + 1)).finished.cached_tokens == 0


def test_no_cancel_prefix_registers_nothing_for_a_cancelled_request_only():
    engine = planned_engine(num_blocks=16, token_budget=40, positions=256,
                            prefix_cache=NoCancelPrefix)
    _, handle = submit(engine, tokens(6 * BS), greedy(4))
    engine.iteration()
    handle.cancel()
    run_until_idle(engine)
    assert engine.metrics()["prefix_registered_tokens"] == 0
    run(engine, tokens(3 * BS, 1))
    assert engine.metrics()["prefix_registered_tokens"] == 3 * BS
