"""Facts measured from outside, by timing alone: for a server that publishes no plan and no
/metrics, only the OpenAI API.

- how many requests run at once (rows): open many long streams together, and more while every
  one runs; the ones that send a first token before a quiet spell run, the rest are queued;
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

FIRST_STREAMS = 48  # streams opened at first; while every one runs, as many more again
MOST_STREAMS = 512  # the most opened at once, within the client's sockets (and the KV, where published)
QUIET_S = 1.5  # no new first token for this long (or QUIET_STEPS token gaps): the silent streams are queued
QUIET_STEPS = 10
MEASURE_S = 8.0  # each stream is sized to decode about this long alone: it outlives the measurement


def stream_bound(client: Client, per_stream: int) -> tuple[int, str]:
    """The most streams of `per_stream` tokens (prompt and max_tokens) worth opening at once,
    and why: the client's sockets, and the KV pool where the server publishes it (more than
    it holds cannot run together, whatever the rows)."""
    most, why = MOST_STREAMS, f"the suite opens at most {MOST_STREAMS}"
    try:
        import resource

        sockets = resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 64
        if 0 < sockets < most:
            most, why = sockets, f"the client may open {sockets} sockets"
    except (ImportError, ValueError, OSError):
        pass
    facts = client.facts
    if facts is not None and facts.has("kv_blocks") and facts.get("block_size"):
        try:
            capacity = int(client.metric("kv_blocks_total")) * int(facts.get("block_size"))
        except (AssertionError, NotSupported):
            capacity = 0
        fit = capacity // max(1, per_stream) + 1  # one more than the pool holds, to see it wait
        if 0 < fit < most:
            most, why = fit, (f"a KV pool of {capacity} tokens holds {fit - 1} requests of {per_stream} tokens, "
                              "so one more is the most worth opening")
    return most, why


def measure_rows(client: Client, probes: Probes) -> tuple[int, str]:
    """Requests that run at once: long streams opened together, FIRST_STREAMS at first and, as
    long as every one opened runs, as many more again (up to `stream_bound`); those whose
    first token comes before a quiet spell run, the rest are queued. The streams are sized
    to outlive the measurement, so no row frees up meanwhile, and hung up on once it is done."""
    facts = client.facts
    positions = facts.get("positions") if facts is not None else None
    prompt_chars = 16
    max_tokens = probes.tokens_lasting(MEASURE_S, positions - 40 if positions else 1000, least=200)
    most, why = stream_bound(client, max_tokens + prompt_chars)
    streams: list[RawStream] = []
    try:
        while True:
            opened = time.monotonic()
            streams += [RawStream.open(client, unique_text(prompt_chars), **probes.long_params(max_tokens))
                        for _ in range(min(max(FIRST_STREAMS, len(streams)), most - len(streams)))]
            Mux(streams).run(until=lambda m, t=opened: _settled(m, t), timeout=60)
            started = [s for s in streams if s.first_data is not None]
            refused = [s for s in streams if s.first_data is None and s.finished is not None]
            if not started and refused:
                raise NotSupported(f"streams of {max_tokens} tokens were refused (status {refused[0].request.status}): "
                                   f"{refused[0].body[:160]!r}; rows could not be measured")
            if any(s.finished is not None for s in started):
                raise NotSupported(f"streams of {max_tokens} tokens ended while rows were measured (a row freed up); "
                                   "rows could not be measured")
            if len(started) < len(streams) or len(streams) >= most:  # some queued (or refused): the rows are found
                break
    finally:
        for s in streams:
            s.close()
    # A server that runs abandoned requests on (cancel/stream/1's and cancel/waiting/1's to
    # judge) is waited out: one short request, queued behind them, gets a row only once each
    # has had one, so a clause that then takes every row has them all within about MEASURE_S.
    # (Reading the streams to their ends instead took rows x MEASURE_S on a server that steps
    # one row at a time.)
    client.complete(unique_text(prompt_chars), **probes.long_params(1), timeout=max(60.0, MEASURE_S * len(streams)))
    rows = len(started)
    if rows == len(streams):
        raise NotSupported(f"all {len(streams)} streams opened at once ran together ({why}); the server's rows "
                           "could not be measured: give them with --fact rows=N")
    how = f"{rows} of {len(streams)} streams opened at once sent a first token before a quiet spell"
    if len(streams) > FIRST_STREAMS:
        how += f" (opened {FIRST_STREAMS} at first, more while every one ran; at most {most}: {why})"
    if refused:
        how += f"; {len(refused)} were refused (status {refused[0].request.status}) rather than queued"
    return rows, how


def _settled(mux: Mux, opened: float) -> bool:
    """Every stream started, or none started for a quiet spell: QUIET_S, or QUIET_STEPS token
    gaps of the first stream that started where the server steps slower than that."""
    pending = [s for s in mux.streams if s.first_data is None and s.finished is None]
    if not pending:
        return True
    firsts = [s.first_data for s in mux.streams if s.first_data is not None]
    last = max([opened, *firsts])
    quiet = QUIET_S
    if firsts:
        lead = min((s for s in mux.streams if s.first_data is not None), key=lambda s: s.first_data)
        events = lead.request.received.count(b"data:")
        if events > 1:
            quiet = max(QUIET_S, QUIET_STEPS * (time.monotonic() - lead.first_data) / (events - 1))
    return time.monotonic() - last > quiet


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
