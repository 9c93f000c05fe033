"""cancel/*: clients that hang up, streaming or not, queued or running."""

from __future__ import annotations

import time

import pytest

from poot.conformance import timing
from poot.conformance.client import Client, RawRequest, ServerError
from poot.conformance.facts import Facts
from poot.conformance.metrics import IN_USE_COUNTS_EVERY_UNFREED_BLOCK
from poot.conformance.outcomes import NotSupported
from poot.conformance.scenarios import (
    Probes,
    RawStream,
    cached_tokens,
    fill_rows,
    need_cached_tokens,
    rows_and_positions,
    unique_text,
)

clause = pytest.mark.clause
# A request that a server may run on to its end after its client hung up is sized to decode
# for about this long alone: on a fast server it is capped by the positions, on a slow one it
# keeps what a departure leaves running short.
LEFT_RUNNING_S = 20.0
OPEN_STEPS = 8  # engine steps within which a request that fits must have been opened


def finished(client: Client, reason: str) -> float | None:
    """requests_finished_total{reason}, or None for a server with no such counter (the
    clause is then judged on the release alone)."""
    if client.facts is not None and client.facts.get("cancelled_counter") is None:
        return None
    return client.metrics().get("requests_finished_total", 0.0, reason=reason)


def check_cancelled_count(client: Client, before: float | None) -> None:
    if before is None:
        return
    after = finished(client, "cancelled")
    assert after == before + 1, f'requests_finished_total{{reason="cancelled"}} moved by {after - before:.0f}, expected 1'


def steps_after_notice(client: Client) -> float:
    """engine_steps_total once the server has surely had time to notice a hang-up that just
    happened: the server has answered two requests sent after it, so its HTTP stack has run
    through at least as many turns as noticing a closed socket takes. Steps from here on are
    the engine's own: the spec allows the one in flight and the next."""
    client.metrics()
    return client.metric("engine_steps_total")


def steps_until_released(client: Client, hang_up, running_before: float, what: str) -> float:
    """Hangs up, then counts engine steps until the running gauge is back to `running_before`.
    A request not released within 10 s is waited on to its end (as long as the engine steps),
    so the failure says what became of it and the next clause finds the server idle."""
    hang_up()
    hung_up = time.monotonic()
    start = steps_after_notice(client)
    try:
        snap = client.wait_until(lambda s: s.get("engine_requests_running", 0) <= running_before, 10,
                                 f"the {what} request to be released after its client hung up")
    except ServerError as e:
        try:
            end = client.wait_idle(timeout=30, gauges=("engine_requests_running",))
        except ServerError as still:
            raise ServerError(f"{e}; {still}") from None
        raise ServerError(f"{e}: it ran on for {end.get('engine_steps_total') - start:.0f} engine steps, "
                          f"{time.monotonic() - hung_up:.0f} s after the hang-up, until it ended by itself") from None
    return snap.get("engine_steps_total") - start


def wait_running(client: Client, count: int) -> None:
    client.wait_until(lambda s: s.get("engine_requests_running", 0) >= count, 10, f"{count} running request(s)")


@clause("cancel/stream/1")
def test_closed_stream_ends_within_one_step(target, client: Client, probes: Probes, facts: Facts, idle):
    if not (facts.has("steps") and facts.has("running")):
        return closed_stream_frees_its_row_by_timing(target, client, probes, facts)
    cancelled = finished(client, "cancelled")
    positions = client.need("positions")["positions"]
    stream = RawStream.open(client, unique_text(20), **probes.long_params(positions - 40))
    stream.request.read_until(b"data:", 3)
    steps = steps_until_released(client, stream.close, 0, "streaming")
    assert steps <= target.step_slack, \
        f"{steps:.0f} engine steps passed between the hang-up and the release (allowed {target.step_slack})"
    check_cancelled_count(client, cancelled)


def closed_stream_frees_its_row_by_timing(target, client: Client, probes: Probes, facts: Facts) -> None:
    """No step counter or running gauge: with every row taken and one request queued, one
    stream hangs up; the queued request must start within a few token gaps, long before the
    closed stream would have ended."""
    rows = client.need("rows")["rows"]
    max_tokens = min(1000, (facts.get("positions") or 1040) - 40)
    seen = timing.release_on_hang_up(client, probes, rows, max_tokens)
    allowed = max(0.3, (target.step_slack + 4) * seen.gap)
    if seen.left < 3 * allowed:
        raise NotSupported(f"a stream of {max_tokens} tokens had {seen.left:.2f} s left at the hang-up, too short beside "
                           f"the {allowed:.2f} s allowed to tell a release from its end")
    waited = "never" if seen.waited is None else f"{seen.waited:.2f} s"
    assert seen.waited is not None and seen.waited <= allowed, \
        (f"with all {rows} rows taken, a queued request started {waited} after a running stream hung up (allowed {allowed:.2f} s, "
         f"{target.step_slack + 4} token gaps of {seen.gap * 1000:.1f} ms; the stream had {seen.left:.2f} s left)")


@clause("cancel/nonstream/1")
def test_non_streaming_hang_up_ends_within_one_step(target, client: Client, probes: Probes, idle):
    client.need("steps", "running")
    positions = client.need("positions")["positions"]
    max_tokens = probes.tokens_lasting(LEFT_RUNNING_S, positions - 40, least=256)
    for _ in range(3):
        cancelled, ended = finished(client, "cancelled"), finished(client, "length")
        steps = hang_up_non_streaming(client, probes, max_tokens)
        # A request that reached max_tokens within the steps allowed after its hang-up says
        # nothing of the hang-up (a busy machine that timed the server slow sizes it short):
        # run it again, longer. One that ran on past them is judged below.
        ended_by_itself = ended is not None and finished(client, "length") > ended
        if steps > target.step_slack or not ended_by_itself or max_tokens >= positions - 40:
            break
        max_tokens = min(positions - 40, 4 * max_tokens)
    if steps <= target.step_slack and ended_by_itself:
        raise NotSupported(f"requests of up to {max_tokens} tokens reached their end before their hang-up was seen, "
                           "three times: too short to tell a release from an end")
    assert steps <= target.step_slack, \
        f"{steps:.0f} engine steps passed between the hang-up and the release (allowed {target.step_slack})"
    check_cancelled_count(client, cancelled)


def hang_up_non_streaming(client: Client, probes: Probes, max_tokens: int) -> float:
    """Engine steps between a non-streaming request's hang-up, a few tokens in, and its release."""
    body = client.body(unique_text(20), **probes.long_params(max_tokens))
    steps = client.metric("engine_steps_total")
    request = RawRequest(client.base_url, "/v1/completions", body, api_key=client.api_key)
    try:
        wait_running(client, 1)
        # Two steps: its prompt's and a first decoding one (a server's token counters may move
        # only when a request ends, its step counter moves as it runs).
        client.wait_until(lambda s: s.get("engine_steps_total", 0) >= steps + 2, 10, "its first decoding step")
        time.sleep(0.02)  # let it decode a few tokens
        return steps_until_released(client, request.close, 0, "non-streaming")
    finally:
        request.close()


@clause("cancel/waiting/1")
def test_waiting_request_whose_client_left_never_opens(target, client: Client, probes: Probes, idle):
    rows, positions = rows_and_positions(client)
    client.need("steps", "running", "waiting")
    fillers = fill_rows(client, probes, rows, [positions - 40] * rows)
    waiter = None
    try:
        waiter = RawStream.open(client, unique_text(16), **probes.long_params(8))
        client.wait_until(lambda s: s.get("engine_requests_waiting", 0) >= 1, 10, "one waiting request")
        waiter.close()
        start = steps_after_notice(client)
        # The fillers keep the engine stepping while we poll, so a poll sees the queue empty
        # some steps after it emptied: the engine is judged by the last scrape that still
        # showed the request queued, a step count it surely stayed queued for, however slow
        # the polls are.
        queued_at = [start]

        def left_queue(snap) -> bool:
            if snap.get("engine_requests_waiting", 0) == 0:
                return True
            queued_at[0] = snap.get("engine_steps_total", queued_at[0])
            return False

        try:
            snap = client.wait_until(left_queue, 10, "the waiting request to leave the queue")
        except ServerError:
            now = client.metrics()
            raise ServerError(f"the queued request whose client left was still in the queue 10 s later "
                              f"(engine_requests_waiting {now.get('engine_requests_waiting'):.0f}, "
                              f"{now.get('engine_steps_total') - start:.0f} engine steps on)") from None
        steps = queued_at[0] - start
        assert snap.get("engine_requests_running") == rows, \
            f"{snap.get('engine_requests_running')} running after the queued client left, expected {rows}"
        assert steps <= target.step_slack, \
            (f"the abandoned request was still queued {steps:.0f} steps after its hang-up was noticed "
             f"(allowed {target.step_slack})")
    finally:
        for s in fillers + ([waiter] if waiter else []):
            s.close()


@clause("cancel/release/1")
def test_cancelled_requests_give_back_their_blocks(client: Client, probes: Probes, idle):
    positions = client.need("positions", "running", "reservation")["positions"]
    for after_chunks in (0, 1, 5, 20):
        stream = RawStream.open(client, unique_text(30), **probes.long_params(positions - 48))
        if after_chunks:
            stream.request.read_until(b"data:", after_chunks)
        else:
            wait_running(client, 1)
        stream.close()
        client.wait_until(lambda s: s.get("engine_requests_running", 0) == 0, 10, "the release")
    max_tokens = probes.tokens_lasting(LEFT_RUNNING_S, positions - 48, least=256)
    request = RawRequest(client.base_url, "/v1/completions", client.body(unique_text(30), **probes.long_params(max_tokens)),
                         api_key=client.api_key)
    wait_running(client, 1)
    request.close()
    # How soon a hang-up is noticed is cancel/stream/1's and cancel/nonstream/1's; what this
    # clause checks comes once the cancelled requests have ended, however late.
    client.wait_idle(timeout=30, gauges=("engine_requests_running", "engine_requests_waiting"))
    if client.need("reservation")["reservation"] == "per_slot":
        return every_slot_still_runs(client, probes, "after 5 cancelled requests")
    client.need("kv_blocks")
    deadline = time.monotonic() + 5
    snap = client.metrics()
    while (snap.get("kv_blocks_reserved", 0) or snap.get("kv_blocks_in_use", 0)) and time.monotonic() < deadline:
        time.sleep(0.01)
        snap = client.metrics()
    assert snap.get("kv_blocks_reserved") == 0 and snap.get("kv_blocks_in_use") == 0, \
        (f"after 5 cancelled requests: kv_blocks_reserved {snap.get('kv_blocks_reserved'):.0f}, "
         f"kv_blocks_in_use {snap.get('kv_blocks_in_use'):.0f}, expected 0")
    if client.dialect in IN_USE_COUNTS_EVERY_UNFREED_BLOCK:
        return  # its in-use gauge is the pool less the free list: a block kept by no request showed above
    whole_pool_still_fits(client, probes, "after 5 cancelled requests")


def every_slot_still_runs(client: Client, probes: Probes, when: str) -> None:
    """A fixed context per slot: a slot a cancelled request kept shows as a row that is gone.
    Once idle, as many requests as there are rows must all run at once."""
    rows, positions = rows_and_positions(client)
    client.wait_until(lambda m: m.get("engine_requests_running", 0) == 0, 10, "the release")
    streams = [RawStream.open(client, unique_text(16), **probes.long_params(positions - 48)) for _ in range(rows)]
    try:
        deadline = time.monotonic() + 10
        snap = client.metrics()
        while snap.get("engine_requests_running", 0) < rows and time.monotonic() < deadline:
            time.sleep(0.02)
            snap = client.metrics()
        assert snap.get("engine_requests_running") == rows, \
            (f"{when}, {rows} requests (one per slot) could not run at once: {snap.get('engine_requests_running'):.0f} "
             f"running, {snap.get('engine_requests_waiting', 0):.0f} waiting (a slot kept by no request is lost room)")
    finally:
        for st in streams:
            st.close()
        client.wait_until(lambda m: m.get("engine_requests_running", 0) == 0, 10, "the release")


def whole_pool_still_fits(client: Client, probes: Probes, when: str) -> None:
    """A block kept by no request shows in no gauge; it shows as room that is gone. Open
    requests whose reservations add up to exactly kv_blocks_total: all must run at once."""
    plan = client.need_plan("rows", "positions", "block_size")
    total = client.metric("kv_blocks_total")
    rows, bs = plan["rows"], plan["block_size"]
    per = plan["positions"] // bs  # the most whole blocks one request can reserve
    if not total or rows * per < total:
        raise NotSupported(f"{when} the other checks held, but {rows} rows of at most {per} blocks cannot hold the "
                           f"whole pool of {total:.0f} blocks, so a block kept by no request cannot be seen")
    count = -(-int(total) // per)
    sizes = [per] * (count - 1) + [int(total) - per * (count - 1)]
    prompt = unique_text(8)
    prompt_tokens = client.complete(prompt, max_tokens=1)["usage"]["prompt_tokens"]
    if min(sizes) * bs <= prompt_tokens + 1:
        raise NotSupported(f"{when} the other checks held, but the pool cannot be split into requests of at least "
                           f"{prompt_tokens + 2} tokens, so a block kept by no request cannot be seen")
    streams = [RawStream.open(client, prompt + f" {i}" if i else prompt, **probes.long_params(n * bs - prompt_tokens - 4))
               for i, n in enumerate(sizes)]
    # Each reserves n blocks: its prompt (a few tokens more with the suffix) plus max_tokens fit n * bs.
    try:
        snap = client.wait_until(lambda m: m.get("engine_requests_running", 0) + m.get("engine_requests_waiting", 0)
                                 >= count, 10, f"{count} requests accepted")
        # Judged on the engine's own clock: a request that fits is opened at the next step, so
        # one still waiting after OPEN_STEPS steps (the others decode meanwhile) finds no room.
        accepted = snap.get("engine_steps_total", 0)
        snap = client.wait_until(lambda m: m.get("engine_requests_running", 0) >= count
                                 or m.get("engine_steps_total", 0) - accepted >= OPEN_STEPS, 30,
                                 f"{count} requests running, or {OPEN_STEPS} engine steps")
        assert snap.get("engine_requests_running") == count, \
            (f"{when}, {count} requests reserving all {total:.0f} KV blocks could not run at once: "
             f"{snap.get('engine_requests_running'):.0f} running, {snap.get('engine_requests_waiting'):.0f} waiting "
             "(blocks given back by no request are lost room)")
    finally:
        for st in streams:
            st.close()
        client.wait_until(lambda m: m.get("engine_requests_running", 0) == 0, 10, "the release")


@clause("cancel/prefix/1")
def test_cancelled_request_registers_its_prompt(client: Client, probes: Probes, facts: Facts, idle):
    plan = client.need("positions", "reservation")
    how = need_cached_tokens(client)
    if plan["reservation"] == "per_block":  # paged blocks: the prefix metrics count what was registered
        plan |= client.need("block_size", "prefix_metrics")
    bs = plan.get("block_size")
    prompt = unique_text(min(plan["positions"] // 2, 12 * bs) if bs else plan["positions"] // 2)
    registered = client.metric("prefix_registered_tokens") if bs else None
    stream = RawStream.open(client, prompt, **probes.long_params(plan["positions"] // 3))
    stream.request.read_until(b"data:", 2)
    stream.close()
    client.wait_idle()
    if registered is not None:
        grown = client.metric("prefix_registered_tokens") - registered
        assert grown >= 4 * bs, f"prefix_registered_tokens grew by {grown:.0f} after cancelling a ~{len(prompt)}-token prompt"
    _, cached = cached_tokens(client, prompt, max_tokens=1)
    assert cached > 0, f"the same prompt after the cancelled one hit {cached} cached tokens ({how})"
