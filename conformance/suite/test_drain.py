"""drain/*: shutdown lets in-flight requests finish while /health says draining."""

from __future__ import annotations

import signal
import time

import httpx
import pytest

from poot.conformance.client import Client, auth_headers
from poot.conformance.drain import MAX_TOKENS, Drain, exit_verdict, health_verdict, inflight_verdict
from poot.conformance.scenarios import Mux, Probes, RawStream, unique_text

clause = pytest.mark.clause
IN_FLIGHT_S = 5.0  # it is sized to decode about this long alone, so it outlives the drain's first probes


def run_drain(spawn, timeout: float, probes: Probes) -> Drain:
    positions = probes.client.facts.get("positions") if probes.client.facts is not None else None
    # Sized by the pace of the shared server (started from the same command): on a fast one a
    # stream of a few hundred tokens would end before /health is asked, whatever the drain.
    drain = Drain(max_tokens=probes.tokens_lasting(IN_FLIGHT_S, max(MAX_TOKENS, (positions or 1040) - 40),
                                                   least=MAX_TOKENS))
    server = spawn()
    server.wait_healthy(timeout)
    client = Client(server.url)
    try:
        stream = RawStream.open(client, unique_text(16), **probes.long_params(drain.max_tokens))
        Mux([stream]).run(until=lambda m: stream.first_data is not None, timeout=120)  # a fresh server, maybe slow
        server.signal(signal.SIGTERM)
        with httpx.Client(timeout=2.0, headers=auth_headers(client.api_key)) as probe:
            for _ in range(3):
                if stream.finished is not None:
                    break
                try:
                    r = probe.get(server.url + "/health")
                    body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
                    drain.health.append((r.status_code, body))
                except (httpx.HTTPError, ValueError) as e:
                    if ended(stream):
                        break  # the stream was done and the server gone: no probe of the drain
                    drain.health.append((None, {"no answer": type(e).__name__}))
                    drain.stopped_at_signal = server.proc.poll()
                    if drain.stopped_at_signal is not None:
                        break  # nothing left to ask
                time.sleep(0.01)
            try:
                r = probe.post(server.url + "/v1/completions", json=client.body("late", max_tokens=2))
                drain.new_request = r.status_code
            except httpx.HTTPError:
                drain.new_request = "refused"
        drain.stream_ended_before_poll = not drain.health
        if drain.stream_ended_before_poll and drain.stopped_at_signal is None:
            drain.stopped_at_signal = server.proc.poll()
        try:
            Mux([stream]).run(timeout=60)
        except AssertionError as e:
            drain.stream_error = str(e)
        finally:
            stream.close()
        chunks = stream.result()
        drain.done = chunks[1]
        drain.finish_reason = stream.finish_reason()
        waited = time.monotonic()
        drain.exit_code = server.wait_exit(timeout)
        drain.exit_wait = time.monotonic() - waited
        return drain
    finally:
        client.close()


def ended(stream: RawStream) -> bool:
    """Whether an unanswered probe came after the in-flight stream ended: nobody reads the
    stream while /health is probed, so a short request may have ended, and a drained server
    exited, without the probe knowing. Reads the stream to its end (briefly) to tell."""
    try:
        Mux([stream]).run(timeout=10)
    except AssertionError:
        return False
    return stream.finished is not None and stream.result()[1]


@pytest.fixture(scope="module")
def recorded() -> dict:
    return {}


def drained(spawn, target, recorded, probes: Probes) -> Drain:
    if "drain" not in recorded:
        try:
            recorded["drain"] = run_drain(spawn, target.options.getoption("poot_startup_timeout"), probes)
        except BaseException as e:  # noqa: BLE001 - replayed to every clause of the scenario
            recorded["drain"] = e
    got = recorded["drain"]
    if isinstance(got, BaseException):
        raise got
    return got


@clause("drain/health/1")
def test_health_reports_draining(spawn, target, recorded, probes):
    d = drained(spawn, target, recorded, probes)
    why = health_verdict(d)
    assert why is None, why


@clause("drain/inflight/1")
def test_in_flight_requests_finish(spawn, target, recorded, probes):
    d = drained(spawn, target, recorded, probes)
    why = inflight_verdict(d)
    assert why is None, why


@clause("drain/refuse/1")
def test_new_requests_are_turned_away(spawn, target, recorded, probes):
    d = drained(spawn, target, recorded, probes)
    assert d.new_request in (503, "refused"), f"a new request while draining answered {d.new_request}, expected 503"


@clause("drain/exit/1")
def test_process_exits_once_drained(spawn, target, recorded, probes):
    d = drained(spawn, target, recorded, probes)
    why = exit_verdict(d)
    assert why is None, why
