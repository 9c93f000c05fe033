"""Defects of the HTTP layer: ASGI middleware around the unchanged app, ServerState
subclasses, and command-line parser subclasses."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os

from poot.server.auth import RequireKey
from poot.server.state import ServerState

SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")

# ---- middleware -------------------------------------------------------------------------------


class Middleware:
    """Wraps the app; a subclass edits JSON answers (`edit_json`), SSE events (`edit_event`,
    with per-response state in `stream`) or the request (`handle`)."""

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        await self.handle(scope, receive, send)

    async def handle(self, scope, receive, send):
        await self.app(scope, receive, self.editing_send(scope, send))

    def editing_send(self, scope, send):
        start: dict = {}
        body = bytearray()
        stream: dict = {}

        async def edited(message):
            if message["type"] == "http.response.start":
                start.update(message)
                headers = dict(message.get("headers", []))
                start["sse"] = headers.get(b"content-type", b"").startswith(b"text/event-stream")
                if start["sse"]:
                    await send(message)
                return
            if message["type"] != "http.response.body":
                return await send(message)
            if start["sse"]:
                out = []
                for event in message.get("body", b"").decode().split("\n\n"):
                    if event:
                        out += self.edit_event(scope, event + "\n\n", stream)
                await send({**message, "body": "".join(out).encode()})
                return
            body.extend(message.get("body", b""))
            if message.get("more_body"):
                return
            status, headers, payload = start["status"], start.get("headers", []), bytes(body)
            if dict(headers).get(b"content-type", b"").startswith(b"application/json"):
                status, payload, kind = self.edit_json(scope, status, json.loads(payload))
                if not isinstance(payload, bytes):
                    payload = json.dumps(payload).encode()
                headers = [(k, v) for k, v in headers if k not in (b"content-length", b"content-type")]
                headers += [(b"content-length", str(len(payload)).encode()), (b"content-type", kind)]
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": payload})

        return edited

    def edit_json(self, scope, status: int, body):
        """Returns (status, body as JSON or bytes, content type)."""
        return status, body, b"application/json"

    def edit_event(self, scope, event: str, stream: dict) -> list[str]:
        """Returns the SSE events to send in place of `event` ("data: ...\\n\\n")."""
        return [event]


def chunk_of(event: str):
    """The JSON of an SSE event, or None for [DONE] and the like."""
    data = event[len("data: "):].strip()
    try:
        return json.loads(data)
    except ValueError:
        return None


def sse(obj) -> str:
    return "data: " + json.dumps(obj, separators=(",", ":")) + "\n\n"


def json_defect(name: str, edit):
    """Middleware whose JSON answers go through edit(path, status, body) -> (status, body)."""

    def edit_json(self, scope, status, body):
        status, body = edit(scope["path"], status, body)
        return status, body, b"application/json"

    return type(name, (Middleware,), {"edit_json": edit_json})


def chunk_defect(name: str, edit):
    """Middleware whose SSE chunks go through edit(chunk, stream) -> list of chunks (JSON)."""

    def edit_event(self, scope, event, stream):
        chunk = chunk_of(event)
        return [event] if chunk is None else [sse(c) for c in edit(chunk, stream)]

    return type(name, (Middleware,), {"edit_event": edit_event})


def _health(edit):
    def on(path, status, body):
        return edit(status, body) if path == "/health" else (status, body)
    return on


def _healthy_when_dead(status, body):
    return (200, {"status": "ok"}) if body.get("status") == "dead" else (status, body)


def _panic_as_fault(status, body):
    if body.get("cause") == "panicked":
        body["cause"] = "fault"
    return status, body


def _ready(status, body):
    if body.get("status") == "ok":
        body["status"] = "ready"
    return status, body


def _no_plan(status, body):
    body.pop("plan", None)
    return status, body


HealthyWhenDead = json_defect("HealthyWhenDead", _health(_healthy_when_dead))
NoPlanOnHealth = json_defect("NoPlanOnHealth", _health(_no_plan))  # not a defect: a plan unpublished
PanicReportedAsFault = json_defect("PanicReportedAsFault", _health(_panic_as_fault))
HealthStatusReady = json_defect("HealthStatusReady", _health(_ready))


class HealthyWhileDraining(Middleware):
    def edit_json(self, scope, status, body):
        if scope["path"] == "/health" and body.get("status") == "draining":
            return 200, {"status": "ok", "plan": self.state.engine.plan.as_dict()}, b"application/json"
        return status, body, b"application/json"


def _models_not_a_list(path, status, body):
    if path == "/v1/models" and status == 200:
        body["object"] = "models"
    return status, body


def _no_created(path, status, body):
    if path == "/v1/completions" and status == 200:
        body.pop("created", None)
    return status, body


def _no_role(path, status, body):
    if path == "/v1/chat/completions" and status == 200:
        body["choices"][0]["message"].pop("role", None)
    return status, body


def _stop_as_length_json(path, status, body):
    for choice in body.get("choices", ()) if isinstance(body, dict) else ():
        if choice.get("finish_reason") == "stop":
            choice["finish_reason"] = "length"
    return status, body


def _total_without_prompt_json(path, status, body):
    use = body.get("usage") if isinstance(body, dict) else None
    if use:
        use["total_tokens"] = use["completion_tokens"]
    return status, body


def _error(status, message, code=None, param=None):
    kind = "invalid_request_error" if status < 500 else "service_unavailable" if status == 503 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _bad_params_500(path, status, body):
    e = body.get("error") if isinstance(body, dict) else None
    if status == 400 and e and e.get("param") in SAMPLING_FIELDS:
        return 500, _error(500, e["message"], param=e["param"])
    return status, body


def _non_object_500(path, status, body):
    e = body.get("error") if isinstance(body, dict) else None
    if status == 400 and e and "must be a JSON object" in e.get("message", ""):
        return 500, _error(500, "internal error: the request body is not an object", "internal_error")
    return status, body


def _param_null(path, status, body):
    if status == 400 and isinstance(body, dict) and "error" in body:
        body["error"]["param"] = None
    return status, body


def _unknown_path_400(path, status, body):
    if status == 404:
        return 400, _error(400, f"bad request for {path}")
    return status, body


class DeadPlain503(Middleware):
    def edit_json(self, scope, status, body):
        e = body.get("error") if isinstance(body, dict) else None
        if status == 503 and e and e.get("code") == "engine_dead":
            return status, e["message"].encode(), b"text/plain"
        return status, body, b"application/json"


ModelsNotAList = json_defect("ModelsNotAList", _models_not_a_list)
CompletionNoCreated = json_defect("CompletionNoCreated", _no_created)
ChatNoRole = json_defect("ChatNoRole", _no_role)
BadParams500 = json_defect("BadParams500", _bad_params_500)
NonObjectBody500 = json_defect("NonObjectBody500", _non_object_500)
ErrorParamNull = json_defect("ErrorParamNull", _param_null)
UnknownPath400 = json_defect("UnknownPath400", _unknown_path_400)


class StopReportedAsLength(chunk_defect("_StopChunks", lambda c, s: [_stop_as_length_json("", 0, c)[1]])):
    edit_json = json_defect("_", _stop_as_length_json).edit_json


class TotalWithoutPrompt(chunk_defect("_UsageChunks", lambda c, s: [_total_without_prompt_json("", 0, c)[1]])):
    edit_json = json_defect("_", _total_without_prompt_json).edit_json


def _new_ids(chunk, stream):
    stream["n"] = stream.get("n", 0) + 1
    chunk["id"] = f"{chunk['id']}-{stream['n']}"
    return [chunk]


def _no_usage_chunk(chunk, stream):
    return [] if not chunk.get("choices") and chunk.get("usage") else [chunk]


def _text_of(choice) -> str:
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


def _set_text(choice, text: str) -> None:
    if "text" in choice:
        choice["text"] = text
    elif text:
        choice.setdefault("delta", {})["content"] = text
    else:
        (choice.get("delta") or {}).pop("content", None)


def _drop_first_text(chunk, stream):
    for choice in chunk.get("choices", ()):
        if not stream.get("dropped") and _text_of(choice):
            _set_text(choice, "")
            stream["dropped"] = True
    return [chunk]


def _batch(chunk, stream):
    """Holds every text chunk back and sends the whole text with the final one."""
    choices = chunk.get("choices") or []
    if not choices or (choices[0].get("delta") or {}).get("role"):
        return [chunk]
    choice = choices[0]
    if choice.get("finish_reason") is None:
        stream["held"] = stream.get("held", "") + _text_of(choice)
        return []
    _set_text(choice, stream.pop("held", "") + _text_of(choice))
    return [chunk]


ChunkIdsDiffer = chunk_defect("ChunkIdsDiffer", _new_ids)
IgnoreIncludeUsage = chunk_defect("IgnoreIncludeUsage", _no_usage_chunk)
StreamDropsFirstText = chunk_defect("StreamDropsFirstText", _drop_first_text)
BatchStream = chunk_defect("BatchStream", _batch)


class NoDoneSentinel(Middleware):
    def edit_event(self, scope, event, stream):
        return [] if event.strip() == "data: [DONE]" else [event]


async def read_request(receive) -> tuple[bytes, list[dict]]:
    messages, body = [], bytearray()
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            break
        body.extend(message.get("body", b""))
        if not message.get("more_body"):
            break
    return bytes(body), messages


def replay(messages: list[dict], receive, deaf: bool = False):
    """A receive that answers the request's messages again, then the client's; `deaf`: then
    nothing at all, so a hang-up is never heard."""
    queue = list(messages)

    async def again():
        if queue:
            return queue.pop(0)
        if deaf:
            await asyncio.Event().wait()
        return await receive()

    return again


def _json_body(body: bytes) -> dict:
    try:
        parsed = json.loads(body)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


class NoTokenPrompts(Middleware):
    """A prompt given as token ids gets 400."""

    async def handle(self, scope, receive, send):
        body, messages = await read_request(receive)
        if scope["path"] == "/v1/completions" and isinstance(_json_body(body).get("prompt"), list):
            payload = json.dumps(_error(400, "prompt must be a string", param="prompt")).encode()
            await send({"type": "http.response.start", "status": 400,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(payload)).encode())]})
            await send({"type": "http.response.body", "body": payload})
            return
        await self.app(scope, replay(messages, receive), send)


class _CrashOnNoPrompt(Middleware):
    """A completion request with no prompt, or an empty one, takes the server down (`crash`),
    as a server whose request model reads a missing prompt as "" and whose batching worker
    dies on an empty one; any other request is served as before."""

    async def handle(self, scope, receive, send):
        if scope["method"] != "POST" or scope["path"] != "/v1/completions":
            return await self.app(scope, receive, send)
        body, messages = await read_request(receive)
        try:
            request = json.loads(body)
        except ValueError:
            request = None
        if not isinstance(request, dict) or request.get("prompt", "") not in ("", [], None):
            return await self.app(scope, replay(messages, receive), send)  # not JSON, or a prompt: served
        await self.crash()
        payload = json.dumps(_error(500, "the engine crashed on an empty prompt")).encode()
        await send({"type": "http.response.start", "status": 500,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})

    async def crash(self) -> None:
        raise NotImplementedError


class EmptyPromptKillsEngine(_CrashOnNoPrompt):
    """The engine thread panics (its own death path, through its fault hook): the request gets
    500, /health 503 dead, and every later request 503, for good."""

    async def crash(self) -> None:
        engine = self.state.engine
        engine.inject_fault("panic")
        for _ in range(200):  # the engine thread takes the panic at its next iteration (50 ms when idle)
            if engine.health().status != "ok":
                return
            await asyncio.sleep(0.01)


class EmptyPromptExitsProcess(_CrashOnNoPrompt):
    """The process exits at once (as a native crash would): the request's connection is cut."""

    async def crash(self) -> None:
        os._exit(1)


class _IgnoreDisconnect(Middleware):
    """Requests whose `stream` flag equals `streams` never hear their client hang up, and
    their sends to a client that is gone are dropped: they run to their end."""

    streams = False

    async def handle(self, scope, receive, send):
        if scope["method"] != "POST":
            return await self.app(scope, receive, send)
        body, messages = await read_request(receive)
        if (_json_body(body).get("stream") is True) != self.streams:
            return await self.app(scope, replay(messages, receive), send)

        async def quiet_send(message):
            with contextlib.suppress(OSError):
                await send(message)

        await self.app(scope, replay(messages, receive, deaf=True), quiet_send)


class IgnoreDisconnectNonstream(_IgnoreDisconnect):
    streams = False


class IgnoreDisconnectStream(_IgnoreDisconnect):
    streams = True


# ---- the server state -------------------------------------------------------------------------


class ServeWhileDraining(ServerState):
    def accepting(self):
        return True


class DrainExit1(ServerState):
    def drained(self):
        self.exit_code = 1
        super().drained()


class ExitAtSigterm(ServerState):
    """Shutdown is a stop: the process exits 1 at once, cutting the streams in flight before
    their end, and /health never says draining."""

    def begin_drain(self):
        os._exit(1)


class CancelOnDrain(ServerState):
    """Shutdown cuts the requests in flight off instead of letting them finish (needs the
    engine_parts.CancelAllOnDrain engine)."""

    def begin_drain(self):
        super().begin_drain()
        self.engine.cancel_all()


# ---- the command line -------------------------------------------------------------------------


class AcceptUnknownOptions(argparse.ArgumentParser):
    def parse_known_args(self, args=None, namespace=None):
        parsed, _ = super().parse_known_args(args, namespace)
        return parsed, []


class RowsOption(argparse.ArgumentParser):
    """poot-serve accepts a --max-num-seqs option (which claims to set the rows)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.add_argument("--max-num-seqs", type=int, default=None, help=argparse.SUPPRESS)


# ---- the API key guard ------------------------------------------------------------------------


class AnyBearerKey(RequireKey):
    """Lets through any request with a bearer token, whatever the token."""

    def _allowed(self, scope) -> bool:
        return any(name == b"authorization" and value.lower().startswith(b"bearer ")
                   for name, value in scope.get("headers") or ())
