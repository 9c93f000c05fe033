"""Which rows the engine lets the driver pick, and what the driver returns for them: token ids
for the rows that need nothing but the sampler, the host's logits for the others."""

from __future__ import annotations

import numpy as np

from poot.engine import SamplingParams
from poot.engine.drivers.base import Pick, RowWork, StepPlan
from poot.engine.drivers.cpu import CpuDriver
from poot.engine.models.byte_tokenizer import EOS_ID
from poot.engine.random_stream import random_stream
from poot.engine.sampler import sample
from poot.engine.speculative import make_draft_policy

from .harness import greedy, make_engine, run_until_idle, submit


def marks(engine, requests):
    """Per request, each step's (outputs before the step, num_logits, its Pick) for its row."""
    inner, seen = engine.driver.step, {}

    def step(plan):
        by_row = {q.row: q for q in engine.scheduler.running}
        for w in plan.rows:
            if w.num_logits:
                seq = by_row[w.row]
                seen.setdefault(seq.request_id, []).append((len(seq.output), w.num_logits, w.pick))
        return inner(plan)

    engine.driver.step = step
    handles = [submit(engine, prompt, params)[1] for prompt, params in requests]
    run_until_idle(engine)
    return [seen[h.request_id] for h in handles]


def test_only_rows_that_need_nothing_but_the_sampler_are_marked():
    engine = make_engine()
    plain, sampled, logprobs, penalty, bias, min_tokens, echo = marks(engine, [
        ("plain", greedy(5, ignore_eos=True)),
        ("sampled", SamplingParams(max_tokens=5, temperature=0.9, top_k=5, top_p=0.5, seed=3, ignore_eos=True)),
        ("logprobs", greedy(5, ignore_eos=True, logprobs=0)),
        ("penalty", greedy(5, ignore_eos=True, presence_penalty=0.1)),
        ("bias", greedy(5, ignore_eos=True, logit_bias=((7, 1.0),))),
        ("min tokens", greedy(5, min_tokens=3)),
        ("echo " * 3, greedy(5, ignore_eos=True, prompt_logprobs=0)),
    ])
    assert [(k, p.first, p.params.top_p) for k, _, p in sampled] == [(k, k, 0.5) for k in range(5)]
    assert all(p is not None and p.stream == random_stream(3) for *_, p in sampled)
    assert all(p is not None and p.params.greedy for *_, p in plain)
    for rows in (logprobs, penalty, bias):
        assert all(p is None for *_, p in rows)
    # min_tokens masks end-of-sequence for the first 3 outputs only; echo scores its prompt
    # in its prefill steps only.
    assert [p is None for *_, p in min_tokens] == [True, True, True, False, False]
    assert [p is None for _, n, p in echo] == [True] + [False] * 4 and echo[0][1] == len(engine.model.encode_prompt("echo " * 3))


def test_a_verifying_row_is_marked_with_its_first_positions_counter():
    engine = make_engine(draft=None)
    engine.scheduler.draft_policy = make_draft_policy("ngram", min_ngram=1, full_rows=64)
    params = SamplingParams(max_tokens=20, temperature=0.7, seed=5, ignore_eos=True)
    (rows,) = marks(engine, [("ab ab ab ab ab ab", params)])
    assert any(n > 1 for _, n, _ in rows)
    assert all(p is not None and p.first == before for before, _, p in rows)


def test_the_numpy_driver_returns_ids_for_marked_rows_and_logits_for_the_rest():
    engine = make_engine()
    driver, plan = engine.driver, engine.plan
    tables = [list(range(4 * r, 4 * r + 4)) for r in range(4)]
    prompts = [np.arange(5 + r, dtype=np.int32) * (r + 3) % 256 for r in range(4)]
    greedy_pick = Pick(greedy(), random_stream(1), 0)
    sampled = Pick(SamplingParams(temperature=1.3, top_k=50), random_stream(2, 1), 9)
    batch = [RowWork(r, p, 0, tables[r], n, pick)
             for r, (p, n, pick) in enumerate(zip(prompts, (1, 3, 1, 2), (greedy_pick, None, sampled, None),
                                                  strict=True))]
    for r, t in enumerate(tables):
        driver.step(StepPlan.opening({r: t}))
    driver.device_picks = False
    full = driver.step(StepPlan(batch))
    assert full.token_ids is None and len(full.logits) == 7
    driver.device_picks = True
    out = driver.step(StepPlan(batch))
    want = [int(np.argmax(full.logits[0])), -1, -1, -1, sample(full.logits[4], sampled.params, sampled.uniform(0)), -1, -1]
    assert out.token_ids.tolist() == want
    np.testing.assert_array_equal(out.logits, full.logits[[1, 2, 3, 5, 6]])
    assert out.picked == [True, False, True, False] and full.picked == [False] * 4
    assert isinstance(driver, CpuDriver) and plan.rows >= 4


def test_a_steps_picked_field_names_the_rows_that_got_token_ids():
    """`StepOutput.picked`, one flag per batch row, says whose tokens the driver picked: those
    rows' logit indices hold token ids, the others' logits are the host rows, in batch order.
    A mid-prefill row (no logits) is never picked, whatever its mark."""
    engine = make_engine(draft=None)
    engine.scheduler.draft_policy = make_draft_policy("ngram", min_ngram=1, full_rows=64)
    inner, seen = engine.driver.step, []

    def step(plan):
        out = inner(plan)
        if plan.rows:
            seen.append((list(plan.rows), out))
        return out

    engine.driver.step = step
    for prompt, params in [("plain " * 30, greedy(6, ignore_eos=True)),
                           ("ab ab ab ab ab ab", SamplingParams(max_tokens=12, temperature=0.7, seed=5, ignore_eos=True)),
                           ("logprobs", greedy(4, ignore_eos=True, logprobs=1)),
                           ("echo " * 3, greedy(3, ignore_eos=True, prompt_logprobs=0))]:
        submit(engine, prompt, params)
    run_until_idle(engine)
    kinds = set()
    for batch, out in seen:
        assert out.picked == [w.pick is not None and w.num_logits > 0 for w in batch]
        i = 0
        for w, picked in zip(batch, out.picked, strict=True):
            if picked:
                assert (out.token_ids[i : i + w.num_logits] >= 0).all()
            elif out.token_ids is not None:
                assert (out.token_ids[i : i + w.num_logits] == -1).all()
            i += w.num_logits
            kinds.add((picked, w.num_logits > 0))
        assert len(out.logits) == sum(w.num_logits for w, p in zip(batch, out.picked, strict=True) if not p)
    assert kinds == {(True, True), (False, True), (False, False)}  # picked, host, mid-prefill rows


def test_a_request_picked_on_the_device_ends_as_on_the_host():
    """Stop rules still apply to device-picked tokens: EOS, stop_token_ids, max_tokens."""
    outs = []
    for device_picks in (True, False):
        engine = make_engine()
        engine.driver.device_picks = device_picks
        recs = [submit(engine, "stop " * i, SamplingParams(max_tokens=30, temperature=1.0, seed=i,
                                                           stop_token_ids=(101, 32)))[0] for i in range(1, 9)]
        run_until_idle(engine)
        outs.append([(r.token_ids, r.finished.reason) for r in recs])
    assert outs[0] == outs[1]
    stopped = [ids for ids, reason in outs[0] if reason == "stop"]
    assert stopped and all(ids[-1] in (101, 32, EOS_ID) for ids in stopped)
    assert all(len(ids) == 30 for ids, reason in outs[0] if reason == "length")
