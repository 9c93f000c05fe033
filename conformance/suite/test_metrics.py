"""metrics/*: the names of the contract, an idle server holding nothing, counters, KV gauges."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from poot.conformance.client import Client
from poot.conformance.metrics import CONTRACT_NAMES
from poot.conformance.scenarios import Probes, unique_text

clause = pytest.mark.clause


@clause("metrics/names/1")
def test_every_contract_metric_is_exported(client: Client):
    client.metrics()  # not supported without /metrics, before anything else
    client.complete("hello", max_tokens=2)
    snap = client.metrics()
    missing = [n for n in CONTRACT_NAMES if not snap.has(n)]
    assert not missing, f"/metrics lacks {', '.join(missing)}"


@clause("metrics/idle/1")
def test_idle_server_holds_nothing(client: Client, probes: Probes):
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: client.complete(unique_text(20 + i), **probes.long_params(8 + i)), range(6)))
    deadline = time.monotonic() + 5
    names = ("engine_requests_running", "engine_requests_waiting", "kv_blocks_reserved", "kv_blocks_in_use")
    if client.facts is not None and client.facts.get("reservation") == "per_slot" and not client.facts.has("kv_blocks"):
        names = names[:2]  # a fixed context per slot: no blocks to hold (a slot kept is cancel/release/1's)
    while True:
        snap = client.need_metrics(*names)
        values = {n: snap.get(n) for n in names}
        if not any(values.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert not any(values.values()), f"idle server reports {values}"


@clause("metrics/counters/1")
def test_counters_follow_requests(client: Client, probes: Probes, idle):
    names = ("requests_finished_total", "prompt_tokens_total", "generation_tokens_total")
    before = client.need_metrics(*names)
    answers = [client.complete(unique_text(30), **probes.long_params(9))]
    prompt = unique_text(20)
    answers.append(client.complete(prompt, max_tokens=30, temperature=0))
    text = answers[-1]["choices"][0]["text"]
    stop = next((ch for ch in text[1:] if ch.isascii() and ch.isprintable()), None)
    if stop:
        answers.append(client.complete(prompt, max_tokens=30, temperature=0, stop=[stop]))
    after = client.wait_idle()
    reasons: dict[str, int] = {}
    for answer in answers:
        reason = answer["choices"][0]["finish_reason"]
        reasons[reason] = reasons.get(reason, 0) + 1
    for reason in ("stop", "length"):
        got = (after.get("requests_finished_total", 0, reason=reason)
               - before.get("requests_finished_total", 0, reason=reason))
        want = reasons.get(reason, 0)
        assert got == want, f'requests_finished_total{{reason="{reason}"}} moved by {got:.0f}, expected {want}'
    for name, key in (("prompt_tokens_total", "prompt_tokens"), ("generation_tokens_total", "completion_tokens")):
        got = after.get(name) - before.get(name)
        want = sum(a["usage"][key] for a in answers)
        assert got == want, f"{name} moved by {got:.0f}; the answers report {want} {key}"


@clause("metrics/kv/1")
def test_kv_gauges_are_consistent(client: Client, probes: Probes):
    plan = client.plan() or {}
    stop = threading.Event()
    problems: list[str] = []

    names = ("kv_blocks_in_use", "kv_blocks_reserved", "kv_blocks_total")
    # A server that keeps no gauge of cached blocks (vLLM counts them free) is judged on the rest.
    with_cached = client.need_metrics(*names).has("kv_blocks_cached")

    def sample():
        while not stop.is_set():
            s = client.metrics()
            used, res, tot = (s.get(n) for n in names)
            cached = s.get("kv_blocks_cached") if with_cached else 0.0
            if None in (used, res, tot, cached):
                problems.append("missing KV gauges")
                return
            if not (0 <= used <= res <= tot) or cached > tot - res:
                problems.append(f"in_use {used:.0f}, reserved {res:.0f}, total {tot:.0f}"
                                + (f", cached {cached:.0f}" if with_cached else ""))
            time.sleep(0.003)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        with ThreadPoolExecutor(6) as pool:
            list(pool.map(lambda i: client.complete(unique_text(40 * i + 10), **probes.long_params(30 + 10 * i)), range(6)))
    finally:
        stop.set()
        sampler.join()
    assert not problems, f"inconsistent KV gauges: {problems[0]}"
    snap = client.metrics()
    if "num_blocks" in plan:
        assert snap.get("kv_blocks_total") == plan["num_blocks"], \
            f"kv_blocks_total {snap.get('kv_blocks_total')} != plan num_blocks {plan['num_blocks']}"
    if "rows" in plan and snap.has("engine_rows"):
        assert snap.get("engine_rows") == plan["rows"], f"engine_rows {snap.get('engine_rows')} != plan rows {plan['rows']}"
