"""structured/gap, structured/compile, structured/batch: constrained decoding under continuous
batching.

Compiling a schema into a grammar takes from microseconds to seconds, and each constrained
row's mask of allowed tokens is work in every step. Neither may hold up the other streams: a
schema slow to compile arrives while streams run (their token gaps, by timing alone),
constrained rows join and leave the batch (the compile count), and many constrained requests
at once run together (how far each had got when the first one ended).

A server that refuses response_format with a 4xx naming it is not supported here, as for the
other structured clauses.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import string
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pytest

from poot.conformance.client import Client, RawRequest, ServerError
from poot.conformance.documents import slow_schema
from poot.conformance.facts import Facts
from poot.conformance.outcomes import NotSupported
from poot.conformance.scenarios import Mux, Probes, RawStream, drain, refusal_names, sse_chunks, unique_text

clause = pytest.mark.clause

FIELD = "response_format"
CHAT = "/v1/chat/completions"

# A small schema whose documents end well inside WARM_MAX_TOKENS on any model (as in
# test_structured.py): the first constrained request of a clause, alone.
SMALL = {"type": "object", "properties": {"animal": {"type": "string", "enum": ["cat", "dog", "owl"]},
                                          "wild": {"type": "boolean"}},
         "required": ["animal", "wild"], "additionalProperties": False}
WARM_MAX_TOKENS = 64
ASK = "Describe an animal as JSON: its kind and whether it is wild."


def json_schema(schema: dict, name: str = "answer") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def chat_body(client: Client, response_format: dict, ask: str = ASK, **params: Any) -> dict:
    return {"model": client.model, "messages": [{"role": "user", "content": ask}], "temperature": 0,
            "response_format": response_format, **params}


def refused(status: int | None, text: str, what: str) -> None:
    """Not supported where the server refuses response_format by name."""
    if refusal_names(status, text, FIELD):
        raise NotSupported(f"the server refuses {FIELD} ({what}) with {status}: {text[:200]}")


def constrained_answer(client: Client, body: dict, what: str) -> dict:
    """The 200 answer to a blocking constrained chat; not supported where it is refused."""
    r = client.post(CHAT, body)
    refused(r.status_code, r.text, what)
    if r.status_code != 200:
        raise ServerError(f"{what} answered {r.status_code}: {r.text[:300]}")
    return r.json()


def warm_constrained(client: Client) -> dict:
    """One small constrained request alone: whether the server takes response_format at all
    (not supported where it refuses it), and whatever it builds at its first constrained
    request (a view of the vocabulary) built before anything is measured."""
    return constrained_answer(client, chat_body(client, json_schema(SMALL), max_tokens=WARM_MAX_TOKENS),
                              "a chat with a small json_schema response_format")


def open_chat(client: Client, body: dict) -> RawStream:
    """A streamed chat on a bare socket, read with a Mux like the completions streams."""
    return RawStream(RawRequest(client.base_url, CHAT, {**body, "stream": True}, api_key=client.api_key))


def status_of(stream: RawStream, what: str) -> None:
    """Not supported where a stream's answer refuses response_format; a failure for any other
    answer than 200."""
    status = stream.request.status
    if status != 200:
        text = stream.body.decode(errors="replace")
        refused(status, text, what)
        raise ServerError(f"{what} answered {status}: {text[:300]}")


def content_chunks(stream: RawStream) -> int:
    """How many chunks of a streamed chat carried content (a role-only first chunk is none)."""
    chunks, _ = sse_chunks(stream.body)
    return sum(1 for c in chunks for choice in c.get("choices") or [] if (choice.get("delta") or {}).get("content"))


# ---- structured/gap/1 --------------------------------------------------------------------------

# The schema slow to compile is documents.slow_schema: about 750 KB sent, under the 1 MiB a body
# may hold on the reference server.
SLOW_MAX_TOKENS = 8  # the slow request only needs to start: its document is cut short
RUNNING_STREAMS = 4  # plain streams running when it arrives (fewer where the server runs fewer)
BASELINE_EVENTS = 20  # events each running stream sends, on average, before the slow request
# The verdict: no running stream's gap while the slow request is compiled and started may pass
# GAP_TIMES times their median gap, nor GAP_FLOOR_S, whichever is longer. The floor is above
# what a busy two-core machine's noise (the client's own lag included) reached (0.26 s, once);
# a grammar compiled on the loop stalls every stream for the whole compile (0.65 s on Zen 4).
GAP_TIMES = 8
GAP_FLOOR_S = 0.4
# Slow requests sent one after another, each a new schema: a stall that depends on where a
# compile's hold on a lock falls against the streams' turns shows in one of them more often
# than in a single try; a server that compiles where its loop waits fails the first.
SLOW_TRIES = 3
SLOW_DEADLINE_S = 300.0  # the slow request must end within this (a server that compiles very slowly)


@dataclass
class Paced:
    """One stream's events as the client read them: the moments a read brought new ones."""

    stream: RawStream
    scanned: int = 0  # bytes of the answer already looked at for events
    times: list[float] = field(default_factory=list)

    def read(self, now: float) -> None:
        received = self.stream.request.received
        found = False
        while (at := received.find(b"data:", self.scanned)) >= 0:  # looks at new bytes only
            self.scanned, found = at + 5, True
        if found:
            self.times.append(now)

    def gaps(self) -> list[tuple[float, float]]:
        return list(zip(self.times, self.times[1:], strict=False))


class Running:
    """`count` plain streams kept running: each one that ends is replaced at once, so a watch
    longer than one stream's life (a fast server with few positions) has `count` streams
    running throughout."""

    def __init__(self, client: Client, probes: Probes, count: int, max_tokens: int):
        self._open = lambda: Paced(RawStream.open(client, unique_text(16), **probes.long_params(max_tokens)))
        self.current = [self._open() for _ in range(count)]
        self.ended: list[Paced] = []

    @property
    def every(self) -> list[Paced]:
        return self.ended + self.current

    def read(self) -> None:
        now = time.monotonic()
        for p in self.current:
            p.read(now)

    def replace_ended(self) -> None:
        for i, p in enumerate(self.current):
            if p.stream.finished is None:
                continue
            status_of(p.stream, "a plain stream beside the constrained request")
            self.ended.append(p)
            self.current[i] = self._open()

    def watch(self, others: list[RawStream], until: Callable[[], bool], deadline_s: float = SLOW_DEADLINE_S) -> None:
        """Reads the running streams (and `others`) until `until()` holds, replacing those that end."""
        started = time.monotonic()
        while not until():
            if time.monotonic() - started > deadline_s:
                raise ServerError(f"still waiting after {deadline_s:.0f} s")
            streams = [p.stream for p in self.current] + [s for s in others if s.finished is None]

            def seen(m: Mux) -> bool:
                self.read()
                return until() or any(p.stream.finished is not None for p in self.current)

            Mux(streams).run(until=seen, timeout=60)
            self.read()
            self.replace_ended()

    def close(self) -> None:
        for p in self.every:
            p.stream.close()


def running_count(facts: Facts) -> int:
    """RUNNING_STREAMS, fewer where the server is known to run fewer requests at once (one row
    is left for the slow request); never measured here, since a queued stream only waits."""
    rows = facts.get("rows") if facts.has("rows") else None
    return max(1, min(RUNNING_STREAMS, rows - 1)) if rows else RUNNING_STREAMS


@dataclass
class SlowArrival:
    """What the running streams saw while the slow request was compiled and served."""

    kilobytes: int
    sent: float
    ended: float
    gaps: list[float]  # every gap of every running stream, the whole watch long
    during: list[float]  # the gaps that overlap the slow request's time in the server


def slow_arrival(client: Client, probes: Probes, facts: Facts) -> SlowArrival:
    """Plain streams running, then the slow request streamed beside them, read to its end."""
    positions = facts.get("positions") or 1040
    running = Running(client, probes, running_count(facts), probes.tokens_lasting(20.0, positions - 40, least=64))
    slow = None
    try:
        count = len(running.current)
        running.watch([], until=lambda: sum(len(p.times) for p in running.every) >= BASELINE_EVENTS * count)
        tag = "".join(random.choices(string.ascii_lowercase, k=6))
        body = chat_body(client, json_schema(slow_schema(tag), "slow"), ask="Reply with a JSON object.",
                         max_tokens=SLOW_MAX_TOKENS)
        sent = time.monotonic()
        slow = open_chat(client, body)
        running.watch([slow], until=lambda: slow.finished is not None)
        ended = slow.finished
    finally:
        running.close()
        if slow is not None:
            slow.close()
    status_of(slow, "the chat with a schema slow to compile")
    pairs = [g for p in running.every for g in p.gaps()]
    return SlowArrival(len(json.dumps(body)) // 1024, sent, ended, [b - a for a, b in pairs],
                       [b - a for a, b in pairs if b > sent and a < ended])


@clause("structured/gap/1")
def test_slow_schema_stalls_no_running_stream(client: Client, probes: Probes, facts: Facts, idle):
    warm_constrained(client)
    for attempt in range(1, SLOW_TRIES + 1):
        seen = slow_arrival(client, probes, facts)
        assert seen.gaps and seen.during, "the running streams sent no tokens while the slow request was served"
        median = statistics.median(seen.gaps)
        longest = max(seen.during)
        allowed = max(GAP_TIMES * median, GAP_FLOOR_S)
        assert longest <= allowed, \
            (f"a running stream waited {longest:.2f} s for a token while a chat with a schema slow to compile "
             f"({seen.kilobytes} KB, answered in {seen.ended - seen.sent:.2f} s) arrived, on try {attempt} of "
             f"{SLOW_TRIES}; their median gap is {median * 1e3:.1f} ms (allowed {allowed:.2f} s: {GAP_TIMES} times "
             f"that, at least {GAP_FLOOR_S} s): the grammar was compiled or its matcher started where it holds "
             "every stream up")


# ---- structured/compile/1 ----------------------------------------------------------------------

PLAIN_BESIDE = 2  # plain streams the constrained requests join and leave
BESIDE_TRIES = 3


def constrained_wave(client: Client) -> None:
    """Constrained requests at once: json_schema streamed and not, and json_object."""
    small = json_schema(SMALL)
    asks = [(chat_body(client, small, max_tokens=WARM_MAX_TOKENS), False),
            (chat_body(client, small, max_tokens=WARM_MAX_TOKENS), True),
            (chat_body(client, small, max_tokens=WARM_MAX_TOKENS), True),
            (chat_body(client, {"type": "json_object"}, ask='Reply with the JSON object {"ok": true} and nothing else.',
                       max_tokens=WARM_MAX_TOKENS), False)]

    def send(ask: tuple[dict, bool]) -> None:
        body, stream = ask
        if not stream:
            constrained_answer(client, body, "a constrained chat beside plain streams")
            return
        s = client.stream(path=CHAT, body={**body, "stream": True})
        refused(s.status, s.body, "a streamed constrained chat beside plain streams")
        if s.status != 200:
            raise ServerError(f"a streamed constrained chat beside plain streams answered {s.status}: {s.body[:300]}")

    with ThreadPoolExecutor(len(asks)) as pool:
        list(pool.map(send, asks))


def wave_beside_plain(client: Client, probes: Probes, positions: int) -> bool:
    """The constrained wave while plain streams run; whether they still ran when it ended."""
    length = probes.tokens_lasting(10.0, positions - 40, least=64)
    plain = [RawStream.open(client, unique_text(16), **probes.long_params(length)) for _ in range(PLAIN_BESIDE)]
    try:
        Mux(plain).run(until=lambda m: all(s.first_data is not None for s in plain), timeout=60)
        constrained_wave(client)
        drain(plain)
        return all(s.finish_reason() is None and s.request.status == 200 for s in plain)
    finally:
        for s in plain:
            s.close()


@clause("structured/compile/1")
def test_constrained_rows_compile_nothing(client: Client, probes: Probes, facts: Facts, idle):
    warm_constrained(client)
    client.wait_idle()
    before = client.metric("engine_compiles")
    positions = facts.get("positions") or 1040
    for _ in range(BESIDE_TRIES):
        beside = wave_beside_plain(client, probes, positions)
        client.wait_idle()
        if beside:
            break
    after = client.metric("engine_compiles")
    assert after == before, \
        (f"engine_compiles went from {before:.0f} to {after:.0f} as constrained rows joined and left a batch of "
         "plain rows")
    assert beside, (f"in {BESIDE_TRIES} tries the plain streams ended before the constrained requests did; the "
                    "check needs them beside")


# ---- structured/batch/1 ------------------------------------------------------------------------

BATCH_STREAMS = 8  # constrained requests sent at once (fewer where the server runs fewer)
BATCH_S = 1.0  # each document lasts about this long alone at the server's pace
PROBE_ITEMS = 8  # items of the document that measures what one item costs in tokens
LEAST_ITEMS = 16
COLOURS = ["red", "green", "blue", "amber", "teal", "violet", "ochre", "grey"]
LIST_ASK = "List colours as JSON."


def colours(items: int) -> dict:
    """A document of exactly `items` colours: as long as asked, whatever the model picks."""
    return {"type": "object", "properties": {"colours": {"type": "array", "items": {"enum": COLOURS},
                                                         "minItems": items, "maxItems": items}},
            "required": ["colours"], "additionalProperties": False}


def colours_body(client: Client, items: int, max_tokens: int) -> dict:
    return chat_body(client, json_schema(colours(items), "colours"), ask=LIST_ASK, max_tokens=max_tokens)


@dataclass(slots=True)
class Sizing:
    items: int
    max_tokens: int
    prompt_tokens: int


def size_documents(client: Client, probes: Probes, positions: int) -> Sizing:
    """Documents that last about BATCH_S alone: a probe of PROBE_ITEMS colours says what an
    item costs in tokens (its brackets and key counted in, so it errs long), the server's pace
    what a token costs in time; at most half the room the positions leave, so that max_tokens
    can be twice the estimate."""
    what = "a chat with a json_schema response_format of a list of colours"
    probe = constrained_answer(client, colours_body(client, PROBE_ITEMS, PROBE_ITEMS * 16 + 32), what)
    usage = probe.get("usage") or {}
    tokens, prompt_tokens = usage.get("completion_tokens"), usage.get("prompt_tokens")
    if not isinstance(tokens, int) or not isinstance(prompt_tokens, int) or tokens <= 0:
        raise ServerError(f"{what}: usage has no completion_tokens and prompt_tokens: {usage!r}")
    per_item = tokens / PROBE_ITEMS
    per_token = probes.seconds_per_token() or 0.01
    room = positions - prompt_tokens - 16
    most = int(room / (2 * per_item))
    if most < LEAST_ITEMS:
        raise NotSupported(f"{positions} positions hold no document of {LEAST_ITEMS} colours twice over "
                           f"(about {per_item:.1f} tokens each after a prompt of {prompt_tokens})")
    items = max(LEAST_ITEMS, min(most, math.ceil(BATCH_S / (per_token * per_item))))
    return Sizing(items, min(room, int(2 * per_item * items) + 16), prompt_tokens)


def batch_size(client: Client, sizing: Sizing) -> int:
    """BATCH_STREAMS, fewer where the server runs fewer at once or its KV pool holds fewer."""
    k = min(BATCH_STREAMS, client.need("rows")["rows"])
    facts = client.facts
    if facts is not None and facts.has("kv_blocks") and facts.get("block_size"):
        capacity = int(client.metric("kv_blocks_total")) * int(facts.get("block_size"))
        k = min(k, capacity // (sizing.prompt_tokens + sizing.max_tokens))
    if k < 2:
        raise NotSupported(f"the server runs {k} request of {sizing.prompt_tokens + sizing.max_tokens} tokens at "
                           "once: nothing to batch")
    return k


def progress_when_first_ended(streams: list[RawStream]) -> tuple[int, list[int]]:
    """Which stream ended first, and how many content chunks each had been sent by then: every
    socket is drained the moment the first end is read, so the client's lag can add tokens the
    server sent a little later, never take away ones it had sent."""
    Mux(streams).run(until=lambda m: any(s.finished is not None for s in streams), timeout=60)
    drain(streams)
    first = min((i for i, s in enumerate(streams) if s.finished is not None), key=lambda i: streams[i].finished)
    return first, [content_chunks(s) for s in streams]


@clause("structured/batch/1")
def test_constrained_requests_progress_together(client: Client, probes: Probes, facts: Facts, idle):
    sizing = size_documents(client, probes, facts.get("positions") or 1040)
    k = batch_size(client, sizing)
    body = colours_body(client, sizing.items, sizing.max_tokens)
    constrained_answer(client, {**body, "max_tokens": 1}, "the chat of the batch alone")  # its grammar compiled
    streams = [open_chat(client, body) for _ in range(k)]
    try:
        first, had = progress_when_first_ended(streams)
        Mux(streams).run(timeout=60)
    finally:
        for s in streams:
            s.close()
    for i, s in enumerate(streams):
        status_of(s, f"constrained stream {i} of {k}")
    waiting = [i for i, n in enumerate(had) if i != first and n == 0]
    assert not waiting, \
        (f"when the first of {k} constrained streams sent at once ended (stream {first}, a document of "
         f"{sizing.items} colours), {len(waiting)} of the others had not been sent a token yet (content chunks "
         f"per stream: {had}): the constrained requests ran one at a time instead of together")
