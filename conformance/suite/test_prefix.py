"""prefix/*: registration, reuse, metrics, and recurrent models registering nothing."""

from __future__ import annotations

import pytest

from poot.conformance.client import Client
from poot.conformance.outcomes import NotSupported
from poot.conformance.scenarios import unique_text

clause = pytest.mark.clause


def cached_tokens(answer: dict) -> int:
    details = answer["usage"].get("prompt_tokens_details")
    assert isinstance(details, dict) and isinstance(details.get("cached_tokens"), int), \
        f"usage has no prompt_tokens_details.cached_tokens: {answer['usage']!r}"
    return details["cached_tokens"]


@clause("prefix/register/1")
def test_finished_request_registers_whole_prompt_blocks(client: Client, idle):
    if client.facts is not None and client.facts.get("reservation") == "per_slot" and not client.facts.has("block_size"):
        return slot_keeps_the_whole_prompt(client)
    plan = client.need("block_size", "positions", "prefix_metrics")
    bs = plan["block_size"]
    registered = client.metric("prefix_registered_tokens")
    answer = client.complete(unique_text(min(plan["positions"] // 2, 10 * bs + 5)), max_tokens=2)
    client.wait_idle()
    grown = client.metric("prefix_registered_tokens") - registered
    p = answer["usage"]["prompt_tokens"]
    assert grown % bs == 0, f"prefix_registered_tokens grew by {grown:.0f}, not a multiple of block_size {bs}"
    assert (p // bs - 1) * bs <= grown <= p, \
        f"a {p}-token prompt grew prefix_registered_tokens by {grown:.0f}; its whole blocks hold {(p // bs) * bs}"


def slot_keeps_the_whole_prompt(client: Client) -> None:
    """A fixed context per slot, no blocks: a finished request's prompt stays in its slot, so
    the same prompt sent next has every token but the last one cached (that one is fed again
    for the next token's logits)."""
    plan = client.need("positions", "cached_tokens")
    prompt = unique_text(min(plan["positions"] // 2, 400))
    first = client.complete(prompt, max_tokens=2)
    client.wait_idle()
    again = client.complete(prompt, max_tokens=2)
    p, got = first["usage"]["prompt_tokens"], cached_tokens(again)
    assert got >= p - 1, \
        (f"a finished {p}-token prompt sent again reports cached_tokens {got}; kept whole in its slot, at least "
         f"{p - 1} (all but its last token) are cached")


@clause("prefix/reuse/1")
def test_later_request_reuses_the_prefix(client: Client):
    plan = client.need("positions", "cached_tokens")
    bs = client.facts.get("block_size") if client.facts else client.need("block_size")["block_size"]
    prompt = unique_text(min(plan["positions"] // 2, 8 * bs + 3) if bs else min(plan["positions"] // 2, 400))
    first = client.complete(prompt, max_tokens=2)
    second = client.complete(prompt, max_tokens=2)
    third = client.complete(prompt + " and then something else entirely", max_tokens=2)
    assert cached_tokens(first) == 0, f"a fresh prompt reports cached_tokens {cached_tokens(first)}"
    for name, answer in (("the same prompt", second), ("a longer prompt with that prefix", third)):
        got = cached_tokens(answer)
        if bs:  # paged blocks: only whole blocks are cached
            assert got > 0 and got % bs == 0, f"{name} reports cached_tokens {got}, expected a positive multiple of {bs}"
        else:
            assert got > 0, f"{name} reports cached_tokens {got}, expected the cached prefix"
        assert got <= answer["usage"]["prompt_tokens"], f"{name}: cached_tokens {got} > prompt_tokens"
    assert second["usage"]["prompt_tokens"] == first["usage"]["prompt_tokens"], "prompt_tokens changed with a cache hit"
    try:
        rate = client.metrics().get("prefix_cache_hit_rate")
    except NotSupported:  # no /metrics at all: the usage check above is what this clause needs
        return
    # A server without the gauge is prefix/metrics/1's failure; one that has it must show the hits.
    assert rate is None or rate > 0, f"prefix_cache_hit_rate is {rate} after cache hits"


@clause("prefix/metrics/1")
def test_prefix_metrics_are_exported(client: Client):
    client.complete(unique_text(80), max_tokens=2)
    snap = client.metrics()
    missing = [n for n in ("prefix_registered_tokens", "prefix_skipped_releases", "prefix_cache_hit_rate") if not snap.has(n)]
    assert not missing, f"/metrics lacks {missing}"
    rate = snap.get("prefix_cache_hit_rate")
    assert 0.0 <= rate <= 1.0, f"prefix_cache_hit_rate is {rate}, outside [0, 1]"
    assert snap.get("prefix_registered_tokens") >= 0


@clause("prefix/recurrent/1")
def test_recurrent_model_registers_nothing(target):
    rec = target.variant("recurrent")
    before = rec.metrics()
    prompt = unique_text(120)
    answers = [rec.complete(prompt, max_tokens=3) for _ in range(3)]
    rec.wait_idle()
    after = rec.metrics()
    assert after.get("prefix_registered_tokens") == 0, \
        f"a recurrent model registered {after.get('prefix_registered_tokens'):.0f} prefix tokens"
    skipped = after.get("prefix_skipped_releases") - before.get("prefix_skipped_releases")
    assert skipped == 3, f"prefix_skipped_releases grew by {skipped:.0f} for 3 finished requests"
    cached = [(a["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) for a in answers]
    assert cached == [0, 0, 0], f"a recurrent model reported cached tokens {cached}"
