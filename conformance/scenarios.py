"""Building blocks the suite's tests share: prompts, raw streams watched together, probes."""

from __future__ import annotations

import json
import random
import selectors
import string
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from .client import Client, RawRequest, ServerError
from .outcomes import NotSupported

WORDS = ("amber", "basil", "cedar", "delta", "ember", "fjord", "grove", "harbor", "iris", "juniper",
         "kestrel", "lumen", "meadow", "nectar", "orbit", "pebble", "quartz", "river", "sable", "tundra")


def unique_text(chars: int, rng: random.Random | None = None) -> str:
    """ASCII words starting with a random tag, so no two prompts share a cached prefix."""
    rng = rng or random.Random()
    tag = "".join(rng.choices(string.ascii_lowercase, k=8))
    words = [tag]
    while sum(len(w) + 1 for w in words) < chars:
        words.append(rng.choice(WORDS))
    return " ".join(words)[:chars]


def parse_http(raw: bytes) -> tuple[int | None, dict[str, str], bytes]:
    """Status, headers and body (de-chunked) of a raw HTTP/1.1 response, complete or not."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split() if lines else []
    status = int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else None
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding", "").lower() == "chunked":
        out, rest = b"", body
        while rest:
            size_line, sep, rest = rest.partition(b"\r\n")
            if not sep:
                break
            try:
                size = int(size_line.split(b";")[0], 16)
            except ValueError:
                break
            if size == 0:
                break
            out, rest = out + rest[:size], rest[size + 2:]
        body = out
    return status, headers, body


def sse_chunks(body: bytes) -> tuple[list[dict], bool]:
    """JSON events of an SSE body and whether it ended with [DONE]."""
    chunks, done = [], False
    for line in body.decode("utf-8", errors="replace").splitlines():
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            done = True
        else:
            try:
                chunks.append(json.loads(payload))
            except json.JSONDecodeError:
                pass
    return chunks, done


@dataclass(slots=True)
class RawStream:
    """A streamed request on a bare socket; read with a Mux or on its own."""

    request: RawRequest
    first_data: float | None = None
    finished: float | None = None

    @classmethod
    def open(cls, client: Client, prompt: Any, **params: Any) -> RawStream:
        body = client.body(prompt, stream=True, **params)
        return cls(RawRequest(client.base_url, "/v1/completions", body, api_key=client.api_key))

    @property
    def body(self) -> bytes:
        return parse_http(self.request.received)[2]

    def result(self) -> tuple[list[dict], bool]:
        return sse_chunks(self.body)

    def finish_reason(self) -> str | None:
        chunks, _ = self.result()
        reasons = [c.get("finish_reason") for ch in chunks for c in ch.get("choices") or [] if c.get("finish_reason")]
        return reasons[-1] if reasons else None

    def close(self) -> None:
        self.request.close()


class Mux:
    """Reads several raw streams in one thread, recording when each first sends data and ends.

    What arrives is looked at in its new bytes only (a marker split by a read is found with a
    few bytes of the read before), so hundreds of long streams cost the client little."""

    def __init__(self, streams: list[RawStream]):
        self.streams = streams
        self.order: list[tuple[float, int, str]] = []  # (time, index, "data" | "end")

    def run(self, until=None, timeout: float = 60.0, most: float = 900.0) -> None:
        """Reads until every stream ended (or `until(self)` holds). Fails when no open stream
        has sent anything for `timeout` seconds, or after `most` seconds in all: a slow server
        that keeps streaming is waited for, a stalled one is not."""
        started = moved = time.monotonic()
        open_ = {s.request.sock: i for i, s in enumerate(self.streams) if not s.request.closed and s.finished is None}
        with selectors.DefaultSelector() as selector:
            for sock in open_:
                selector.register(sock, selectors.EVENT_READ)
            while open_ and not (until and until(self)):
                now = time.monotonic()
                if now - moved > timeout:
                    raise ServerError(f"streams still open after {now - started:.0f}s, none sending anything for "
                                      f"{timeout:.0f}s")
                if now - started > most:
                    raise ServerError(f"streams still open after {most:.0f}s")
                ready = selector.select(min(timeout - (now - moved), 0.5))
                now = time.monotonic()
                for key, _ in ready:
                    sock = key.fileobj
                    i = open_[sock]
                    stream = self.streams[i]
                    try:
                        data = sock.recv(65536)
                    except OSError:
                        data = b""
                    if data:
                        moved = now
                    seen = len(stream.request.received)
                    stream.request.received += data
                    tail = stream.request.received[max(0, seen - 8):]
                    if stream.first_data is None and b"data:" in tail and b"data:" in stream.body:
                        stream.first_data = now
                        self.order.append((now, i, "data"))
                    if not data or b"[DONE]" in tail:
                        stream.finished = now
                        self.order.append((now, i, "end"))
                        del open_[sock]
                        selector.unregister(sock)


def drain(streams: list[RawStream]) -> list[int]:
    """Reads whatever every stream's server has sent by now, then counts each one's events
    (data lines, [DONE] aside): how far each had got at one moment, whatever the client's
    own lag, which delays the reading but not what the server had sent before it."""
    for s in streams:
        if not s.request.closed:
            s.request.read_available()
    return [s.request.received.count(b"data:") - s.request.received.count(b"[DONE]") for s in streams]


# Known answers: models whose greedy output for one prompt is known to end by itself (EOS)
# before 48 tokens, as (prompt, params, completion tokens). Used only when the search below finds
# no such prompt: a server that hides end-of-sequence altogether (keeps generating after it)
# looks, from outside, like a model that never picks it, and for these models we know better.
KNOWN_EOS: dict[str, tuple[str, dict, int]] = {
    "synthetic-llama-0": ("goboyqpb sab", {"temperature": 0}, 34),  # the bundled synthetic model
}


# A token id every vocabulary the suite meets holds (byte-level ones included). A logit bias of
# +100 on it makes a greedy request repeat it: no end-of-sequence can win against it, so with
# OpenAI's own logit_bias a request runs to its max_tokens where the server takes no ignore_eos.
BIASED_TOKEN = 65


def arguments_accepted(arguments: Any, parameters: dict, name: str, where: str, label: str = "arguments") -> None:
    """A tool call's `arguments` (named `label` in the verdict) is a JSON string that the
    parameters schema of function `name` accepts."""
    assert isinstance(arguments, str), f"{where}: {label} is a {type(arguments).__name__}, not a JSON string"
    try:
        document = json.loads(arguments)
    except ValueError as e:
        raise AssertionError(f"{where}: {label} is not JSON ({e}): {arguments[:300]!r}") from None
    try:
        jsonschema.validate(document, parameters)
    except jsonschema.ValidationError as e:
        raise AssertionError(f"{where}: {label} is not accepted by {name}'s parameters ({e.message}): "
                             f"{arguments[:300]!r}") from None


def error_param(text: str) -> Any:
    """The error object's param in an answer's body, or None where there is none."""
    try:
        error = json.loads(text).get("error")
    except (ValueError, AttributeError):
        return None
    return error.get("param") if isinstance(error, dict) else None


def refusal_names(status: int | None, text: str, field_name: str) -> bool:
    """Whether an answer refuses a request field by name: a 4xx other than the ones about the
    key, the path or the rate (401, 403, 404, 429) whose body names the field."""
    return status is not None and 400 <= status < 500 and status not in (401, 403, 404, 429) \
        and field_name in text


@dataclass
class Probes:
    """Facts about the target found once per session: what keeps a request running, EOS prompts.

    Requests of clauses not about an extension carry only fields of OpenAI's API; an extension
    (ignore_eos) is sent only once a probe showed the server takes it (or a fact says so)."""

    client: Client
    _long_extra: dict | None = None
    _takes: bool | None = None  # whether the server takes ignore_eos, where no facts layer keeps it
    _eos: tuple[str, dict] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.client.facts is not None:  # an extension: probed before it is sent, unless given
            self.client.facts.measure_with("ignore_eos", self.takes_ignore_eos)

    def takes_ignore_eos(self) -> tuple[bool, str]:
        """Whether the server takes ignore_eos, and what the probe saw (a fact: `ignore_eos`)."""
        r = self.client.post("/v1/completions", self.client.body("probe", max_tokens=1, ignore_eos=True))
        if r.status_code == 200:
            return True, "a request with ignore_eos answered 200"
        return False, f"a request with ignore_eos answered {r.status_code}: {r.text[:120]}"

    def ignore_eos(self) -> dict:
        """{"ignore_eos": True} where the server takes it, else nothing: for requests whose
        text a clause compares, which a logit bias would change."""
        facts = self.client.facts
        if facts is not None:
            return {"ignore_eos": True} if facts.get("ignore_eos") else {}
        with self._lock:
            if self._takes is None:
                self._takes = self.takes_ignore_eos()[0]
        return {"ignore_eos": True} if self._takes else {}

    def long_extra(self) -> dict:
        """Body fields that keep generation from ending early: ignore_eos where the server
        takes it; else OpenAI's logit_bias, +100 on one token, where that holds a request to
        its max_tokens; else nothing (such a request may end by itself)."""
        with self._lock:
            if self._long_extra is None:
                self._long_extra = self.ignore_eos() or self._bias_holds()
                if self.client.facts is not None:
                    how = ("ignore_eos" if "ignore_eos" in self._long_extra
                           else f"logit_bias +100 on token {BIASED_TOKEN}" if self._long_extra
                           else "nothing: such requests may end by themselves")
                    self.client.facts.note("long_requests", how, "probed: what the server takes")
            return dict(self._long_extra)

    def _bias_holds(self) -> dict:
        bias = {"logit_bias": {str(BIASED_TOKEN): 100}}
        r = self.client.post("/v1/completions", self.client.body("probe", max_tokens=16, temperature=0, **bias))
        try:
            answer = r.json() if r.status_code == 200 else {}
            ran = answer["usage"]["completion_tokens"] == 16 and answer["choices"][0]["finish_reason"] == "length"
        except (ValueError, KeyError, IndexError, TypeError):
            ran = False
        return bias if ran else {}

    def long_params(self, max_tokens: int) -> dict:
        return {"max_tokens": max_tokens, "temperature": 0, **self.long_extra()}

    def tokens_lasting(self, seconds: float, most: int, least: int = 64) -> int:
        """max_tokens for a request that decodes about `seconds` on this server as it runs now,
        within [least, most]: for requests a server may run on to their end after a hang-up,
        long enough to tell a release from an end on a fast server, short enough on a slow
        one. Timed on a short greedy request, overhead included, so it errs short. A server
        that does not serve the timing request gets `least`: the clause then says what it sees
        of that server."""
        per_token = self.seconds_per_token()
        if per_token is None:
            return max(1, min(most, least))
        return max(least, min(most, int(seconds / per_token)))

    def seconds_per_token(self) -> float | None:
        """Seconds one request's token takes on this server as it runs now (a short greedy
        request, overhead included, so it errs long); None when the server does not serve it."""
        n = 16
        started = time.monotonic()
        try:
            self.client.complete(unique_text(16), **self.long_params(n))
        except ServerError:
            return None
        return max(1e-6, (time.monotonic() - started) / n)

    def eos_case(self) -> tuple[str, dict]:
        """A prompt and params whose answer ends by itself (EOS) before max_tokens, reproducibly."""
        with self._lock:
            if self._eos is None:
                self._eos = self._find_eos()
            return self._eos

    def _find_eos(self) -> tuple[str, dict]:
        rng = random.Random(7)
        candidates = [({"temperature": 0}, unique_text(rng.randint(8, 40), rng)) for _ in range(48)]
        candidates += [({"temperature": 1.0, "seed": 1000 + k}, unique_text(24, rng)) for k in range(48)]

        def attempt(case):
            params, prompt = case
            answer = self.client.complete(prompt, max_tokens=48, **params)
            choice = answer["choices"][0]
            if choice["finish_reason"] == "stop" and answer["usage"]["completion_tokens"] < 48:
                return prompt, params
            return None

        with ThreadPoolExecutor(8) as pool:
            for found in pool.map(attempt, candidates):
                if found is None:
                    continue
                prompt, params = found
                first = self.client.complete(prompt, max_tokens=48, **params)
                again = self.client.complete(prompt, max_tokens=48, **params)
                if first["choices"][0]["text"] == again["choices"][0]["text"]:
                    return prompt, params
        known = KNOWN_EOS.get(self.client.model)
        if known is not None:  # the model is known to end here: the test then shows what the server did
            return known[0], dict(known[1])
        raise NotSupported("no prompt among 96 tries made the model end by itself (end-of-sequence) "
                           "reproducibly within 48 tokens")


def rows_and_positions(client: Client) -> tuple[int, int]:
    plan = client.need_plan("rows", "positions")
    return plan["rows"], plan["positions"]


def fill_rows(client: Client, probes: Probes, rows: int, max_tokens: list[int], prompt_chars: int = 24,
              timeout: float = 20.0) -> list[RawStream]:
    """Opens len(max_tokens) long streams and waits until `rows` of them run (all rows taken)."""
    fillers = [RawStream.open(client, unique_text(prompt_chars), **probes.long_params(m)) for m in max_tokens]
    try:
        client.wait_until(lambda s: s.get("engine_requests_running", 0) >= min(rows, len(fillers)),
                          timeout, f"{min(rows, len(fillers))} running requests")
    except BaseException:
        for f in fillers:
            f.close()
        raise
    return fillers


def cached_tokens(client: Client, prompt: Any, **params: Any) -> tuple[dict, int]:
    """A completion and how many of its prompt tokens came from the prefix cache: the answer's
    usage.prompt_tokens_details.cached_tokens, or, where answers do not carry it, how far the
    server's prefix-hit counter moved over the request (the suite sends nothing else meanwhile).
    NotSupported when the server tells neither."""
    facts = client.facts
    hits = facts is not None and not facts.has("cached_tokens") and facts.has("prefix_hits")
    before = client.metric("prefix_cache_hit_tokens_total") if hits else None
    answer = client.complete(prompt, **params)
    details = answer.get("usage", {}).get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        return answer, details["cached_tokens"]
    if before is None:
        if facts is not None:
            facts.need("cached_tokens")  # names what is missing
        raise ServerError(f"usage has no prompt_tokens_details.cached_tokens: {answer.get('usage')!r}")
    return answer, int(client.metric("prefix_cache_hit_tokens_total") - before)


def need_cached_tokens(client: Client) -> str:
    """Which way this server tells cached prompt tokens (see cached_tokens); NotSupported if none."""
    facts = client.facts
    if facts is None or facts.has("cached_tokens"):
        return "usage.prompt_tokens_details.cached_tokens"
    if facts.has("prefix_hits"):
        return "the prefix-hit counter on /metrics"
    facts.need("cached_tokens", "prefix_hits")
    raise AssertionError("unreachable")


def refusal_of(client: Client, path: str, body: dict, stream: bool, what: str) -> tuple[int, str]:
    """The status and body of the answer to a request that must be refused at once."""
    import httpx

    try:
        with client.http.stream("POST", path, json={**body, "stream": stream}, timeout=10.0) as r:
            return r.status_code, r.read().decode(errors="replace")
    except httpx.TimeoutException:
        raise AssertionError(f"{what} got no answer within 10 s, expected a 4xx at once") from None


def refused_with_error(status: int, text: str, what: str, served: str) -> None:
    """A 4xx whose body holds an error object with a message: never a 5xx, never a 200.
    `served`: what a 200 that carries no error means (the field ignored, ...)."""
    if status == 200:
        in_stream = any(line.startswith("data:") and '"error"' in line for line in text.splitlines())
        why = ("an error event inside the stream: a request refused at once gets its 4xx before any event"
               if in_stream else served)
        raise AssertionError(f"{what} answered 200, expected a 4xx: {why}: {text[:300]}")
    assert 400 <= status < 500, f"{what} answered {status}, expected a 4xx: {text[:300]}"
    try:
        error = json.loads(text).get("error")
    except (ValueError, AttributeError):
        error = None
    assert isinstance(error, dict) and isinstance(error.get("message"), str) and error["message"], \
        f"{what} answered {status} with no error object holding a message: {text[:300]!r}"
