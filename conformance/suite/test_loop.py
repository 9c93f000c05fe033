"""loop/*: batching, admission, reservation, preemption and the prefill budgets, seen from outside."""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from poot.conformance.client import Client
from poot.conformance.outcomes import NotSupported
from poot.conformance.scenarios import Mux, Probes, RawStream, fill_rows, rows_and_positions, unique_text

clause = pytest.mark.clause


@clause("loop/batching/1")
def test_concurrent_requests_share_steps(client: Client, probes: Probes, idle):
    k, n = 4, 64
    before = client.metric("engine_steps_total")
    # Raw streams, sent back to back: a client thread pool on a busy machine can stagger its
    # sends by more than a short request lasts, which would serialise them from outside.
    streams = [RawStream.open(client, unique_text(16), **probes.long_params(n)) for _ in range(k)]
    try:
        Mux(streams).run(timeout=60)
    finally:
        for st in streams:
            st.close()
    client.wait_idle()
    steps = client.metric("engine_steps_total") - before
    tokens = k * n
    assert steps < max(tokens / 2, n + 1), \
        f"{k} concurrent requests of {n} tokens ({tokens} in all) took {steps:.0f} steps; batched they need about {n}"


def staggered_fill(client: Client, probes: Probes, first: int, gap: int, staggered: int = 3):
    """Every row taken; the first `staggered` fillers end `gap` tokens apart, the rest much later."""
    rows, positions = rows_and_positions(client)
    longest = positions - 40
    assert first + gap * staggered + 64 <= longest, f"plan positions {positions} too small for this check"
    lengths = [first + gap * i for i in range(staggered)] + [longest] * (rows - staggered)
    return rows, fill_rows(client, probes, rows, lengths)


@clause("loop/admission/1")
def test_waiting_requests_open_oldest_first(client: Client, probes: Probes, idle):
    rows, fillers = staggered_fill(client, probes, first=160, gap=24)
    waiters = []
    try:
        for i in range(3):
            waiters.append(RawStream.open(client, unique_text(16), **probes.long_params(24)))
            client.wait_until(lambda s, n=i + 1: s.get("engine_requests_waiting", 0) >= n, 10,
                              f"{i + 1} waiting requests")
        mux = Mux(fillers + waiters)
        w = list(range(rows, rows + 3))
        mux.run(until=lambda m: all(m.streams[i].first_data is not None for i in w), timeout=60)
        order = [i - rows for i in mux.first_data_order(w)]
        assert order == [0, 1, 2], f"queued requests opened in order {order} (0 = sent first), expected [0, 1, 2]"
    finally:
        for s in fillers + waiters:
            s.close()


@dataclass
class NoRoom:
    """What the no-room scenario saw: every row taken, one request more."""

    rows: int
    not_waiting: str | None = None  # why the newcomer was never seen waiting; None: it was
    running_while_waiting: float | None = None
    newcomer_first: float | None = None  # monotonic time of its first token
    first_end: float | None = None  # when the first running request ended
    first_finish: str | None = None
    newcomer_finish: str | None = None
    newcomer_status: int | None = None


def run_no_room(client: Client, probes: Probes) -> NoRoom:
    rows, fillers = staggered_fill(client, probes, first=120, gap=24, staggered=1)
    newcomer = None
    seen = NoRoom(rows)
    try:
        newcomer = RawStream.open(client, unique_text(16), **probes.long_params(16))
        try:
            client.wait_until(lambda s: s.get("engine_requests_waiting", 0) >= 1, 10, "one waiting request")
            seen.running_while_waiting = client.metrics().get("engine_requests_running")
        except AssertionError as e:
            seen.not_waiting = str(e)
        Mux([fillers[0], newcomer]).run(timeout=60)
        seen.newcomer_first, seen.first_end = newcomer.first_data, fillers[0].finished
        seen.first_finish, seen.newcomer_finish = fillers[0].finish_reason(), newcomer.finish_reason()
        seen.newcomer_status = newcomer.request.status
        return seen
    finally:
        for s in fillers + ([newcomer] if newcomer else []):
            s.close()


@pytest.fixture(scope="module")
def no_room_seen() -> dict:
    return {}


def no_room(client: Client, probes: Probes, recorded: dict) -> NoRoom:
    """Runs the scenario once for both clauses; an error in it is replayed to each."""
    if "seen" not in recorded:
        client.wait_idle()
        try:
            recorded["seen"] = run_no_room(client, probes)
        except BaseException as e:  # noqa: BLE001 - replayed to every clause of the scenario
            recorded["seen"] = e
    got = recorded["seen"]
    if isinstance(got, BaseException):
        raise got
    return got


@clause("loop/admission/2")
def test_request_without_room_waits_then_is_served(client: Client, probes: Probes, no_room_seen):
    seen = no_room(client, probes, no_room_seen)
    assert seen.not_waiting is None, \
        f"with every row taken, one request more never showed as waiting: {seen.not_waiting}"
    assert seen.newcomer_first is not None, "the waiting request never got a token"
    assert seen.newcomer_finish == "length", \
        f"the waiting request ended {seen.newcomer_finish!r}; a request without room must wait, then be served"
    assert seen.newcomer_status == 200, f"the waiting request answered {seen.newcomer_status}"


@clause("loop/preempt/1")
def test_running_requests_are_never_preempted(client: Client, probes: Probes, no_room_seen):
    seen = no_room(client, probes, no_room_seen)
    if seen.running_while_waiting is not None:
        assert seen.running_while_waiting == seen.rows, \
            f"{seen.running_while_waiting} running with a request waiting; expected all {seen.rows} rows"
    if seen.newcomer_first is not None:
        assert seen.first_end is not None and seen.newcomer_first >= seen.first_end, \
            (f"the waiting request got its first token {(seen.first_end or 0) - seen.newcomer_first:.3f}s before "
             "the first running request finished: a running request lost its row")
    assert seen.first_finish == "length", \
        f"the first running request ended {seen.first_finish!r}, expected 'length' (all its tokens)"


@clause("loop/reserve/1")
def test_opening_reserves_the_whole_max_tokens(client: Client, probes: Probes, idle):
    plan = client.need_plan("block_size", "positions")
    prompt, max_tokens = unique_text(40), plan["positions"] // 2
    prompt_tokens = client.complete(prompt, max_tokens=1)["usage"]["prompt_tokens"]
    client.wait_idle()
    need = math.ceil((prompt_tokens + max_tokens) / plan["block_size"])
    stream = RawStream.open(client, prompt + " again", **probes.long_params(max_tokens))
    low = None
    try:
        mux = Mux([stream])
        mux.run(until=lambda m: stream.first_data is not None, timeout=30)
        for _ in range(20):
            snap = client.metrics()
            if snap.get("engine_requests_running", 0) == 0:
                break
            reserved = snap.get("kv_blocks_reserved", 0)
            low = reserved if low is None else min(low, reserved)
            time.sleep(0.005)
    finally:
        stream.close()
    assert low is not None, "the request ended before kv_blocks_reserved could be read"
    assert low >= need, (f"kv_blocks_reserved fell to {low:.0f} while a request of ~{prompt_tokens} prompt + "
                         f"{max_tokens} max_tokens ran; it needs {need} blocks of {plan['block_size']}")


def _burst(client: Client, k: int, chars: int):
    prompts = [unique_text(chars) for _ in range(k)]
    with ThreadPoolExecutor(k) as pool:
        return list(pool.map(lambda p: client.complete(p, max_tokens=1), prompts))


@clause("loop/prefill/1")
def test_decoding_rows_advance_every_step(client: Client, probes: Probes, idle):
    plan = client.need_plan("positions", "token_budget")
    long_chars = min(plan["positions"] - 24, 2 * plan["token_budget"])
    max_tokens = plan["positions"] - 40
    before = client.metric("engine_steps_total")
    decode = RawStream.open(client, unique_text(16), **probes.long_params(max_tokens))
    try:
        Mux([decode]).run(until=lambda m: decode.first_data is not None, timeout=30)
        _burst(client, 4, long_chars)
        Mux([decode]).run(timeout=60)
    finally:
        decode.close()
    assert decode.finish_reason() == "length", f"the decoding request ended {decode.finish_reason()!r}"
    client.wait_idle()
    steps = client.metric("engine_steps_total") - before
    assert steps <= max_tokens + 1, \
        (f"a request of {max_tokens} tokens lived through {steps:.0f} steps while 4 long prompts were "
         "prefilled: some steps left the decoding row out")


def step_tokens(client: Client, decoding: bool) -> tuple[dict[float, float], float, float]:
    """The engine_step_tokens histogram for steps with (or without) a decoding row:
    ({bucket bound: steps at or under it}, steps, tokens)."""
    snap = client.metrics()
    want = ("decoding", "true" if decoding else "false")
    buckets, count, total = {}, None, None
    for (name, labels), value in snap.samples.items():
        if want not in labels:
            continue
        if name == "engine_step_tokens_bucket":
            le = dict(labels).get("le", "")
            if le != "+Inf":
                buckets[float(le)] = value
        elif name == "engine_step_tokens_count":
            count = value
        elif name == "engine_step_tokens_sum":
            total = value
    if count is None or total is None:
        raise NotSupported("/metrics has no engine_step_tokens histogram")
    return buckets, count, total


@clause("loop/prefill/2")
def test_prefill_beside_a_decoding_row_stays_within_the_token_budget(client: Client, probes: Probes, idle):
    plan = client.need_plan("positions", "token_budget")
    budget = plan["token_budget"]
    buckets, _, _ = step_tokens(client, decoding=True)
    if float(budget) not in buckets:
        raise NotSupported(f"engine_step_tokens has no bucket at the token budget ({budget})")
    chars = min(plan["positions"] - 8, 3 * budget)
    max_tokens = plan["positions"] - 40
    decode = RawStream.open(client, unique_text(16), **probes.long_params(max_tokens))
    try:
        Mux([decode]).run(until=lambda m: decode.first_data is not None, timeout=30)
        before = step_tokens(client, decoding=True)
        answers = _burst(client, 4, chars)
        after = step_tokens(client, decoding=True)
        running = decode.finish_reason() is None
    finally:
        decode.close()
    assert running, "the decoding request ended before the burst was prefilled; the check needs it beside"
    fed = sum(a["usage"]["prompt_tokens"] - a["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
              for a in answers)
    steps = after[1] - before[1]
    tokens = after[2] - before[2]
    assert tokens >= fed, (f"steps beside the decoding row fed {tokens:.0f} tokens, fewer than the burst's {fed} "
                           "prompt tokens: the burst was prefilled in steps that left the decoding row out")
    over = steps - (after[0][float(budget)] - before[0][float(budget)])
    assert over == 0, (f"{over:.0f} of {steps:.0f} steps beside a decoding row fed more than the token budget "
                       f"of {budget} tokens ({tokens:.0f} tokens in all)")


@clause("loop/prefill/3")
def test_prefill_with_no_row_decoding_stays_within_the_idle_budget(client: Client, idle):
    plan = client.need_plan("positions", "token_budget")
    limit = max(plan["token_budget"], plan.get("idle_token_budget") or 0)
    k = 4
    chars = min(plan["positions"] - 8, int(limit * 1.5))
    before = client.metric("engine_steps_total")
    answers = _burst(client, k, chars)
    steps = client.metric("engine_steps_total") - before
    total = sum(a["usage"]["prompt_tokens"] - a["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
                for a in answers)
    need = math.ceil(total / limit)
    assert steps >= need, (f"{k} prompts of {total} tokens in all were prefilled in {steps:.0f} steps; a budget of "
                           f"{limit} tokens per step needs at least {need}")
