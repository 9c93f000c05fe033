"""loop/*: batching, admission, reservation, preemption and the prefill budgets, seen from outside."""

from __future__ import annotations

import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from poot.conformance import timing
from poot.conformance.client import Client, RawRequest, ServerError
from poot.conformance.facts import Facts
from poot.conformance.outcomes import NotSupported
from poot.conformance.scenarios import (
    Mux,
    Probes,
    RawStream,
    drain,
    fill_rows,
    parse_http,
    rows_and_positions,
    unique_text,
)

clause = pytest.mark.clause
DECODE_S = 30.0  # a decode that must outlive a burst of prompts lasts about this long alone
BATCHING_S = 3.0  # loop/batching/1's requests last about this long alone


@clause("loop/batching/1")
def test_concurrent_requests_share_steps(client: Client, probes: Probes, facts: Facts, idle):
    if not facts.has("steps"):
        return shared_steps_by_timing(client, probes, facts)
    k = 4
    # Each request lasts about BATCHING_S alone at this server's pace: on a busy machine the
    # requests sent together reach the engine some steps apart, and a short request could end
    # before the next arrived (64 tokens once took 180 steps beside two busy loops that way).
    n = probes.tokens_lasting(BATCHING_S, (facts.get("positions") or 1040) - 40, least=64)
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


def shared_steps_by_timing(client: Client, probes: Probes, facts: Facts) -> None:
    """No step counter: K requests at once take about as long as one when they share steps,
    and about K times as long when the server runs one at a time."""
    k = 4
    n = min(128, (facts.get("positions") or 4096) - 40)
    seen = timing.shared_steps(client, probes, k=k, n=n)
    assert seen.ratio < k / 2, \
        (f"{k} concurrent requests of {n} tokens took {seen.together:.2f} s, {seen.ratio:.1f} times one alone "
         f"({seen.alone:.2f} s); sharing steps they take about as long as one, one at a time {k} times as long")


ADMISSION_GAP = 24  # engine steps between the rows loop/admission/1 frees


@clause("loop/admission/1")
def test_waiting_requests_open_oldest_first(client: Client, probes: Probes, idle):
    rows, positions = rows_and_positions(client)
    client.need("steps", "running", "waiting")
    for _ in range(3):
        seen = admission_order(client, probes, rows, positions - 40)
        if seen is not None:
            break
        client.wait_idle()
    else:
        raise NotSupported(f"three times a request of {positions - 40} tokens ended by itself before the client had "
                           "freed three rows one by one: this client is too slow beside this server to tell")
    counts, moved = seen
    order = sorted(range(3), key=lambda i: -counts[i])
    assert order == [0, 1, 2], \
        (f"queued requests opened in order {order} (0 = sent first), expected [0, 1, 2]: at one moment they had "
         f"received {counts} tokens (the server moved at most {moved} meanwhile; the rows were freed "
         f"{ADMISSION_GAP} engine steps apart)")


def admission_order(client: Client, probes: Probes, rows: int, length: int) -> tuple[list[int], int] | None:
    """Every row taken by requests of `length` tokens and three more queued one after another
    (each seen waiting before the next is sent); then one row at a time is freed, ADMISSION_GAP
    engine steps apart: a running request hangs up, the server shows one waiter fewer, and
    ADMISSION_GAP more steps pass. Paced by what the server states, so a busy client frees the
    rows later but never closer together. Returns how many tokens each waiter had been sent at
    one moment (see snapshot); None when a running request may have ended by itself before the
    last row was freed (its row, not a hang-up, may then have opened a waiter)."""
    start = client.metric("engine_steps_total")
    fillers = fill_rows(client, probes, rows, [length] * rows)
    waiters: list[RawStream] = []
    try:
        for i in range(3):
            waiters.append(RawStream.open(client, unique_text(16), **probes.long_params(length)))
            client.wait_until(lambda s, n=i + 1: s.get("engine_requests_waiting", 0) >= n, 10,
                              f"{i + 1} waiting requests")
        for k in range(3):
            fillers[k].close()
            snap = client.wait_until(lambda s, n=2 - k: s.get("engine_requests_waiting", 0) <= n, 10,
                                     f"{2 - k} waiting requests once a running one hung up")
            opened = snap.get("engine_steps_total", 0)
            if k < 2:
                client.wait_until(lambda s, t=opened + ADMISSION_GAP: s.get("engine_steps_total", 0) >= t, 10,
                                  f"{ADMISSION_GAP} engine steps")
        if opened >= start + length - 2:  # the first filler opened after `start` and ends `length` steps on
            return None
        Mux(waiters).run(until=lambda m: all(w.first_data is not None for w in waiters), timeout=60)
        return snapshot(waiters)
    finally:
        for s in fillers + waiters:
            s.close()


def snapshot(streams: list[RawStream], tries: int = 20) -> tuple[list[int], int]:
    """How many tokens each running stream had received at one moment, and how far the server
    moved while they were read: every socket is drained, then drained again at once, and what
    the second drain found bounds how many steps passed during the first (a running stream
    gets a token each step). The client's lag delays the moment, but cannot reorder what the
    server had sent by then. A snapshot whose counts lie closer together than that bound is
    taken again."""
    for _ in range(tries):
        counts = drain(streams)
        again = drain(streams)
        moved = max(b - a for a, b in zip(counts, again, strict=True))
        ended = [i for i, s in enumerate(streams) if b"[DONE]" in s.request.received or s.request.status != 200]
        assert not ended, f"streams {ended} ended before their progress could be compared: {counts} tokens"
        if all(abs(a - b) > moved for i, a in enumerate(counts) for b in counts[i + 1:]):
            break
    return counts, moved


@dataclass
class NoRoom:
    """What the no-room scenario saw: every row taken, one request more."""

    rows: int
    first_max_tokens: int  # of the first running request, which ends first
    not_waiting: str | None = None  # why the newcomer was never seen waiting; None: it was
    running_while_waiting: float | None = None
    # tokens the first running request had been sent by the time the newcomer had its first
    # one (read at one moment, so the client's lag cannot lower it); None: no first token
    first_had: int | None = None
    first_finish: str | None = None
    newcomer_finish: str | None = None
    newcomer_status: int | None = None
    stream_error: str | None = None  # why the two streams were not read to their ends

    @property
    def how(self) -> str:
        return f" ({self.stream_error})" if self.stream_error else ""


NO_ROOM_S = 10.0  # the first try's row-fillers decode about this long alone at the server's pace
NO_ROOM_TRIES = 3  # each try's fillers three times as long as the last's


def run_no_room(client: Client, probes: Probes) -> NoRoom:
    """Sized by the server's pace rather than its context: the newcomer waits for the first
    filler to end, and a slow server's whole context took many minutes with every row taken.
    A try whose first filler ended before the newcomer could be seen queued tells nothing,
    and is made again with longer fillers."""
    rows, positions = rows_and_positions(client)
    client.need("running", "waiting")
    seconds, longest = NO_ROOM_S, positions - 40
    for _ in range(NO_ROOM_TRIES):
        length = probes.tokens_lasting(seconds, longest, least=64)
        seen = no_room_once(client, probes, rows, length, last=length >= longest)
        if seen is not None:
            return seen
        client.wait_idle()
        seconds *= 3
    raise NotSupported(f"{NO_ROOM_TRIES} times the first of {rows} requests of up to {length} tokens ended before a "
                       "request more could be seen waiting: this client is too slow beside this server to tell")


def no_room_once(client: Client, probes: Probes, rows: int, length: int, last: bool) -> NoRoom | None:
    """Every row taken by requests of one length (the first opened ends first, with any opened
    in its step), then one request more; None when the first ended before the newcomer showed
    as waiting (its freed row, not a wait, may have let it in), unless the fillers are as
    long as they can be (`last`)."""
    fillers = fill_rows(client, probes, rows, [length] * rows)
    newcomer = None
    seen = NoRoom(rows, length)
    try:
        newcomer = RawStream.open(client, unique_text(16), **probes.long_params(16))
        try:
            client.wait_until(lambda s: s.get("engine_requests_waiting", 0) >= 1, 10, "one waiting request")
            seen.running_while_waiting = client.metrics().get("engine_requests_running")
        except AssertionError as e:
            drain([fillers[0]])
            if fillers[0].finish_reason() is not None and not last:
                return None
            seen.not_waiting = str(e)
        try:
            pair = Mux([fillers[0], newcomer])
            pair.run(until=lambda m: newcomer.first_data is not None, timeout=60)
            seen.first_had = drain([fillers[0]])[0]
            pair.run(timeout=60)
        except AssertionError as e:  # judged on what was seen up to here
            seen.stream_error = str(e)
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
    assert seen.first_had is not None, f"the waiting request never got a token{seen.how}"
    assert seen.newcomer_finish == "length", \
        (f"the waiting request ended {seen.newcomer_finish!r}{seen.how}; a request without room must wait, "
         "then be served")
    assert seen.newcomer_status == 200, f"the waiting request answered {seen.newcomer_status}"


@clause("loop/preempt/1")
def test_running_requests_are_never_preempted(target, client: Client, probes: Probes, no_room_seen):
    seen = no_room(client, probes, no_room_seen)
    if seen.running_while_waiting is not None:
        assert seen.running_while_waiting == seen.rows, \
            f"{seen.running_while_waiting} running with a request waiting; expected all {seen.rows} rows"
    if seen.first_had is not None:
        # Its last tokens and the newcomer's first come a step or two apart, which the server's
        # HTTP layer may send in either order: a few tokens short is no preemption.
        short = seen.first_max_tokens - seen.first_had
        assert short <= target.step_slack, \
            (f"the waiting request got its first token when the first running request had been sent {seen.first_had} "
             f"of its {seen.first_max_tokens} tokens: a running request lost its row")
    assert seen.first_finish == "length", \
        f"the first running request ended {seen.first_finish!r}{seen.how}, expected 'length' (all its tokens)"


@clause("loop/reserve/1")
def test_opening_reserves_the_whole_max_tokens(client: Client, probes: Probes, idle):
    if client.need("reservation")["reservation"] == "per_slot":
        return slot_holds_the_whole_max_tokens(client, probes)
    plan = client.need("block_size", "positions", "kv_blocks", "running")
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
    how = ""
    if client.need("reservation")["reservation"] == "on_demand":
        how = f" (the server allocates blocks as tokens come: {client.facts.known['reservation'].source})"
    assert low >= need, (f"kv_blocks_reserved fell to {low:.0f} while a request of ~{prompt_tokens} prompt + "
                         f"{max_tokens} max_tokens ran; it needs {need} blocks of {plan['block_size']}{how}")


def slot_holds_the_whole_max_tokens(client: Client, probes: Probes) -> None:
    """A fixed context per slot: with every other row busy with long requests, a request whose
    prompt and max_tokens fit one slot runs to its whole max_tokens, never cut short for room."""
    facts = client.need("rows", "positions", "running")
    rows, positions = facts["rows"], facts["positions"]
    fillers = fill_rows(client, probes, rows - 1, [positions - 40] * (rows - 1)) if rows > 1 else []
    try:
        max_tokens = max(16, positions // 8)
        # Streamed, so a slow server that keeps sending is waited for however long it takes.
        answer = client.stream_ok(unique_text(40), stream_options={"include_usage": True}, **probes.long_params(max_tokens))
    finally:
        for f in fillers:
            f.close()
    got = (answer.usage or {}).get("completion_tokens", len([d for d in answer.deltas() if d]))
    assert answer.finish_reason == "length" and got == max_tokens, \
        (f"with {rows - 1} other rows busy, a request of {max_tokens} max_tokens in a slot of {positions} positions "
         f"ended {answer.finish_reason!r} after {got} tokens")


BURST_TIMEOUT_S = 300.0  # a burst of long prompts on a slow server: each answer may take this long


def _burst(client: Client, k: int, chars: int) -> list[dict]:
    """k prompts of `chars` characters, one token each, sent back to back on bare sockets (no
    client threads to start first: on a busy machine those can lag a short decode's end)."""
    requests = [RawRequest(client.base_url, "/v1/completions", client.body(unique_text(chars), max_tokens=1),
                           timeout=BURST_TIMEOUT_S, api_key=client.api_key) for _ in range(k)]
    answers = []
    try:
        for r in requests:
            status, _, body = parse_http(r.read_all(timeout=BURST_TIMEOUT_S))
            if status != 200:
                raise ServerError(f"a prompt of the burst answered {status}: {body[:300]!r}")
            answers.append(json.loads(body))
    finally:
        for r in requests:
            r.close()
    return answers


@clause("loop/prefill/1")
def test_decoding_rows_advance_every_step(client: Client, probes: Probes, idle):
    plan = client.need("positions", "steps", "running")
    budget = client.facts.get("token_budget") if client.facts else None
    long_chars = min(plan["positions"] - 24, 2 * budget) if budget else plan["positions"] - 24
    # Long enough to outlive the burst (checked), short enough to wait out on a slow server.
    max_tokens = probes.tokens_lasting(DECODE_S, plan["positions"] - 40, least=256)
    # A busy machine may delay the burst past a short decode's end: the scenario then runs again.
    for _ in range(3):
        before = client.metric("engine_steps_total")
        decode = RawStream.open(client, unique_text(16), **probes.long_params(max_tokens))
        try:
            Mux([decode]).run(until=lambda m: m.streams[0].first_data is not None, timeout=30)
            _burst(client, 4, long_chars)
            beside = client.metrics().get("engine_requests_running", 0) >= 1
            Mux([decode]).run(timeout=60)
        finally:
            decode.close()
        client.wait_idle()
        if beside:
            break
    assert decode.finish_reason() == "length", f"the decoding request ended {decode.finish_reason()!r}"
    assert beside, (f"in 3 tries the decoding request of {max_tokens} tokens ended before the burst was prefilled; "
                    "the check needs it beside")
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
def test_prefill_beside_a_decoding_row_stays_within_the_token_budget(client: Client, probes: Probes, facts: Facts,
                                                                     idle):
    plan = client.need("positions", "token_budget")
    if not facts.has("step_tokens"):
        return prefill_budget_by_gaps(client, probes, plan["positions"], plan["token_budget"])
    client.need("step_tokens")
    budget = plan["token_budget"]
    buckets, _, _ = step_tokens(client, decoding=True)
    if float(budget) not in buckets:
        raise NotSupported(f"engine_step_tokens has no bucket at the token budget ({budget})")
    chars = min(plan["positions"] - 8, 3 * budget)
    max_tokens = plan["positions"] - 40
    # The decoding row must outlive the burst's prefill; on a busy machine the burst may arrive
    # late enough for a short decode to end first, and the scenario is then run again.
    for _ in range(3):
        decode = RawStream.open(client, unique_text(16), **probes.long_params(max_tokens))
        try:
            Mux([decode]).run(until=lambda m: m.streams[0].first_data is not None, timeout=30)
            before = step_tokens(client, decoding=True)
            answers = _burst(client, 4, chars)
            after = step_tokens(client, decoding=True)
            decode.request.read_available()
            running = decode.finish_reason() is None
        finally:
            decode.close()
        if running:
            break
        client.wait_idle()
    assert running, "in 3 tries the decoding request ended before the burst was prefilled; the check needs it beside"
    fed = sum(a["usage"]["prompt_tokens"] - (a["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
              for a in answers)
    steps = after[1] - before[1]
    tokens = after[2] - before[2]
    assert tokens >= fed, (f"steps beside the decoding row fed {tokens:.0f} tokens, fewer than the burst's {fed} "
                           "prompt tokens: the burst was prefilled in steps that left the decoding row out")
    over = steps - (after[0][float(budget)] - before[0][float(budget)])
    assert over == 0, (f"{over:.0f} of {steps:.0f} steps beside a decoding row fed more than the token budget "
                       f"of {budget} tokens ({tokens:.0f} tokens in all)")


def prefill_budget_by_gaps(client: Client, probes: Probes, positions: int, budget: int) -> None:
    """No per-step histogram: a step beside a decoding row feeds at most `budget` tokens, so
    while a burst of several budgets is prefilled the decoding stream's longest gap stays
    near the time one budget of prompt tokens takes, not the whole burst's."""
    probe = unique_text(min(positions - 16, 2000))
    started = time.monotonic()
    tokens = client.complete(probe, max_tokens=1, timeout=BURST_TIMEOUT_S)["usage"]["prompt_tokens"]
    per_token = (time.monotonic() - started) / max(1, tokens)  # overhead included: errs long
    chars_per_token = len(probe) / max(1, tokens)
    prompt_tokens = min(positions - 16, 3 * budget)
    k = max(2, min(8, -(-3 * budget // prompt_tokens)))
    chars = int(prompt_tokens * chars_per_token * 0.9)
    decode = RawStream.open(client, unique_text(16), **probes.long_params(positions - 40))
    try:
        Mux([decode]).run(until=lambda m: decode.first_data is not None, timeout=30)
        answers: list[dict] = []
        gaps: list[float] = []
        seen = [decode.request.received.count(b"data:"), time.monotonic()]

        def watch(m: Mux) -> bool:
            count = decode.request.received.count(b"data:")
            if count > seen[0]:
                now = time.monotonic()
                gaps.append(now - seen[1])
                seen[:] = [count, now]
            return len(answers) > 0

        with ThreadPoolExecutor(1) as pool:
            job = pool.submit(lambda: answers.extend(_burst(client, k, chars)) or True)
            Mux([decode]).run(until=lambda m: watch(m) or job.done(), timeout=120)
            job.result()
        running = decode.finish_reason() is None
    finally:
        decode.close()
    assert running, "the decoding request ended before the burst was prefilled; the check needs it beside"
    fed = sum(a["usage"]["prompt_tokens"] for a in answers)
    if fed < 2 * budget:
        raise NotSupported(f"the burst held {fed} prompt tokens, under two token budgets of {budget}: too few to tell")
    longest = max(gaps, default=0.0)
    allowed = 1.5 * per_token * budget + 0.1
    assert longest <= allowed, \
        (f"while {k} prompts of {fed} tokens in all were prefilled, the decoding stream waited {longest:.2f} s for a "
         f"token; a step within the token budget of {budget} takes about {per_token * budget:.2f} s "
         f"(allowed {allowed:.2f} s; the whole burst in one step takes about {per_token * fed:.2f} s)")


@clause("loop/prefill/3")
def test_prefill_with_no_row_decoding_stays_within_the_idle_budget(client: Client, idle):
    plan = client.need("positions", "token_budget", "steps")
    plan["idle_token_budget"] = client.facts.get("idle_token_budget") if client.facts else None
    limit = max(plan["token_budget"], plan.get("idle_token_budget") or 0)
    k = 4
    chars = min(plan["positions"] - 8, int(limit * 1.5))
    before = client.metric("engine_steps_total")
    answers = _burst(client, k, chars)
    steps = client.metric("engine_steps_total") - before
    total = sum(a["usage"]["prompt_tokens"] - (a["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                for a in answers)
    need = math.ceil(total / limit)
    assert steps >= need, (f"{k} prompts of {total} tokens in all were prefilled in {steps:.0f} steps; a budget of "
                           f"{limit} tokens per step needs at least {need}")
