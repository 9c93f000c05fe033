"""Defects of the sampling API (api/logprobs, api/echo, api/n, api/penalties), as ASGI
wrappers around the unchanged app: each rewrites a request body before the app reads it, or
the JSON of a whole answer and of each streamed event after the app wrote it. Each factory
below takes (app, state), as the registry's middleware parts do. The defects of structured
outputs (structured_parts.py) and of function tools (tool_parts.py) are made of the same
rewrites."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

Json = dict


class Rewrite:
    """Wraps an ASGI app; `request` rewrites POST bodies, `answer` every JSON answer or event;
    `refuse` names the field a request is refused for with a 400 (None: not refused); `when`
    keeps every rewrite to the requests it holds for."""

    def __init__(self, app, request: Callable[[Json], Json] | None = None,
                 answer: Callable[[Json], Json] | None = None, refuse: Callable[[Json], str | None] | None = None,
                 when: Callable[[Json], bool] | None = None):
        self.app, self.request, self.answer, self.refuse, self.when = app, request, answer, refuse, when

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        raw = await _read_body(receive)
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if self.when is not None and not (isinstance(body, dict) and self.when(body)):
            return await self.app(scope, _replay(raw, receive), send)
        refused = self.refuse(body) if isinstance(body, dict) and self.refuse is not None else None
        if refused is not None:
            return await self._refuse(send, refused)
        if isinstance(body, dict) and self.request is not None:
            raw = json.dumps(self.request(body)).encode()
        start: dict = {}

        async def rewrite(message):
            if message["type"] == "http.response.start":
                start.update(message)
                if not self._is_stream(message):
                    return  # held until the whole body is known (its length changes)
                return await send(message)
            if message["type"] != "http.response.body":
                return await send(message)
            if self._is_stream(start):
                return await send({**message, "body": self._events(message.get("body", b""))})
            if not hasattr(rewrite, "buffer"):
                rewrite.buffer = b""
            rewrite.buffer += message.get("body", b"")
            if message.get("more_body"):
                return
            out = self._json(rewrite.buffer) if start.get("status") == 200 else rewrite.buffer
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(out)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": out, "more_body": False})

        await self.app(scope, _replay(raw, receive), rewrite)

    @staticmethod
    def _is_stream(start: dict) -> bool:
        return any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in start.get("headers", []))

    def _json(self, raw: bytes) -> bytes:
        if self.answer is None:
            return raw
        try:
            return json.dumps(self.answer(json.loads(raw))).encode()
        except ValueError:
            return raw

    def _events(self, raw: bytes) -> bytes:
        if self.answer is None:
            return raw
        out = []
        for line in raw.decode().split("\n"):
            if line.startswith("data: ") and line[6:].strip() != "[DONE]":
                try:
                    line = "data: " + json.dumps(self.answer(json.loads(line[6:])))
                except ValueError:
                    pass
            out.append(line)
        return "\n".join(out).encode()

    @staticmethod
    async def _refuse(send, field: str):
        body = json.dumps({"error": {"message": f"{field} is not supported", "type": "invalid_request_error",
                                     "param": field, "code": None}}).encode()
        await send({"type": "http.response.start", "status": 400,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class FanOut:
    """Answers a non-streamed completion for n choices by n concurrent single requests."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/v1/completions":
            return await self.app(scope, receive, send)
        raw = await _read_body(receive)
        body = json.loads(raw)
        n = body.get("n") or 1
        if n == 1 or body.get("stream"):
            return await self.app(scope, _replay(json.dumps(body).encode(), receive), send)
        one = json.dumps({**body, "n": 1}).encode()
        answers = await asyncio.gather(*(self._call(scope, one, receive) for _ in range(n)))
        status, merged = answers[0]
        if status == 200:
            merged["choices"] = [{**a["choices"][0], "index": i} for i, (_, a) in enumerate(answers)]
            merged["usage"]["completion_tokens"] = sum(a["usage"]["completion_tokens"] for _, a in answers)
        out = json.dumps(merged).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(out)).encode())]})
        await send({"type": "http.response.body", "body": out})

    async def _call(self, scope, raw: bytes, receive) -> tuple[int, dict]:
        status, parts = 0, []

        async def collect(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                parts.append(message.get("body", b""))

        await self.app(scope, _replay(raw, receive), collect)
        return status, json.loads(b"".join(parts))


async def _read_body(receive) -> bytes:
    raw, more = b"", True
    while more:
        message = await receive()
        raw += message.get("body", b"")
        more = message.get("more_body", False)
    return raw


def _replay(raw: bytes, receive):
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        return await receive()
    return replay


# ---- the rewrites ------------------------------------------------------------------------------

def each_choice(change: Callable[[dict], None]) -> Callable[[Json], Json]:
    def answer(body: Json) -> Json:
        for c in body.get("choices") or []:
            change(c)
        return body
    return answer


def _completion_lists(change: Callable[[dict], None]) -> Callable[[dict], None]:
    def on_choice(c: dict) -> None:
        if isinstance(c.get("logprobs"), dict) and "tokens" in c["logprobs"]:
            change(c["logprobs"])
    return on_choice


def _shift(lp: dict) -> None:  # as if logprobs came from another distribution than the pick
    lp["token_logprobs"] = [p if p is None else p - 0.5 for p in lp["token_logprobs"]]


def _no_offsets(lp: dict) -> None:
    lp.pop("text_offset", None)


def _first_scored(lp: dict) -> None:
    if lp["token_logprobs"] and lp["token_logprobs"][0] is None:  # an echoed prompt's first token
        lp["token_logprobs"][0] = 0.0


def _no_bytes(c: dict) -> None:
    for entry in (c.get("logprobs") or {}).get("content") or []:
        entry.pop("bytes", None)


def _stream_no_logprobs(body: Json) -> Json:
    if body.get("object") == "chat.completion.chunk":
        for c in body.get("choices") or []:
            c["logprobs"] = None
    return body


def _one_choice(body: Json) -> Json:
    if body.get("object") == "text_completion" and "usage" in body:
        body["choices"] = body["choices"][:1]
    return body


def _stream_one_index(body: Json) -> Json:
    if body.get("usage"):  # a whole answer, or a stream's usage chunk
        return body
    for c in body.get("choices") or []:
        c["index"] = 0
    return body


def _without(*names: str) -> Callable[[Json], Json]:
    def request(body: Json) -> Json:
        for name in names:
            body.pop(name, None)
        return body
    return request


def _logprobs_or_echo(body: Json) -> str | None:
    """The field of the two a request asks for, logprobs first; None when neither."""
    if body.get("logprobs") not in (None, False):
        return "logprobs"
    return "echo" if body.get("echo") else None


def _rewrite(**how):
    return lambda app, state: Rewrite(app, **how)


logprobs_not_of_the_pick = _rewrite(answer=each_choice(_completion_lists(_shift)))
logprobs_no_text_offset = _rewrite(answer=each_choice(_completion_lists(_no_offsets)))
chat_logprobs_no_bytes = _rewrite(answer=each_choice(_no_bytes))
chat_stream_drops_logprobs = _rewrite(answer=_stream_no_logprobs)
echo_ignored = _rewrite(request=_without("echo"))
echo_scores_first_token = _rewrite(answer=each_choice(_completion_lists(_first_scored)))
n_answers_one_choice = _rewrite(answer=_one_choice)
n_stream_one_index = _rewrite(answer=_stream_one_index)
frequency_penalty_ignored = _rewrite(request=_without("frequency_penalty"))
logit_bias_ignored = _rewrite(request=_without("logit_bias"))
stop_token_ids_ignored = _rewrite(request=_without("stop_token_ids"))
# A server that refuses logprobs and echo with a 400: those clauses are not supported, not failed.
refuses_logprobs = _rewrite(refuse=_logprobs_or_echo)


def n_prefills_each_choice(app, state):
    return FanOut(app)


ignore_eos_ignored = _rewrite(request=_without("ignore_eos"))


# ---- a strict OpenAI server: not a defect ------------------------------------------------------

# The request fields of OpenAI's API reference (the legacy completions endpoint, chat completions).
OPENAI_COMPLETION_FIELDS = frozenset({
    "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
    "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p", "user"})
OPENAI_CHAT_FIELDS = frozenset({
    "model", "messages", "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs",
    "max_completion_tokens", "max_tokens", "metadata", "modalities", "n", "parallel_tool_calls", "prediction",
    "presence_penalty", "prompt_cache_key", "reasoning_effort", "response_format", "safety_identifier", "seed",
    "service_tier", "stop", "store", "stream", "stream_options", "temperature", "tool_choice", "tools",
    "top_logprobs", "top_p", "user", "verbosity", "web_search_options"})
OPENAI_FIELDS = {"/v1/completions": OPENAI_COMPLETION_FIELDS, "/v1/chat/completions": OPENAI_CHAT_FIELDS}


class RefuseUnknownFields:
    """Answers 422 naming them to requests with fields outside OpenAI's API, as servers built on
    a strict request model do: extensions such as ignore_eos and stop_token_ids included, and
    response_format on /v1/completions. The reference server refuses only what it does not
    implement (400), and takes those."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        known = OPENAI_FIELDS.get(scope.get("path", "")) if scope["type"] == "http" else None
        if known is None or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        raw = await _read_body(receive)
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        unknown = sorted(set(body) - known) if isinstance(body, dict) else []
        if not unknown:
            return await self.app(scope, _replay(raw, receive), send)
        out = json.dumps({"error": {"message": f"Unexpected fields in the request: {set(unknown)}",
                                    "type": "invalid_request_error", "param": unknown[0], "code": None}}).encode()
        await send({"type": "http.response.start", "status": 422,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(out)).encode())]})
        await send({"type": "http.response.body", "body": out})


def refuses_unknown_fields(app, state):
    return RefuseUnknownFields(app)
