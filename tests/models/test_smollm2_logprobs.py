"""SmolLM2 through the whole engine: greedy tokens' logprobs are the largest of their
alternatives, echo's prompt logprobs match a float64 reference forward within 1e-4, and a
500-token prompt asked for 4 choices is prefilled once."""

from __future__ import annotations

import numpy as np
import pytest

from poot.engine import Engine, SamplingParams
from poot.engine.events import Finished, PromptLogprobs, Tokens

from .reference_llama import ReferenceLlama

pytestmark = [pytest.mark.realmodel, pytest.mark.slow]


@pytest.fixture(scope="module")
def engine(smollm2):
    # The float32 path, which the float64 reference is held to within 1e-4 (the block codes'
    # 16-bit activations move logits by up to 6e-4 of the largest: tests/models/test_block_codes.py).
    from poot.engine.drivers.cpu import CpuDriver

    return Engine.create(smollm2, driver=CpuDriver(compact=False))


def run(engine, prompt, params, n=1):
    records = [[] for _ in range(n)]
    if n == 1:
        engine.submit(prompt, params, records[0].append)
    else:
        engine.submit_choices(prompt, params, [r.append for r in records])
    while engine.in_flight():
        engine.iteration()
    return records


def test_each_greedy_logprob_is_the_largest_of_its_top_logprobs(engine):
    (events,) = run(engine, "The capital of France is", SamplingParams(max_tokens=16, temperature=0, logprobs=5))
    tokens = [e for e in events if isinstance(e, Tokens)]
    pairs = [(t, p, top) for e in tokens for t, p, top in zip(e.token_ids, e.logprobs, e.top_logprobs, strict=True)]
    assert len(pairs) == 16 or isinstance(events[-1], Finished) and events[-1].reason == "stop"
    for token, logprob, top in pairs:
        assert top[0][0] == token and top[0][1] == logprob == max(p for _, p in top)


def test_echo_prompt_logprobs_match_the_float64_reference(engine, smollm2):
    text = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
    (events,) = run(engine, text, SamplingParams(max_tokens=0, temperature=0, prompt_logprobs=0))
    scored = next(e for e in events if isinstance(e, PromptLogprobs))
    tokens = list(scored.token_ids)
    assert tokens == smollm2.encode_prompt(text) and scored.logprobs[0] is None
    z = ReferenceLlama(smollm2.config, smollm2.weights).logits(tokens)[:-1]  # row i scores token i + 1
    ref = z - z.max(axis=-1, keepdims=True)
    ref -= np.log(np.exp(ref).sum(axis=-1, keepdims=True))
    expected = ref[np.arange(len(tokens) - 1), tokens[1:]]
    worst = np.abs(np.array(scored.logprobs[1:]) - expected).max()
    print(f"\necho of {len(tokens)} prompt tokens: largest difference from the float64 reference {worst:.2e}")
    assert worst < 1e-4


def test_four_choices_of_a_500_token_prompt_prefill_it_once(engine, smollm2):
    prompt = smollm2.encode_prompt(" ".join(f"item {i}," for i in range(200)))[:500]
    assert len(prompt) == 500
    bs = engine.plan.block_size
    before = engine.metrics()
    records = run(engine, prompt, SamplingParams(max_tokens=4, temperature=0), n=4)
    after = engine.metrics()
    shared = (len(prompt) - 1) // bs * bs
    hits = after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
    fed = sum(after["engine_step_tokens"][k]["sum"] - before["engine_step_tokens"][k]["sum"] for k in ("decoding", "idle"))
    print(f"\n4 choices of a 500-token prompt: {hits} prompt tokens shared, {fed} tokens fed in all "
          f"(the prompt once, {len(prompt) - shared} more per other choice, 3 decode steps of 4 rows)")
    assert hits == 3 * shared
    assert fed == len(prompt) + 3 * (len(prompt) - shared) + 4 * 3
    texts = {tuple(t for e in r if isinstance(e, Tokens) for t in e.token_ids) for r in records}
    assert len(texts) == 1
