"""Talking to the server under test: JSON requests, SSE streams, raw sockets, metrics."""

from __future__ import annotations

import itertools
import json
import os
import select
import socket
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from .metrics import Snapshot
from .outcomes import NotSupported
from .prometheus import MetricsFormatError, parse


def api_key_from_env() -> str | None:
    """The bearer token to send: poot-conformance's --api-key lands here, else the user's own."""
    return os.environ.get("OPENAI_API_KEY") or None


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {api_key}"} if api_key else {}


class ServerError(AssertionError):
    """The server answered something a clause does not allow; the message says what."""


# ---- the journal: the last requests sent, for a crash report ------------------------------------

HEAD_BYTES = 240  # of a request body or an answer kept: enough to tell one request from another


def _cut(data: bytes | str) -> str:
    text = data.decode(errors="replace") if isinstance(data, bytes) else data
    text = " ".join(text.split())
    return text if len(text) <= HEAD_BYTES else text[: HEAD_BYTES - 3] + "..."


@dataclass(slots=True)
class Sent:
    """One request as sent, and what came back (filled in as it arrives)."""

    seq: int
    origin: str  # scheme://host:port of the server it went to
    method: str
    path: str
    body: str  # cut short
    status: int | None = None
    answer: bytes = b""  # the first HEAD_BYTES of the answer's body
    error: str = ""  # the transport error that ended it (refused, reset, cut off)

    @property
    def failed(self) -> bool:
        """A 5xx, or no answer at all: what a server that stopped serving gives."""
        return bool(self.error) or (self.status is not None and self.status >= 500)

    def request_line(self) -> str:
        return f"{self.method} {self.path}" + (f" {self.body}" if self.body else "")

    def outcome(self) -> str:
        if self.status is not None:
            got = f"{self.status}" + (f" {_cut(self.answer)}" if self.answer else "")
            return got + (f" then {self.error}" if self.error else "")
        return self.error or "no answer seen"

    def describe(self) -> str:
        return f"{self.request_line()} -> {self.outcome()}"


class Journal:
    """The last requests the suite sent, to every server, cheaply (a bounded deque; bodies and
    answers cut short), so a clause during which a server stopped serving can name what it sent
    and what came back."""

    def __init__(self, keep: int = 256):
        self._sent: deque[Sent] = deque(maxlen=keep)
        self._seq = itertools.count()

    def add(self, origin: str, method: str, path: str, body: bytes | str = b"") -> Sent:
        sent = Sent(next(self._seq), origin.rstrip("/"), method, path, _cut(body))
        self._sent.append(sent)
        return sent

    def mark(self) -> int:
        """A point to list requests from: `since(mark)` gives those sent after it."""
        return self._sent[-1].seq + 1 if self._sent else 0

    def since(self, mark: int, origin: str) -> list[Sent]:
        origin = _origin(origin)
        return [s for s in list(self._sent) if s.seq >= mark and s.origin == origin]


def _origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


JOURNAL = Journal()


class _AnswerHead(httpx.SyncByteStream):
    """An answer's body passed through unchanged, its first bytes (and any error) noted."""

    def __init__(self, inner: httpx.SyncByteStream, sent: Sent):
        self.inner, self.sent = inner, sent

    def __iter__(self):
        try:
            for chunk in self.inner:
                if len(self.sent.answer) < HEAD_BYTES:
                    self.sent.answer += chunk[: HEAD_BYTES - len(self.sent.answer)]
                yield chunk
        except Exception as e:
            self.sent.error = f"{type(e).__name__}: {e}"
            raise

    def close(self) -> None:
        self.inner.close()


class Recording(httpx.BaseTransport):
    """httpx's own transport, each request noted in the journal as it goes."""

    def __init__(self, journal: Journal = JOURNAL):
        self.journal = journal
        self.inner = httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        try:
            body = request.content
        except httpx.RequestNotRead:
            body = b"<streamed body>"
        url = request.url
        sent = self.journal.add(f"{url.scheme}://{url.netloc.decode()}", request.method,
                                url.raw_path.decode(errors="replace"), body)
        try:
            response = self.inner.handle_request(request)
        except Exception as e:
            sent.error = f"{type(e).__name__}: {e}"
            raise
        sent.status = response.status_code
        response.stream = _AnswerHead(response.stream, sent)
        return response

    def close(self) -> None:
        self.inner.close()


@dataclass(slots=True)
class Stream:
    """A streamed answer as the client saw it."""

    status: int
    content_type: str
    lines: list[str] = field(default_factory=list)  # raw non-empty lines, in order
    chunks: list[dict] = field(default_factory=list)  # parsed JSON events
    times: list[float] = field(default_factory=list)  # monotonic arrival time of each chunk
    done: bool = False  # saw data: [DONE]
    after_done: list[str] = field(default_factory=list)
    body: str = ""  # the body when status != 200
    started: float = 0.0
    ended: float = 0.0

    def deltas(self) -> list[str]:
        out = []
        for chunk in self.chunks:
            for choice in chunk.get("choices") or []:
                if "text" in choice:
                    out.append(choice.get("text") or "")
                else:
                    out.append((choice.get("delta") or {}).get("content") or "")
        return out

    @property
    def text(self) -> str:
        return "".join(self.deltas())

    @property
    def finish_reason(self) -> str | None:
        reasons = [c.get("finish_reason") for ch in self.chunks for c in ch.get("choices") or []
                   if c.get("finish_reason")]
        return reasons[-1] if reasons else None

    @property
    def usage(self) -> dict | None:
        usages = [c["usage"] for c in self.chunks if c.get("usage")]
        return usages[-1] if usages else None

    def content_times(self) -> list[float]:
        return [t for t, d in zip(self.times, self._chunk_deltas(), strict=True) if d]

    def _chunk_deltas(self) -> list[str]:
        return ["".join((c.get("text") if "text" in c else (c.get("delta") or {}).get("content")) or ""
                        for c in chunk.get("choices") or []) for chunk in self.chunks]


class Client:
    """A synchronous client for one server. Safe to share between threads (httpx pools)."""

    def __init__(self, base_url: str, *, model: str | None = None, dialect: str = "poot",
                 timeout: float = 60.0, api_key: str | None = None, facts=None):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.dialect = dialect
        self._model = model
        self.api_key = api_key if api_key is not None else api_key_from_env()
        self.http = httpx.Client(base_url=self.base_url, timeout=timeout, headers=auth_headers(self.api_key),
                                 transport=Recording())
        self.facts = facts  # poot.conformance.facts.Facts of this server, when discovered

    def __repr__(self) -> str:  # never shows the key
        return f"Client({self.base_url!r})"

    def close(self) -> None:
        self.http.close()

    # -- plain requests -------------------------------------------------------------------
    def get(self, path: str) -> httpx.Response:
        return self.http.get(path)

    def post(self, path: str, body: Any = None, *, content: bytes | None = None) -> httpx.Response:
        if content is not None:
            return self.http.post(path, content=content, headers={"content-type": "application/json"})
        return self.http.post(path, json=body)

    @property
    def model(self) -> str:
        if self._model is None:
            for _ in range(3):  # a dropped connection is retried; only a settled answer is kept
                try:
                    data = self.get("/v1/models").json()["data"]
                    self._model = data[0]["id"]
                    break
                except Exception:  # noqa: BLE001 - any shape problem: api/models/1 reports it
                    continue
            else:
                return "default"  # not remembered: the next request asks again
        return self._model

    def body(self, prompt: Any = None, **params: Any) -> dict:
        body = {"model": self.model, **params}
        if prompt is not None:
            body["prompt"] = prompt
        return body

    def complete(self, prompt: Any, *, timeout: float | None = None, **params: Any) -> dict:
        """A non-streamed completion; fails the clause unless the server answers 200. `timeout`
        (default the client's) is how long the whole answer may take."""
        r = self.http.post("/v1/completions", json=self.body(prompt, **params),
                           timeout=timeout if timeout is not None else self.timeout)
        if r.status_code != 200:
            raise ServerError(f"POST /v1/completions answered {r.status_code}: {r.text[:300]}")
        return r.json()

    def chat(self, messages: list[dict], **params: Any) -> dict:
        r = self.post("/v1/chat/completions", {"model": self.model, "messages": messages, **params})
        if r.status_code != 200:
            raise ServerError(f"POST /v1/chat/completions answered {r.status_code}: {r.text[:300]}")
        return r.json()

    def stream(self, prompt: Any = None, *, path: str = "/v1/completions", body: dict | None = None,
               stop_after: int | None = None, **params: Any) -> Stream:
        """A streamed request read to its end (or closed after `stop_after` chunks)."""
        body = body if body is not None else self.body(prompt, stream=True, **params)
        out = Stream(status=0, content_type="", started=time.monotonic())
        with httpx.Client(base_url=self.base_url, timeout=self.timeout,
                          headers=auth_headers(self.api_key), transport=Recording()) as one_off, \
                one_off.stream("POST", path, json=body) as r:
            out.status, out.content_type = r.status_code, r.headers.get("content-type", "")
            if r.status_code != 200:
                out.body = r.read().decode(errors="replace")
                out.ended = time.monotonic()
                return out
            for line in r.iter_lines():
                if not line.strip():
                    continue
                now = time.monotonic()
                if out.done:
                    out.after_done.append(line)
                    continue
                out.lines.append(line)
                if line.startswith("data:"):
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        out.done = True
                        continue
                    try:
                        out.chunks.append(json.loads(payload))
                        out.times.append(now)
                    except json.JSONDecodeError:
                        pass  # api/sse/1 reports lines that are not JSON
                if stop_after is not None and len(out.chunks) >= stop_after:
                    break
        out.ended = time.monotonic()
        return out

    def stream_ok(self, prompt: Any = None, **kw: Any) -> Stream:
        s = self.stream(prompt, **kw)
        if s.status != 200:
            raise ServerError(f"streamed request answered {s.status}: {s.body[:300]}")
        return s

    # -- health, plan, metrics, faults -----------------------------------------------------
    def health(self) -> tuple[int, dict]:
        r = self.get("/health")
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, {}

    def plan(self) -> dict | None:
        """The engine plan from /health, or None when the server does not publish one."""
        try:
            status, body = self.health()
        except httpx.HTTPError:
            return None
        plan = body.get("plan") if status == 200 else None
        return plan if isinstance(plan, dict) else None

    def need(self, *names: str) -> dict:
        """The facts a clause needs (see poot.conformance.facts); NotSupported naming the missing."""
        return self.need_plan(*names)

    def need_plan(self, *keys: str) -> dict:
        """The facts named by `keys` (rows, positions, block_size, token_budget, ...), through
        the facts layer when this client has one, else from the /health plan."""
        if self.facts is not None:
            return self.facts.need(*keys)
        plan = self.plan()
        if plan is None or any(not isinstance(plan.get(k), int) for k in keys):
            raise NotSupported(f"/health publishes no plan with {', '.join(keys) or 'fields'}")
        return plan

    def metrics(self) -> Snapshot:
        """A scrape of /metrics; NotSupported when the server has none."""
        r = self.get("/metrics")
        if r.status_code == 404:
            raise NotSupported("GET /metrics answered 404")
        if r.status_code != 200:
            raise ServerError(f"GET /metrics answered {r.status_code}")
        try:
            return Snapshot(parse(r.text), self.dialect)
        except MetricsFormatError as e:
            raise ServerError(f"/metrics is not Prometheus text: {e}") from e

    def metric(self, name: str, **labels: str) -> float:
        """One metric by contract name; NotSupported when missing."""
        value = self.metrics().get(name, **labels)
        if value is None:
            raise NotSupported(f"/metrics has no {name}" + (f" (dialect {self.dialect})" if self.dialect != "poot" else ""))
        return value

    def need_metrics(self, *names: str) -> Snapshot:
        snap = self.metrics()
        missing = [n for n in names if not snap.has(n)]
        if missing:
            raise NotSupported(f"/metrics lacks {', '.join(missing)}")
        return snap

    def need_fault_injection(self) -> None:
        """NotSupported unless the server has a fault-injection route: asked with a GET, which
        injects nothing (a server with the route answers 405), before a clause starts a server
        of its own for a fault the shared one, started from the same command, cannot take."""
        if self.get("/debug/fault").status_code == 404:
            raise NotSupported("/debug/fault answered 404 (no fault injection)")

    def fault(self, kind: str) -> None:
        r = self.post("/debug/fault", {"kind": kind})
        if r.status_code == 404:
            raise NotSupported("POST /debug/fault answered 404 (no fault injection)")
        if r.status_code >= 300:
            raise ServerError(f"POST /debug/fault {kind} answered {r.status_code}: {r.text[:200]}")

    def wait_until(self, predicate, timeout: float = 10.0, what: str = "condition",
                   interval: float = 0.002) -> Snapshot:
        """Polls /metrics until predicate(snapshot) holds; fails the clause on timeout."""
        deadline = time.monotonic() + timeout
        snap = self.metrics()
        while not predicate(snap):
            if time.monotonic() > deadline:
                raise ServerError(f"timed out after {timeout:.0f}s waiting for {what}")
            time.sleep(interval)
            snap = self.metrics()
        return snap

    def wait_idle(self, timeout: float = 15.0, most: float = 900.0, interval: float = 0.05,
                  gauges: tuple[str, ...] = ("engine_requests_running", "engine_requests_waiting",
                                             "kv_blocks_reserved")) -> Snapshot | None:
        """Waits until nothing runs, waits or holds blocks (`gauges` all at 0), for as long as
        the engine keeps stepping: a request the server runs on (a hang-up it did not notice)
        is waited out to its end however slow the server is, but one that holds something
        while no engine step moves for `timeout` seconds, or still steps after `most`, fails
        the clause as not idle. None at once for a server whose /metrics has no running gauge
        (a clause that needs one says so itself)."""
        if self.facts is not None and not self.facts.has("running"):
            return None
        started = moved = time.monotonic()
        snap = self.metrics()
        progress = _progress(snap)
        while any(snap.get(name, 0) for name in gauges):
            now = time.monotonic()
            if now - moved > timeout or now - started > most:
                why = (f"no engine step for {timeout:.0f} s" if now - moved > timeout
                       else f"still stepping after {most:.0f} s")
                held = ", ".join(f"{name} {snap.get(name):.0f}" for name in gauges if snap.get(name))
                raise ServerError(f"the server did not go idle: after {now - started:.0f} s {held} ({why})")
            time.sleep(interval)
            snap = self.metrics()
            if (now_progress := _progress(snap)) != progress:
                progress, moved = now_progress, time.monotonic()
        return snap


def _progress(snap: Snapshot) -> float | None:
    """What moves while the engine works: its step counter, else its generated tokens."""
    steps = snap.get("engine_steps_total")
    return steps if steps is not None else snap.get("generation_tokens_total")


class RawRequest:
    """A request over a bare socket, so a test can hang up at the moment it chooses."""

    def __init__(self, base_url: str, path: str, body: dict, timeout: float = 30.0, api_key: str | None = None):
        parts = urlsplit(base_url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        payload = json.dumps(body).encode()
        api_key = api_key if api_key is not None else api_key_from_env()
        auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
        head = (f"POST {parts.path.rstrip('/')}{path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n{auth}"
                "Connection: close\r\n\r\n").encode()
        self._received = b""
        self.closed = False
        self.sent = JOURNAL.add(f"{parts.scheme}://{parts.netloc}", "POST", f"{parts.path.rstrip('/')}{path}", payload)
        try:
            self.sock = socket.create_connection((self.host, self.port), timeout=timeout)
            self.sock.sendall(head + payload)
        except OSError as e:
            self.sent.error = f"{type(e).__name__}: {e}"
            raise

    @property
    def received(self) -> bytes:
        return self._received

    @received.setter
    def received(self, data: bytes) -> None:
        """What arrived so far (a reader may add to it directly); the answer's head goes to the journal."""
        self._received = data
        if len(self.sent.answer) < HEAD_BYTES:
            self.sent.status = self.status
            self.sent.answer = data.partition(b"\r\n\r\n")[2][:HEAD_BYTES]

    def _lost(self, e: OSError) -> None:
        if not self.closed:  # our own hang-up is no error of the server's
            self.sent.error = f"{type(e).__name__}: {e}"

    def read_until(self, marker: bytes, count: int = 1, timeout: float = 30.0) -> bytes:
        """Reads until `marker` has been seen `count` times (or the server closes)."""
        deadline = time.monotonic() + timeout
        while self.received.count(marker) < count:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                data = self.sock.recv(65536)
            except TimeoutError as e:
                raise ServerError(f"no {marker!r} after {timeout:.0f}s") from e
            except OSError as e:
                self._lost(e)
                raise
            if not data:
                break
            self.received += data
        return self.received

    def read_available(self) -> bytes:
        """Whatever has arrived so far, without waiting for more."""
        while not self.closed:
            ready, _, _ = select.select([self.sock], [], [], 0)
            if not ready:
                break
            try:
                data = self.sock.recv(65536)
            except OSError as e:
                self._lost(e)
                break
            if not data:
                break
            self.received += data
        return self.received

    def read_all(self, timeout: float = 60.0) -> bytes:
        deadline = time.monotonic() + timeout
        while True:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                return self.received
            except OSError as e:
                self._lost(e)
                raise
            if not data:
                return self.received
            self.received += data

    @property
    def status(self) -> int | None:
        head = self.received.split(b"\r\n", 1)[0].split()
        return int(head[1]) if len(head) >= 2 and head[1].isdigit() else None

    def close(self) -> None:
        """Hangs up at once (RST rather than a graceful FIN is fine: the server must notice both)."""
        if not self.closed:
            self.closed = True
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.sock.close()
