"""Facts measured from outside, by timing alone: for a server that publishes no plan and no
/metrics, only the OpenAI API.

- how many requests run at once (rows): open many long streams together; the ones that send
  a first token before a quiet spell run, the rest are queued;
- whether concurrent requests share steps: K requests of N tokens at once take about as long as
  one when they share steps, and about K times as long when the server runs one at a time;
- whether a closed stream frees its row: with every row taken and one request queued, hang up
  one running stream; the queued one must start within a few token gaps, not when the stream
  would have ended.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .client import Client, ServerError
from .outcomes import NotSupported
from .scenarios import Mux, Probes, RawStream, unique_text

MOST_STREAMS = 48  # rows beyond this are not measured: give them as a fact
QUIET_S = 1.5  # no new first token for this long: the streams still silent are queued


def measure_rows(client: Client, probes: Probes, max_tokens: int = 200) -> tuple[int, str]:
    """Requests that run at once: of MOST_STREAMS streams opened together, those whose first
    token comes before a quiet spell of QUIET_S seconds."""
    streams = [RawStream.open(client, unique_text(16), **probes.long_params(max_tokens)) for _ in range(MOST_STREAMS)]
    try:
        mux = Mux(streams)
        last = [time.monotonic()]

        def quiet(m: Mux) -> bool:
            started = sum(s.first_data is not None for s in m.streams)
            if m.order:
                last[0] = max(last[0], m.order[-1][0])
            return started == len(m.streams) or (started > 0 and time.monotonic() - last[0] > QUIET_S)

        mux.run(until=quiet, timeout=60)
        rows = sum(s.first_data is not None and (s.finished is None or s.finished > s.first_data) for s in streams)
        early_end = [s for s in streams if s.finished is not None]
    finally:
        for s in streams:
            s.close()
    if rows >= MOST_STREAMS:
        raise NotSupported(f"all {MOST_STREAMS} streams opened at once ran together; the server's rows could not "
                           "be measured")
    if early_end and len(early_end) >= rows:
        raise NotSupported(f"streams of {max_tokens} tokens ended before the quiet spell; rows could not be measured")
    return rows, f"{rows} of {MOST_STREAMS} streams opened at once sent a first token before {QUIET_S} s of quiet"


def _timed(client: Client, probes: Probes, k: int, n: int) -> float:
    prompts = [unique_text(16) for _ in range(k)]
    started = time.monotonic()
    with ThreadPoolExecutor(k) as pool:
        answers = list(pool.map(lambda p: client.complete(p, **probes.long_params(n)), prompts))
    took = time.monotonic() - started
    short = [a["usage"]["completion_tokens"] for a in answers if a["usage"]["completion_tokens"] < n]
    if short:
        raise NotSupported(f"requests of {n} tokens ended early ({short} tokens): the timing needs them whole")
    return took


@dataclass(slots=True)
class SharedSteps:
    k: int
    n: int
    alone: float  # seconds one request of n tokens takes, best of a few
    together: float  # seconds k of them take at once, best of a few

    @property
    def ratio(self) -> float:
        return self.together / self.alone


def shared_steps(client: Client, probes: Probes, k: int = 4, n: int = 128, tries: int = 3) -> SharedSteps:
    """Times one request of n tokens and k of them at once (non-streamed: no per-token HTTP work)."""
    _timed(client, probes, 1, 8)  # warm
    alone = min(_timed(client, probes, 1, n) for _ in range(tries))
    together = min(_timed(client, probes, k, n) for _ in range(tries))
    return SharedSteps(k, n, alone, together)


@dataclass(slots=True)
class ReleaseSeen:
    rows: int
    gap: float  # median seconds between a running stream's chunks
    left: float  # seconds the closed stream had left to run had it not been released
    waited: float | None  # seconds from the hang-up to the queued request's first token


def release_on_hang_up(client: Client, probes: Probes, rows: int, max_tokens: int) -> ReleaseSeen:
    """Every row taken by long streams and one request queued; one stream hangs up."""
    fillers = [RawStream.open(client, unique_text(16), **probes.long_params(max_tokens)) for _ in range(rows)]
    waiter = None
    try:
        mux = Mux(fillers)
        mux.run(until=lambda m: all(s.first_data is not None for s in m.streams), timeout=60)
        refused = [s.request.status for s in fillers if s.first_data is None]
        if refused:
            raise ServerError(f"{len(refused)} of {rows} streams of {max_tokens} tokens were not served "
                              f"(status {refused[0]}): {fillers[0].body[:200]!r}")
        waiter = RawStream.open(client, unique_text(16), **probes.long_params(8))
        watch = Mux(fillers + [waiter])
        first = fillers[0]
        times: list[float] = []
        seen = [0]

        def chunks(m: Mux) -> bool:
            count = first.request.received.count(b"data:")
            if count > seen[0]:
                times.append(time.monotonic())
                seen[0] = count
            return len(times) >= 12 or waiter.first_data is not None

        watch.run(until=chunks, timeout=60)
        if waiter.first_data is not None:
            raise NotSupported(f"a request sent with all {rows} rows taken started before any hang-up: "
                               f"the server runs more than {rows} requests at once (rows is wrong)")
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)] or [0.01]
        gap = statistics.median(gaps)
        done = first.request.received.count(b"data:")
        left = max(0, max_tokens - done) * gap
        hung_up = time.monotonic()
        first.close()
        try:
            Mux(fillers[1:] + [waiter]).run(until=lambda m: waiter.first_data is not None, timeout=max(30.0, 3 * left))
        except AssertionError:
            pass
        waited = None if waiter.first_data is None else waiter.first_data - hung_up
        return ReleaseSeen(rows, gap, left, waited)
    finally:
        for s in fillers + ([waiter] if waiter else []):
            s.close()
