"""Penalties, logit bias, min_tokens, stop_token_ids, logprobs, prompt scoring (echo) and a
request's n choices, on the synthetic model through the real loop."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from poot.engine import InvalidRequest, SamplingParams
from poot.engine import logits_processors as lp
from poot.engine.events import Finished, PromptLogprobs, Tokens
from poot.engine.logprobs import log_softmax, token_logprob
from poot.engine.models.byte_tokenizer import EOS_ID

from .harness import Record, greedy, make_engine, run_until_idle, submit
from .test_prefix_cache import planned_engine

PROMPT = [(13 * i + 5) % 256 for i in range(40)]


def logprob_pairs(rec: Record) -> list[tuple[int, float, tuple]]:
    return [(t, p, top) for e in rec.events if isinstance(e, Tokens)
            for t, p, top in zip(e.token_ids, e.logprobs, e.top_logprobs, strict=True)]


# ---- the processors, alone ------------------------------------------------------------------

def test_no_rule_returns_the_logits_untouched():
    z = np.arange(10, dtype=np.float32)
    assert lp.apply(z, SamplingParams(), [1], [2, 3], {9}) is z


def test_frequency_and_presence_penalties_follow_the_openai_rule():
    z = np.zeros(6, np.float32)
    out = lp.apply(z, SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), [4], [1, 1, 2], set())
    assert out.tolist() == [0, -1.25, -0.75, 0, 0, 0]  # the prompt's token 4 does not count


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    z = np.array([2.0, -2.0, 2.0, 1.0], np.float32)
    out = lp.apply(z, SamplingParams(repetition_penalty=2.0), [0], [1], set())
    assert out.tolist() == [1.0, -4.0, 2.0, 1.0]


def test_logit_bias_and_min_tokens():
    z = np.zeros(5, np.float32)
    params = SamplingParams(logit_bias=((1, 3.0), (2, -100.0)), min_tokens=2, stop_token_ids=(3,))
    out = lp.apply(z, params, [], [0], {4})
    assert out[1] == 3.0 and out[2] == -100.0 and out[3] == -np.inf and out[4] == -np.inf
    later = lp.apply(z, params, [], [0, 0], {4})
    assert later[3] == 0 and later[4] == 0


@pytest.mark.parametrize("params, param", [
    (SamplingParams(presence_penalty=2.5), "presence_penalty"),
    (SamplingParams(frequency_penalty="x"), "frequency_penalty"),
    (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
    (SamplingParams(logit_bias=((1, 101.0),)), "logit_bias"),
    (SamplingParams(min_tokens=20, max_tokens=4), "min_tokens"),
    (SamplingParams(stop_token_ids=(-1,)), "stop_token_ids"),
    (SamplingParams(logprobs=21), "logprobs"),
    (SamplingParams(max_tokens=0), "max_tokens"),
])
def test_bad_values_name_their_parameter(params, param):
    with pytest.raises(InvalidRequest) as e:
        params.validate()
    assert e.value.param == param


# ---- logprobs ---------------------------------------------------------------------------------

def test_log_softmax_cannot_overflow_and_matches_float64():
    z = np.array([1e30, 1e30 - 1e24, -np.inf, 0.0], np.float32)
    out = log_softmax(z)
    assert np.isfinite(out[[0, 1, 3]]).all() and out[2] == -np.inf
    rng = np.random.default_rng(0)
    z = (rng.standard_normal(49152) * 8).astype(np.float32)
    ref = z.astype(np.float64) - z.max() - np.log(np.exp(z.astype(np.float64) - z.max()).sum())
    assert np.abs(log_softmax(z) - ref).max() < 1e-4


def test_top_alternatives_are_most_likely_first_ties_by_id():
    z = np.array([1.0, 3.0, 3.0, 2.0], np.float32)
    t = token_logprob(z, 1, 3)
    assert [i for i, _ in t.top] == [1, 2, 3] and t.logprob == t.top[0][1]


@pytest.mark.parametrize("draft", [None, "ngram"])
def test_greedy_logprob_is_the_largest_alternative_and_tokens_do_not_change(draft):
    engine = make_engine(draft=draft)
    plain, _ = submit(engine, PROMPT, greedy(24))
    scored, _ = submit(engine, PROMPT, greedy(24, logprobs=5))
    run_until_idle(engine)
    assert plain.token_ids == scored.token_ids
    pairs = logprob_pairs(scored)
    assert len(pairs) == len(scored.token_ids) and not any(e.logprobs for e in plain.events if isinstance(e, Tokens))
    for token, logprob, top in pairs:
        assert len(top) == 5 and top[0] == (token, logprob) and logprob <= 0


def test_sampled_logprobs_do_not_depend_on_temperature():
    engine = make_engine()
    recs = [submit(engine, PROMPT, SamplingParams(max_tokens=1, temperature=t, seed=3, logprobs=2))[0]
            for t in (0.5, 1.5)]
    run_until_idle(engine)
    tops = [logprob_pairs(r)[0][2] for r in recs]
    # The same tokens and logprobs; two rows of one step may differ in the last float bits,
    # as a BLAS library's kernels for a row can depend on its place in the batch.
    assert [t for t, _ in tops[0]] == [t for t, _ in tops[1]]
    assert [p for _, p in tops[0]] == pytest.approx([p for _, p in tops[1]], rel=1e-5)


# ---- stop_token_ids, min_tokens, penalties in the loop ---------------------------------------

def test_stop_token_ids_end_the_request_with_stop():
    engine = make_engine()
    rec, _ = submit(engine, PROMPT, greedy(10, logit_bias=((65, 100.0),), stop_token_ids=(65,)))
    run_until_idle(engine)
    assert rec.token_ids == [65] and rec.finished.reason == "stop"


def test_min_tokens_holds_off_end_of_sequence():
    engine = make_engine()
    rec, _ = submit(engine, PROMPT, greedy(10, logit_bias=((EOS_ID, 100.0),), min_tokens=3))
    run_until_idle(engine)
    assert len(rec.token_ids) == 4 and rec.token_ids[-1] == EOS_ID and rec.finished.reason == "stop"


def test_frequency_penalty_breaks_a_forced_repetition():
    engine = make_engine()
    bias = ((65, 100.0), (66, 100.0))
    plain, _ = submit(engine, PROMPT, greedy(16, logit_bias=bias))
    penalized, _ = submit(engine, PROMPT, greedy(16, logit_bias=bias, frequency_penalty=2.0))
    run_until_idle(engine)
    assert len(set(plain.token_ids)) == 1
    assert set(penalized.token_ids) == {65, 66}


def test_token_ids_outside_the_vocabulary_are_rejected():
    engine = make_engine()
    rec, _ = submit(engine, PROMPT, greedy(4, logit_bias=((10**6, 1.0),)))
    run_until_idle(engine)
    assert rec.finished.param == "logit_bias"


# ---- echo: scoring the prompt ----------------------------------------------------------------

def test_prompt_scores_agree_with_the_logprobs_of_generated_tokens():
    engine = make_engine()
    gen, _ = submit(engine, PROMPT, greedy(12, logprobs=0))
    run_until_idle(engine)
    full = PROMPT + gen.token_ids
    echo, _ = submit(engine, full, greedy(0, prompt_logprobs=2))
    run_until_idle(engine)
    scores = [e for e in echo.events if isinstance(e, PromptLogprobs)]
    assert len(scores) == 1 and scores[0].token_ids == tuple(full)
    assert scores[0].logprobs[0] is None and len(scores[0].logprobs) == len(full)
    tail = scores[0].logprobs[len(PROMPT):]
    assert np.allclose(tail, [p for _, p, _ in logprob_pairs(gen)], atol=1e-4)
    assert echo.finished.reason == "length" and echo.finished.completion_tokens == 0


def test_prompt_scoring_survives_chunked_prefill_and_skips_the_prefix_cache():
    engine = planned_engine(num_blocks=40, rows=4, token_budget=16, block_size=4, positions=128)
    warm, _ = submit(engine, PROMPT, greedy(1))
    run_until_idle(engine)
    a, _ = submit(engine, PROMPT, greedy(2, prompt_logprobs=0))
    run_until_idle(engine)
    ev = next(e for e in a.events if isinstance(e, PromptLogprobs))
    assert len(ev.logprobs) == len(PROMPT) and all(p <= 0 for p in ev.logprobs[1:])
    assert a.finished.cached_tokens == 0 and len(a.token_ids) == 2


# ---- n choices ---------------------------------------------------------------------------------

def choices(engine, prompt, params, n):
    recs = [Record() for _ in range(n)]
    handles = engine.submit_choices(prompt, params, recs)
    return recs, handles


def test_choices_share_the_prompt_and_prefill_it_once():
    engine = planned_engine(num_blocks=64, rows=4, token_budget=64, block_size=4, positions=128)
    prompt = PROMPT + PROMPT[:21]  # 61 tokens: 15 whole blocks shared, the last block each
    one, _ = submit(engine, prompt, greedy(6))
    run_until_idle(engine)
    engine.prefix_cache.by_key.clear()  # start cold: nothing from the first run is reusable
    engine.prefix_cache.entries.clear()
    fed_before = engine.step_tokens.snapshot()
    recs, _ = choices(engine, prompt, greedy(6), 4)
    run_until_idle(engine)
    assert all(r.token_ids == one.token_ids for r in recs)
    assert [r.finished.cached_tokens for r in recs] == [0, 60, 60, 60]
    fed = sum_fed(engine.step_tokens.snapshot()) - sum_fed(fed_before)
    assert fed == len(prompt) + 3 * 1 + 4 * 5  # the prompt once, each choice's last token, the decodes


def sum_fed(snapshot) -> int:
    return int(snapshot["decoding"]["sum"] + snapshot["idle"]["sum"])


def test_seeded_choice_zero_samples_as_a_single_request():
    engine = make_engine()
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=11)
    alone, _ = submit(engine, PROMPT, params)
    recs, _ = choices(engine, PROMPT, params, 3)
    run_until_idle(engine)
    assert recs[0].token_ids == alone.token_ids
    assert len({tuple(r.token_ids) for r in recs}) > 1


def test_cancelling_every_choice_releases_every_block():
    engine = planned_engine(num_blocks=64, rows=4, token_budget=8, block_size=4, positions=128)
    recs, handles = choices(engine, PROMPT, greedy(20), 3)
    engine.iteration()
    engine.iteration()
    for h in handles:
        h.cancel()
    run_until_idle(engine)
    assert all(r.finished.reason == "cancelled" for r in recs)
    assert engine.metrics()["kv_blocks_reserved"] == 0 and all(c == 0 for c in engine.pool.ref_counts)


def test_a_cancelled_writer_hands_the_prompt_to_the_next_choice():
    engine = planned_engine(num_blocks=64, rows=4, token_budget=8, block_size=4, positions=128)
    recs, handles = choices(engine, PROMPT, greedy(5), 3)
    engine.iteration()  # opened; the writer has prefilled 8 of 40 tokens
    handles[0].cancel()
    run_until_idle(engine)
    ref, _ = submit(engine, PROMPT, greedy(5))
    run_until_idle(engine)
    assert recs[0].finished.reason == "cancelled"
    assert recs[1].token_ids == recs[2].token_ids == ref.token_ids


def test_choices_that_can_never_fit_are_rejected_naming_n():
    engine = planned_engine(num_blocks=64, rows=4, token_budget=64, block_size=4, positions=128)
    recs, _ = choices(engine, PROMPT, greedy(4), 5)
    run_until_idle(engine)
    assert all(r.finished.param == "n" for r in recs)


def test_admission_reserves_every_choice_at_open():
    engine = planned_engine(num_blocks=30, rows=4, token_budget=64, block_size=4, positions=128)
    recs, _ = choices(engine, PROMPT, greedy(40), 2)  # 20 blocks each, 9 shared: 31 > 30
    run_until_idle(engine)
    assert all(r.finished.param == "n" for r in recs)
    recs, _ = choices(engine, PROMPT[:20], greedy(20), 3)  # 10 blocks each, 4 shared: 22
    engine.iteration()
    assert engine.metrics()["kv_blocks_reserved"] == 22 and engine.metrics()["engine_requests_running"] == 3
    run_until_idle(engine)


def test_echo_with_choices_scores_each_prompt():
    engine = make_engine()
    recs, _ = choices(engine, PROMPT, dataclasses.replace(greedy(2), prompt_logprobs=1), 2)
    run_until_idle(engine)
    scored = [next(e for e in r.events if isinstance(e, PromptLogprobs)) for r in recs]
    assert isinstance(recs[0].finished, Finished)
    assert scored[0].token_ids == scored[1].token_ids
    # Each choice's row is scored on its own; rows of one step may differ in the last float bits.
    assert scored[0].logprobs[0] is None and scored[1].logprobs[0] is None
    assert scored[0].logprobs[1:] == pytest.approx(scored[1].logprobs[1:], rel=1e-5)
    for a, b in zip(scored[0].top_logprobs, scored[1].top_logprobs, strict=True):
        assert [t for t, _ in a] == [t for t, _ in b]
        assert [p for _, p in a] == pytest.approx([p for _, p in b], rel=1e-5)
