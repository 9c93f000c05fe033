"""determinism/*: greedy output independent of load and of the prefix cache; seeds repeat."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from poot.conformance.client import Client
from poot.conformance.scenarios import Probes, unique_text

clause = pytest.mark.clause

PREFIX_PROMPTS = 4  # determinism/prefix/1: prompts, each sent cold then warm


@clause("determinism/batch/1")
def test_greedy_output_does_not_depend_on_load(client: Client, probes: Probes):
    """Long greedy outputs, alone and then among enough other requests to fill the plan's
    rows: kernels whose numerics change with the batch (another reduction order or precision
    per batch size) show up only over many tokens and large batches."""
    rows = (client.facts.get("rows") if client.facts is not None else None) or 16
    prompts = [unique_text(n) for n in (12, 30, 70, 110, 150, 20)]
    # The compared texts are the model's own (no logit bias to keep them going: ignore_eos
    # where the server takes it, else they may end by themselves, the same way alone and loud).
    compared = {"max_tokens": 96, "temperature": 0, **probes.ignore_eos()}
    alone = [client.complete(p, **compared)["choices"][0]["text"] for p in prompts]
    noise = [unique_text(5 + 37 * i % 200) for i in range(max(8, rows - len(prompts)))]
    with ThreadPoolExecutor(len(prompts) + len(noise)) as pool:
        for i, p in enumerate(noise):  # first, and longer, so they run through the whole batch
            pool.submit(client.complete, p, **probes.long_params(120 + i % 7))
        loud = [pool.submit(client.complete, p, **compared) for p in prompts]
        together = [f.result()["choices"][0]["text"] for f in loud]
    for p, a, b in zip(prompts, alone, together, strict=True):
        assert a == b, f"prompt {p[:20]!r}...: alone {a!r}, under load {b!r}"


@clause("determinism/prefix/1")
def test_prefix_hit_does_not_change_greedy_output(client: Client):
    # Several prompts: a hit that corrupts the context can still, by chance, leave one greedy
    # continuation as it was (a small model's next token often hangs on the last few alone).
    for _ in range(PREFIX_PROMPTS):
        prompt = unique_text(200)
        cold = client.complete(prompt, max_tokens=32, temperature=0)["choices"][0]["text"]
        warm = client.complete(prompt, max_tokens=32, temperature=0)["choices"][0]["text"]
        assert warm == cold, f"cold {cold!r} != warm {warm!r}"


@clause("determinism/seed/1")
def test_seed_makes_sampling_repeatable(client: Client):
    prompt = unique_text(20)
    a = client.complete(prompt, max_tokens=24, temperature=1.0, seed=1234)["choices"][0]["text"]
    b = client.complete(prompt, max_tokens=24, temperature=1.0, seed=1234)["choices"][0]["text"]
    assert a == b, f"same seed, different texts: {a!r} vs {b!r}"
