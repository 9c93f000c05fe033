"""speculative/*: drafting never changes greedy output; its counters add up."""

from __future__ import annotations

import pytest

from poot.conformance.client import Client

clause = pytest.mark.clause

PROMPTS = ["abc abc abc abc abc abc", "one two one two one two one two", "The cat sat. The cat sat. The cat"]


@clause("speculative/greedy/1")
def test_drafting_does_not_change_greedy_output(target, client: Client):
    spec = target.variant("speculative")
    for prompt in PROMPTS:
        want = client.complete(prompt, max_tokens=48, temperature=0)["choices"][0]["text"]
        got = spec.complete(prompt, max_tokens=48, temperature=0)["choices"][0]["text"]
        assert got == want, f"prompt {prompt!r}: with drafting {got!r}, without {want!r}"


@clause("speculative/metrics/1")
def test_draft_counters_add_up(target):
    spec = target.variant("speculative")
    before = spec.need_metrics("spec_drafted_tokens_total", "spec_accepted_tokens_total")
    for prompt in PROMPTS:
        spec.complete(prompt * 2, max_tokens=64, temperature=0)
    after = spec.metrics()
    drafted = after.get("spec_drafted_tokens_total") - before.get("spec_drafted_tokens_total")
    accepted = after.get("spec_accepted_tokens_total") - before.get("spec_accepted_tokens_total")
    assert drafted > 0, "no token was drafted for repetitive prompts"
    assert 0 <= accepted <= drafted, f"accepted {accepted:.0f} of {drafted:.0f} drafted tokens"
    assert after.get("spec_accepted_tokens_total") <= after.get("spec_drafted_tokens_total")
