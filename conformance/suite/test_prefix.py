"""prefix/*: registration, reuse, metrics, and recurrent models registering nothing."""

from __future__ import annotations

import pytest

from poot.conformance.client import Client
from poot.conformance.outcomes import NotSupported
from poot.conformance.scenarios import cached_tokens, need_cached_tokens, unique_text

clause = pytest.mark.clause


@clause("prefix/register/1")
def test_finished_request_registers_whole_prompt_blocks(client: Client, idle):
    facts = client.facts
    if facts is not None and facts.get("reservation") == "per_slot" and not facts.has("block_size"):
        return slot_keeps_the_whole_prompt(client)
    if facts is not None and not facts.has("prefix_metrics") and (facts.has("cached_tokens") or facts.has("prefix_hits")):
        return whole_blocks_hit_when_sent_again(client)
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


def whole_blocks_hit_when_sent_again(client: Client) -> None:
    """No counter of registered tokens: what a finished request registered shows as what the
    same prompt, sent next, takes from the cache: its whole blocks (all but the block holding
    its last token, at worst, which a server may feed again for the next token's logits)."""
    plan = client.need("block_size", "positions")
    how = need_cached_tokens(client)
    bs = plan["block_size"]
    prompt = unique_text(min(plan["positions"] // 2, 10 * bs + 5))
    first, _ = cached_tokens(client, prompt, max_tokens=2)
    client.wait_idle()
    _, got = cached_tokens(client, prompt, max_tokens=2)
    p = first["usage"]["prompt_tokens"]
    assert got % bs == 0, f"a finished {p}-token prompt sent again hit {got} cached tokens ({how}), not whole blocks of {bs}"
    assert (p // bs - 1) * bs <= got <= p, \
        (f"a finished {p}-token prompt sent again hit {got} cached tokens ({how}); had its whole blocks been "
         f"registered, at least {(p // bs - 1) * bs}")


def slot_keeps_the_whole_prompt(client: Client) -> None:
    """A fixed context per slot, no blocks: a finished request's prompt stays in its slot, so
    the same prompt sent next has every token but the last one cached (that one is fed again
    for the next token's logits)."""
    plan = client.need("positions")
    need_cached_tokens(client)
    prompt = unique_text(min(plan["positions"] // 2, 400))
    first = client.complete(prompt, max_tokens=2)
    client.wait_idle()
    _, got = cached_tokens(client, prompt, max_tokens=2)
    p = first["usage"]["prompt_tokens"]
    assert got >= p - 1, \
        (f"a finished {p}-token prompt sent again reports cached_tokens {got}; kept whole in its slot, at least "
         f"{p - 1} (all but its last token) are cached")


@clause("prefix/reuse/1")
def test_later_request_reuses_the_prefix(client: Client):
    plan = client.need("positions")
    how = need_cached_tokens(client)
    bs = client.facts.get("block_size") if client.facts else client.need("block_size")["block_size"]
    prompt = unique_text(min(plan["positions"] // 2, 8 * bs + 3) if bs else min(plan["positions"] // 2, 400))
    first, cold = cached_tokens(client, prompt, max_tokens=2)
    second, again = cached_tokens(client, prompt, max_tokens=2)
    third, longer = cached_tokens(client, prompt + " and then something else entirely", max_tokens=2)
    assert cold == 0, f"a fresh prompt hit {cold} cached tokens ({how})"
    for name, answer, got in (("the same prompt", second, again), ("a longer prompt with that prefix", third, longer)):
        if bs:  # paged blocks: only whole blocks are cached
            assert got > 0 and got % bs == 0, \
                f"{name} hit {got} cached tokens ({how}), expected a positive multiple of {bs}"
        else:
            assert got > 0, f"{name} hit {got} cached tokens ({how}), expected the cached prefix"
        assert got <= answer["usage"]["prompt_tokens"], f"{name}: {got} cached tokens > prompt_tokens"
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
