"""Defects of the Responses API (POST /v1/responses): ASGI middleware around the unchanged app
that edits the request body before the app reads it, the whole answer after it wrote it, or
each streamed event (`event: TYPE` and `data: {...}`, with state kept per stream). Each class
takes (app, state), as the registry's middleware parts do; only /v1/responses is touched."""

from __future__ import annotations

import json

from .http_parts import Middleware, _error, _json_body, read_request, replay

ENDPOINT = "/v1/responses"
PREVIOUS = "previous_response_id"


def sse_event(data: dict) -> str:
    return f"event: {data.get('type')}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


def event_data(event: str) -> dict | None:
    for line in event.split("\n"):
        if line.startswith("data:"):
            try:
                data = json.loads(line[len("data:"):])
            except ValueError:
                return None
            return data if isinstance(data, dict) else None
    return None


class ResponsesEdit(Middleware):
    """The hooks a defect overrides, each a no-op here: `request` (the parsed body, returning
    the body the app reads, or the name of a field to refuse it for with a 400), `answer` (a
    whole JSON answer and its status), `event` (one streamed event's data, returning the events
    sent in its place; `stream` is this response's own state)."""

    async def handle(self, scope, receive, send):
        if scope["method"] != "POST" or scope["path"] != ENDPOINT:
            return await self.app(scope, receive, send)
        raw, messages = await read_request(receive)
        body = _json_body(raw)
        if body:
            edited = self.request(body)
            if isinstance(edited, str):
                return await refuse(send, edited)
            messages = [{"type": "http.request", "body": json.dumps(edited).encode(), "more_body": False},
                        *messages[len([m for m in messages if m["type"] == "http.request"]):]]
        await self.app(scope, replay(messages, receive), self.editing_send(scope, send))

    def edit_json(self, scope, status, body):
        if scope["path"] == ENDPOINT and isinstance(body, dict):
            status, body = self.answer(status, body)
        return status, body, b"application/json"

    def edit_event(self, scope, event, stream):
        data = event_data(event)
        if data is None:
            return [event]
        return [sse_event(d) for d in self.event(data, stream)]

    def request(self, body: dict) -> dict | str:
        return body

    def answer(self, status: int, body: dict) -> tuple[int, dict]:
        return status, body

    def event(self, data: dict, stream: dict) -> list[dict]:
        return [data]


async def refuse(send, field: str, status: int = 400) -> None:
    payload = json.dumps(_error(status, f"{field} is not supported", param=field)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


def responses_in(data: dict) -> list[dict]:
    """The response objects a whole answer or an event carries."""
    if data.get("object") == "response":
        return [data]
    inner = data.get("response")
    return [inner] if isinstance(inner, dict) else []


class _EveryResponse(ResponsesEdit):
    """A defect of the response object itself, whole or carried by an event."""

    def answer(self, status, body):
        for response in responses_in(body):
            self.change(response)
        return status, body

    def event(self, data, stream):
        for response in responses_in(data):
            self.change(response)
        return [data]

    def change(self, response: dict) -> None:
        raise NotImplementedError


class TotalWithoutInput(_EveryResponse):
    """usage.total_tokens leaves out the input tokens."""

    def change(self, response):
        usage = response.get("usage")
        if isinstance(usage, dict):
            usage["total_tokens"] = usage["output_tokens"]


class OutputTokensOffByOne(_EveryResponse):
    """usage counts one output token more than were written (total_tokens too, so it adds up)."""

    def change(self, response):
        usage = response.get("usage")
        if isinstance(usage, dict):
            usage["output_tokens"] += 1
            usage["total_tokens"] += 1


class IncompleteReportedCompleted(_EveryResponse):
    """A response cut by max_output_tokens says "completed", as a whole one does."""

    def change(self, response):
        if response.get("status") == "incomplete":
            response["status"], response["incomplete_details"] = "completed", None
            for item in response.get("output") or []:
                if item.get("status") == "incomplete":
                    item["status"] = "completed"

    def event(self, data, stream):
        if data.get("type") == "response.incomplete":
            data["type"] = "response.completed"
        return super().event(data, stream)


class CallArgumentsAsObject(ResponsesEdit):
    """A function_call item's arguments are sent as a JSON object, not a string."""

    def answer(self, status, body):
        for item in body.get("output") or []:
            if item.get("type") == "function_call" and isinstance(item.get("arguments"), str):
                item["arguments"] = json.loads(item["arguments"])
        return status, body


class SequenceNumbersDoubled(ResponsesEdit):
    """Each event's sequence_number is twice what it should be: every other number is skipped."""

    def event(self, data, stream):
        if isinstance(data.get("sequence_number"), int):
            data["sequence_number"] *= 2
        return [data]


class StreamDropsADelta(ResponsesEdit):
    """The first output_text delta of a stream is never sent (the numbering closes over it)."""

    def event(self, data, stream):
        if data.get("type") == "response.output_text.delta" and not stream.get("dropped"):
            stream["dropped"] = True
            return []
        if stream.get("dropped") and isinstance(data.get("sequence_number"), int):
            data["sequence_number"] -= 1
        return [data]


class StreamItemIdChanges(ResponsesEdit):
    """Every output_text delta after the first carries an item_id of its own."""

    def event(self, data, stream):
        if data.get("type") == "response.output_text.delta":
            stream["deltas"] = stream.get("deltas", 0) + 1
            if stream["deltas"] > 1:
                data["item_id"] = f"{data.get('item_id')}_{stream['deltas']}"
        return [data]


class InstructionsDropped(ResponsesEdit):
    def request(self, body):
        body.pop("instructions", None)
        return body


class PreviousResponseIgnored(ResponsesEdit):
    """A previous_response_id naming a stored response is dropped: the conversation starts anew
    (an unknown one is still refused)."""

    def request(self, body):
        if isinstance(body.get(PREVIOUS), str) and self.state.responses.get(body[PREVIOUS]) is not None:
            body.pop(PREVIOUS)
        return body


class UnknownPreviousAnswered(ResponsesEdit):
    """A previous_response_id naming no stored response is dropped instead of refused."""

    def request(self, body):
        if isinstance(body.get(PREVIOUS), str) and self.state.responses.get(body[PREVIOUS]) is None:
            body.pop(PREVIOUS)
        return body


class CallOutputRefused(ResponsesEdit):
    """An input holding a function_call_output item is refused with a 400 naming input."""

    def request(self, body):
        items = body.get("input")
        if isinstance(items, list) and any(isinstance(i, dict) and i.get("type") == "function_call_output"
                                           for i in items):
            return "input"
        return body


class TextFormatDropped(ResponsesEdit):
    def request(self, body):
        body.pop("text", None)
        return body


class BadInput500(ResponsesEdit):
    """A request refused for its input or max_output_tokens gets a 500 instead of a 400."""

    def answer(self, status, body):
        error = body.get("error")
        if status == 400 and isinstance(error, dict) and error.get("param") in ("input", "max_output_tokens"):
            return 500, _error(500, f"internal error while reading the request: {error.get('message')}")
        return status, body


class NoResponsesEndpoint(Middleware):
    """Not a defect: a server without the Responses API, whose /v1/responses paths answer 404
    as any path it does not serve."""

    async def handle(self, scope, receive, send):
        if scope["path"] == ENDPOINT or scope["path"].startswith(ENDPOINT + "/"):
            payload = json.dumps(_error(404, f"no route {scope['path']}")).encode()
            await send({"type": "http.response.start", "status": 404,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(payload)).encode())]})
            await send({"type": "http.response.body", "body": payload})
            return
        await self.app(scope, receive, self.editing_send(scope, send))
