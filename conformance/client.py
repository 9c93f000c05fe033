"""Talking to the server under test: JSON requests, SSE streams, raw sockets, metrics."""

from __future__ import annotations

import json
import os
import select
import socket
import time
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
        self.http = httpx.Client(base_url=self.base_url, timeout=timeout, headers=auth_headers(self.api_key))
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
                          headers=auth_headers(self.api_key)) as one_off, \
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
        self.sock = socket.create_connection((self.host, self.port), timeout=timeout)
        self.sock.sendall(head + payload)
        self.received = b""
        self.closed = False

    def read_until(self, marker: bytes, count: int = 1, timeout: float = 30.0) -> bytes:
        """Reads until `marker` has been seen `count` times (or the server closes)."""
        deadline = time.monotonic() + timeout
        while self.received.count(marker) < count:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                data = self.sock.recv(65536)
            except TimeoutError as e:
                raise ServerError(f"no {marker!r} after {timeout:.0f}s") from e
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
            except OSError:
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
