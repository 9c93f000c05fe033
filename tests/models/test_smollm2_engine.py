"""SmolLM2 through the whole engine against the independent float64 reference: last-position
logits on several prompts, and 32-token greedy continuations, with other requests sharing
every batch (different lengths, chunked prefill, rows joining and leaving)."""

from __future__ import annotations

import numpy as np
import pytest

from poot.engine import Engine, SamplingParams
from poot.engine.events import Finished, Tokens

from .reference_llama import ReferenceLlama

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived",
]
STEPS = 32

pytestmark = [pytest.mark.realmodel, pytest.mark.slow]


@pytest.fixture(scope="module")
def engine(smollm2):
    # The float32 path: what the reference's logits are compared with to 1e-3. The block
    # codes' path (16-bit activations) is compared with this one in tests/models/test_block_codes.py.
    from poot.engine.drivers.cpu import CpuDriver

    return Engine.create(smollm2, driver=CpuDriver(compact=False))


@pytest.fixture(scope="module")
def reference(smollm2):
    return ReferenceLlama(smollm2.config, smollm2.weights)


def run_together(engine, jobs):
    """Submits every job at once, plus fillers that join and leave, and runs to idle."""
    outs = {}

    def sink_for(key):
        def sink(event):
            if isinstance(event, Tokens):
                outs.setdefault(key, []).extend(event.token_ids)
            elif isinstance(event, Finished):
                assert event.reason in ("stop", "length"), event
        return sink

    for i, (prompt, params) in enumerate(jobs):
        engine.submit(prompt, params, sink_for(i))
    # Fillers of other lengths, some long enough to be chunked, some short-lived.
    for j, n in enumerate((3, 90, 150, 7)):
        engine.submit("filler " * n, SamplingParams(max_tokens=2 + 5 * j, temperature=0), lambda e: None)
    steps = 0
    while engine.in_flight():
        engine.iteration()
        steps += 1
        assert steps < 10_000
    return [outs.get(i, []) for i in range(len(jobs))]


def test_last_position_logits_match_the_reference_in_a_shared_batch(smollm2, engine, reference):
    prompts = [smollm2.encode_prompt(p) for p in PROMPTS]
    captured = []
    inner = engine.driver.step

    def capture(plan):
        out = inner(plan)
        offset = 0
        for work in plan.rows:
            if work.num_logits and work.start + len(work.tokens) in {len(p) for p in prompts}:
                captured.append((tuple(work.tokens[-1:]), work.start + len(work.tokens),
                                 out.logits[offset + work.num_logits - 1].copy()))
            offset += work.num_logits
        return out

    engine.driver.step = capture
    engine.driver.device_picks = False  # every row's logits come back, greedy rows' too
    try:
        run_together(engine, [(p, SamplingParams(max_tokens=1, temperature=0)) for p in prompts])
    finally:
        engine.driver.step = inner
        engine.driver.device_picks = True
    for p in prompts:
        ref = reference.logits(p, last_only=True)
        got = [lg for last, n, lg in captured if n == len(p) and last == (p[-1],)]
        assert got, "the prompt's last position was never computed"
        assert np.abs(got[0] - ref).max() <= 1e-3


def test_greedy_continuations_match_the_reference_with_other_requests_in_the_batch(smollm2, engine, reference):
    prompts = [smollm2.encode_prompt(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True)
    got = run_together(engine, [(p, params) for p in prompts])
    for p, tokens in zip(prompts, got, strict=True):
        want = reference.greedy(p, STEPS)
        assert tokens == want, (smollm2.tokenizer.decode(tokens), smollm2.tokenizer.decode(want))


def test_speculative_greedy_on_smollm2_equals_plain_greedy(smollm2, engine):
    """The n-gram policy on a prompt the answer quotes: verification rows go through the
    few-token products and per-query paged attention, plain decoding through one-token
    steps; the committed tokens must be the same, and drafts must actually be accepted."""
    text = ("Repeat this sentence exactly: the little red house stood at the end of the long road, "
            "and every morning the old man opened the red door.")
    prompt = smollm2.encode_prompt(text)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain = run_together(engine, [(prompt, params)])[0]
    speculative = Engine.create(smollm2, draft="ngram")
    got = run_together(speculative, [(prompt, params)])[0]
    assert got == plain, (smollm2.tokenizer.decode(got), smollm2.tokenizer.decode(plain))
    assert speculative.metrics()["spec_accepted_tokens"] > 0
