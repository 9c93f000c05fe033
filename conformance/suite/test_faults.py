"""faults/*: a refused step fails its own requests only; a half-applied step kills the engine."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import httpx
import pytest

from poot.conformance.client import Client, auth_headers
from poot.conformance.outcomes import NotSupported
from poot.conformance.scenarios import Mux, Probes, RawStream, fill_rows, sse_chunks, unique_text

clause = pytest.mark.clause
# A server the clause starts itself may be slow to send its first tokens on a busy machine: the
# wait lasts while nothing at all arrives for this long.
STALL_S = 120.0
# A request that must still run when a fault is injected is sized to decode about this long
# alone (at most the positions): on a fast server a few hundred tokens end before the client
# gets to inject the fault.
IN_FLIGHT_S = 10.0


def in_flight_tokens(client: Client, probes: Probes, least: int) -> int:
    positions = client.facts.get("positions") if client.facts is not None else None
    return probes.tokens_lasting(IN_FLIGHT_S, max(least, (positions or 1040) - 40), least=least)


def ended_in_error(stream: RawStream) -> bool:
    """A stream that failed: an error event, finish_reason "error", or no proper end."""
    if stream.request.status is not None and stream.request.status >= 400:
        return True
    chunks, done = sse_chunks(stream.body)
    if any("error" in c for c in chunks):
        return True
    reason = stream.finish_reason()
    return reason not in ("stop", "length") or not done


@clause("faults/refuse/1")
@pytest.mark.disruptive
def test_refused_step_fails_only_its_requests(client: Client, probes: Probes, idle):
    plan = client.need_plan("rows", "positions")
    rows = plan["rows"]
    fillers = fill_rows(client, probes, rows, [plan["positions"] - 40] * rows)
    waiter = None
    try:
        # every row decoding (prefilled), so the next step holds all of them
        Mux(fillers).run(until=lambda m: all(f.first_data is not None for f in fillers), timeout=30)
        waiter = RawStream.open(client, unique_text(16), **probes.long_params(12))
        client.wait_until(lambda s: s.get("engine_requests_waiting", 0) >= 1, 10, "one waiting request")
        client.fault("refuse")
        Mux(fillers + [waiter]).run(timeout=60)
        survived = [i for i, f in enumerate(fillers) if not ended_in_error(f)]
        assert not survived, f"{len(survived)} of {rows} requests in the refused step did not fail"
        assert waiter.finish_reason() == "length" and not ended_in_error(waiter), \
            f"the queued request, not part of the refused step, ended {waiter.finish_reason()!r}; expected 'length'"
    finally:
        for s in fillers + ([waiter] if waiter else []):
            s.close()


@clause("faults/refuse/2")
@pytest.mark.disruptive
def test_serving_goes_on_after_a_refused_step(client: Client, probes: Probes):
    stream = RawStream.open(client, unique_text(16), **probes.long_params(in_flight_tokens(client, probes, 200)))
    try:
        Mux([stream]).run(until=lambda m: stream.first_data is not None, timeout=30)
        client.fault("refuse")
        Mux([stream]).run(timeout=30)
    finally:
        stream.close()
    assert ended_in_error(stream), "the request of the refused step did not fail"
    status, body = client.health()
    assert status == 200 and body.get("status") == "ok", f"after a refused step /health answered {status} {body!r}"
    answer = client.complete(unique_text(16), max_tokens=8)
    assert answer["choices"][0]["finish_reason"] in ("stop", "length")
    try:
        client.need_metrics("kv_blocks_reserved")
    except NotSupported as e:
        raise NotSupported(f"the rest held, but no block left reserved cannot be checked: {e}") from None
    try:
        snap = client.wait_idle(timeout=5)
    except AssertionError as e:
        raise AssertionError(f"blocks stayed reserved after a refused step: {e}") from None
    assert snap.get("kv_blocks_reserved", 0) == 0, f"kv_blocks_reserved is {snap.get('kv_blocks_reserved')} once idle"


@dataclass
class Death:
    health_status: int = 0
    health: dict = field(default_factory=dict)
    failed: int = 0
    streams: int = 0
    after_status: int | None = None
    after_body: dict = field(default_factory=dict)
    after_seconds: float = 0.0
    held_before: dict | None = None  # kv_blocks_reserved and engine_requests_running before the fault
    held_after: dict | None = None  # the same once /health says dead; None without /metrics


def kill_engine(spawn, kind: str, startup_timeout: float, probes: Probes) -> Death:
    max_tokens = in_flight_tokens(probes.client, probes, 300)
    server = spawn()
    server.wait_healthy(startup_timeout)
    client = Client(server.url)
    try:
        streams = [RawStream.open(client, unique_text(16), **probes.long_params(max_tokens)) for _ in range(3)]
        Mux(streams).run(until=lambda m: all(s.first_data is not None for s in streams), timeout=STALL_S)
        before = held(client)
        client.fault(kind)
        Mux(streams).run(timeout=30)
        death = Death(streams=len(streams), failed=sum(ended_in_error(s) for s in streams), held_before=before)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            death.health_status, death.health = client.health()
            if death.health_status != 200:
                break
            time.sleep(0.02)
        death.held_after = held(client) if before is not None else None
        start = time.monotonic()
        try:
            r = httpx.post(server.url + "/v1/completions", json=client.body("after", max_tokens=4), timeout=10,
                           headers=auth_headers(client.api_key))
            death.after_status = r.status_code
            death.after_body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
        except httpx.HTTPError:
            death.after_status = None
        death.after_seconds = time.monotonic() - start
        return death
    finally:
        client.close()


HELD = ("kv_blocks_reserved", "engine_requests_running")


def held(client: Client) -> dict | None:
    """What the engine reports held, or None when /metrics does not say."""
    try:
        snap = client.need_metrics(*HELD)
    except NotSupported:
        return None
    return {name: snap.get(name) for name in HELD}


@pytest.fixture(scope="module")
def deaths() -> dict[str, Death | BaseException]:
    return {}


def death_by(kind: str, spawn, deaths, target, probes: Probes) -> Death:
    if kind not in deaths:
        try:
            target.client.need_fault_injection()
            deaths[kind] = kill_engine(spawn, kind, target.options.getoption("poot_startup_timeout"), probes)
        except BaseException as e:  # noqa: BLE001 - replayed to each clause that needs the scenario
            deaths[kind] = e
    got = deaths[kind]
    if isinstance(got, BaseException):
        raise got
    return got


def check_dead(death: Death, cause: str) -> None:
    assert death.failed == death.streams, f"{death.streams - death.failed} of {death.streams} in-flight requests did not fail"
    assert death.health_status == 503, f"/health answered {death.health_status} {death.health!r}, expected 503"
    assert death.health.get("status") == "dead", f"/health status {death.health.get('status')!r}, expected 'dead'"
    assert death.health.get("cause") == cause, f"/health cause {death.health.get('cause')!r}, expected {cause!r}"
    reason = death.health.get("reason")
    assert isinstance(reason, str) and reason, f"/health reason is {reason!r}, expected a description"


@clause("faults/dead/1")
def test_half_applied_step_kills_the_engine(spawn, deaths, target, probes):
    check_dead(death_by("fault", spawn, deaths, target, probes), "fault")


@clause("faults/dead/2")
def test_panicked_engine_is_reported_dead(spawn, deaths, target, probes):
    check_dead(death_by("panic", spawn, deaths, target, probes), "panicked")


@clause("faults/dead/3")
def test_dead_engine_turns_requests_away(spawn, deaths, target, probes):
    death = death_by("fault", spawn, deaths, target, probes)
    assert death.after_status is not None and 500 <= death.after_status < 600, \
        f"a request to a dead engine answered {death.after_status}, expected 5xx"
    assert isinstance(death.after_body.get("error"), dict), f"no error object: {death.after_body!r}"
    assert death.after_seconds < 5, f"the answer took {death.after_seconds:.1f}s"


@clause("faults/dead/4")
def test_half_applied_step_releases_nothing(spawn, deaths, target, probes):
    death = death_by("fault", spawn, deaths, target, probes)
    if death.held_before is None or death.held_after is None:
        raise NotSupported("what the engine holds is read from /metrics (kv_blocks_reserved, "
                           "engine_requests_running), which this server does not serve")
    before, after = death.held_before, death.held_after
    assert before["kv_blocks_reserved"] > 0 and before["engine_requests_running"] == death.streams, \
        f"before the fault the engine reported {before} for {death.streams} running requests"
    assert after == before, \
        (f"a half-applied step released what its requests held: {before} before the fault, {after} after "
         "(rows and blocks whose device state cannot be trusted must stay held)")
