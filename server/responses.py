"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

A response request is read into the chat request it means (instructions as a system message,
input items as messages, function_call and function_call_output items as tool turns,
text.format as response_format, flat function tools as chat tools) and takes the same path
into the engine (server/generation.py `parse` and `start`); only the answer's shape differs.
Streamed, it is the typed events of the API, each with a rising sequence_number:

    response.created, response.in_progress,
    response.output_item.added, response.content_part.added, response.output_text.delta...,
    response.output_text.done, response.content_part.done, response.output_item.done,
    (for a call: response.output_item.added, response.function_call_arguments.delta...,
     response.function_call_arguments.done, response.output_item.done)
    response.completed | response.incomplete | response.failed

A response is stored when `store` is true (the API's default): kept in memory, the oldest
out first once there are more than `max_count` or they hold more than `max_bytes`
(poot-serve --responses-max-count, --responses-max-bytes). `previous_response_id` continues
the conversation of a stored one: its input and output come before the new input (its
instructions do not, as in OpenAI's API).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from poot.engine.events import Finished, Tokens

from . import openai
from .event_stream import EventStream
from .generation import failure, hang_up_cancels, next_event, parse, read_body, start
from .openai import ApiError, bad
from .response_store import ResponseStore
from .tools import CallReader

ENDPOINT = "/v1/responses"
FIELDS = frozenset({"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "text", "tools",
                    "tool_choice", "parallel_tool_calls", "metadata", "store", "previous_response_id", "stream",
                    "background", "user", "service_tier"})
IGNORED = frozenset({"user", "service_tier"})  # ask nothing of the answer (server/README.md)
ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")
ITEM_TYPES = ("message", "function_call", "function_call_output")
# A chat field named in an error -> the response field the client sent.
FIELD_NAMES = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text",
               "max_completion_tokens": "max_output_tokens"}


# ---- the request --------------------------------------------------------------------------

@dataclass(slots=True)
class Ask:
    """A response request, read: the chat body it means and what the response echoes."""

    chat: dict
    conversation: list[dict]  # the messages before the answer, for a later previous_response_id
    echo: dict  # the request's settings as the response object carries them


def read_request(body: dict, store: ResponseStore) -> Ask:
    unknown = sorted(k for k, v in body.items() if k not in FIELDS and v is not None)
    if unknown:
        raise ApiError(400, f"unsupported field{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)}; this server "
                       "does not implement " + ("them" if len(unknown) > 1 else "it"), unknown[0], "unsupported_parameter")
    if body.get("background"):
        raise ApiError(400, "background responses are not supported: this server answers while the request is open",
                       "background", "unsupported_parameter")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream must be a boolean", "stream")
    keep = body.get("store", True)
    if not isinstance(keep, bool):
        raise bad("store must be a boolean", "store")
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise bad("metadata must be an object of string values", "metadata")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad("instructions must be a string", "instructions")
    earlier: list[dict] = []
    previous = body.get("previous_response_id")
    if previous is not None:
        if not isinstance(previous, str):
            raise bad("previous_response_id must be a string", "previous_response_id")
        kept = store.get(previous)
        if kept is None:
            raise ApiError(404, f"no stored response {previous!r} (unknown, deleted or evicted)", "previous_response_id",
                           "response_not_found")
        earlier = kept.conversation
    if "input" not in body or body["input"] is None:
        raise bad("input is required: a string or a list of input items", "input")
    new = input_messages(body["input"])
    conversation = [*earlier, *new]
    messages = ([{"role": "system", "content": instructions}] if instructions is not None else []) + conversation
    limit = body.get("max_output_tokens")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise bad(f"max_output_tokens must be a positive integer; got {limit!r}", "max_output_tokens")
    chat = {"messages": messages, "stream": stream, "max_tokens": limit, "temperature": body.get("temperature"),
            "top_p": body.get("top_p"), "response_format": text_format(body.get("text")),
            "tools": chat_tools(body.get("tools")), "tool_choice": chat_tool_choice(body.get("tool_choice")),
            "parallel_tool_calls": body.get("parallel_tool_calls"), "model": body.get("model")}
    echo = {"instructions": instructions, "max_output_tokens": limit, "metadata": metadata or {},
            "parallel_tool_calls": body.get("parallel_tool_calls", True), "previous_response_id": previous,
            "store": keep, "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
            "text": body.get("text") or {"format": {"type": "text"}}, "tools": body.get("tools") or [],
            "tool_choice": body.get("tool_choice", "auto")}
    return Ask({k: v for k, v in chat.items() if v is not None}, conversation, echo)


def input_messages(value) -> list[dict]:
    """The input as chat messages: a string is one user message; a list holds message items
    and the tool turns of function_call and function_call_output items."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad("input must be a string or a non-empty list of input items", "input")
    out: list[dict] = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise bad(f"input[{i}] must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            out.append({"role": _role(item, i), "content": _text(item.get("content"), i)})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", i), "type": "function",
                    "function": {"name": _string(item, "name", i), "arguments": _string(item, "arguments", i)}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") and out[-1]["content"] is None:
                out[-1]["tool_calls"].append(call)  # calls of one turn are one assistant message
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                raise bad(f"input[{i}].output must be a string", "input")
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", i), "content": output})
        else:
            raise bad(f"input[{i}].type {kind!r} is not one of {', '.join(ITEM_TYPES)}", "input")
    return out


def _role(item: dict, i: int) -> str:
    role = item.get("role")
    if role not in ROLES:
        raise bad(f"input[{i}].role must be one of {', '.join(ROLES)}; got {role!r}", "input")
    return role


def _text(content, i: int) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"input[{i}].content must be a string or a list of text parts", "input")
    texts = []
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") in TEXT_PARTS and isinstance(part.get("text"), str)):
            raise bad(f"input[{i}].content[{j}] must be a text part ({' or '.join(TEXT_PARTS)} with its text)", "input")
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict, name: str, i: int) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise bad(f"input[{i}].{name} must be a string", "input")
    return value


def text_format(text) -> dict | None:
    """text.format as chat's response_format."""
    if text is None:
        return None
    if not isinstance(text, dict) or not isinstance(text.get("format", {}), dict):
        raise bad('text must be an object like {"format": {"type": "text"}}', "text")
    fmt = text.get("format") or {"type": "text"}
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema"),
                                                        "strict": fmt.get("strict")}}
    raise bad(f"text.format.type must be text, json_object or json_schema; got {kind!r}", "text")


def chat_tools(value) -> list | None:
    """The API's flat function tools as chat's."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise bad("tools must be a list of function tools", "tools")
    out = []
    for i, t in enumerate(value):
        if not isinstance(t, dict) or t.get("type") != "function":
            got = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise bad(f"tools[{i}]: only function tools are supported; got {got!r}", "tools")
        out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters", "strict")
                                                     if t.get(k) is not None}})
    return out


def chat_tool_choice(value):
    if isinstance(value, dict) and value.get("type") == "function" and "name" in value:
        return {"type": "function", "function": {"name": value["name"]}}
    return value


def renamed(e: ApiError) -> ApiError:
    """An error of the chat reading, naming the field the response request sent."""
    body = e.body()["error"]
    param = FIELD_NAMES.get(body["param"], body["param"])
    message = body["message"]
    for chat_name, name in FIELD_NAMES.items():
        message = message.replace(chat_name, name)
    return ApiError(e.status, message, param, body["code"])


# ---- the answer ---------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(slots=True)
class Shape:
    """One response as it is written: its items, and the events that say so when streamed."""

    ask: Ask
    model: str
    rid: str = field(default_factory=lambda: new_id("resp"))
    created: int = field(default_factory=lambda: int(time.time()))
    reader: CallReader | None = None  # where the answer may call tools
    text: list[str] = field(default_factory=list)
    sequence: int = 0
    message_id: str = field(default_factory=lambda: new_id("msg"))
    message_open: bool = False
    calls_open: dict = field(default_factory=dict)  # call index -> (output index, item id)
    final: dict | None = None  # the response, once closed

    def event(self, kind: str, **fields) -> str:
        obj = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def response(self, status: str, output: list, end: Finished | None = None, error: dict | None = None) -> dict:
        usage = None
        if end is not None:
            usage = {"input_tokens": end.prompt_tokens, "output_tokens": end.completion_tokens,
                     "total_tokens": end.prompt_tokens + end.completion_tokens,
                     "input_tokens_details": {"cached_tokens": end.cached_tokens},
                     "output_tokens_details": {"reasoning_tokens": 0}}
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.rid, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": output, "usage": usage, "error": error,
                "incomplete_details": incomplete, **self.ask.echo}

    # -- whole --

    def items(self, text: str, status: str = "completed") -> list[dict]:
        """The output items of a whole answer: its function calls, or one message (incomplete
        where max_output_tokens cut it)."""
        if self.reader is not None:
            reader = CallReader()
            reader.feed(text)
            if reader.mode == "calls" and reader.made_calls:
                return [self.call_item(c.id, c.name, "".join(c.arguments), new_id("fc")) for c in reader.calls]
        return [self.message_item(text, status)]

    def message_item(self, text: str, status: str = "completed") -> dict:
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                "content": [] if status == "in_progress" else [self.text_part(text)]}

    @staticmethod
    def text_part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": []}

    @staticmethod
    def call_item(call_id: str, name: str, arguments: str, item_id: str, status: str = "completed") -> dict:
        return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
                "status": status}

    def finished(self, end: Finished) -> dict:
        text = "".join(self.text) + end.text
        status = "incomplete" if end.reason == "length" else "completed"
        return self.response(status, self.items(text, status), end)

    # -- streamed --

    def opening(self) -> list[str]:
        shell = self.response("in_progress", [])
        return [self.event("response.created", response=shell), self.event("response.in_progress", response=shell)]

    def on_text(self, text: str) -> list[str]:
        """The events of a step's text."""
        self.text.append(text)
        if self.reader is None:
            return self._message_delta(text)
        content, calls = self.reader.feed(text)
        out = self._message_delta(content) if content else []
        for entry in calls:
            out += self._call_delta(entry)
        return out

    def _message_delta(self, text: str) -> list[str]:
        out = []
        if not self.message_open:
            self.message_open = True
            out += [self.event("response.output_item.added", output_index=0,
                               item=self.message_item("", "in_progress")),
                    self.event("response.content_part.added", item_id=self.message_id, output_index=0,
                               content_index=0, part=self.text_part(""))]
        if text:
            out.append(self.event("response.output_text.delta", item_id=self.message_id, output_index=0,
                                  content_index=0, delta=text, logprobs=[]))
        return out

    def _call_delta(self, entry: dict) -> list[str]:
        index = entry["index"]
        if "id" in entry:
            item_id = new_id("fc")
            self.calls_open[index] = (index, item_id)
            item = self.call_item(entry["id"], entry["function"]["name"], "", item_id, "in_progress")
            return [self.event("response.output_item.added", output_index=index, item=item)]
        output_index, item_id = self.calls_open[index]
        return [self.event("response.function_call_arguments.delta", item_id=item_id, output_index=output_index,
                           delta=entry["function"]["arguments"])]

    def closing(self, end: Finished) -> list[str]:
        """The .done events of every item, then response.completed or response.incomplete."""
        out = self.on_text(end.text) if end.text else []
        if self.reader is not None and self.reader.mode == "undecided":
            out += self._message_delta(self.reader.finish())
        final = self.finished(end)
        streamed_calls = self.reader is not None and self.reader.mode == "calls"
        if streamed_calls:
            for index, (output_index, item_id) in self.calls_open.items():
                call = self.reader.calls[index]
                arguments = "".join(call.arguments)
                out += [self.event("response.function_call_arguments.done", item_id=item_id,
                                   output_index=output_index, arguments=arguments),
                        self.event("response.output_item.done", output_index=output_index,
                                   item=self.call_item(call.id, call.name, arguments, item_id))]
            final["output"] = [self.call_item(self.reader.calls[i].id, self.reader.calls[i].name,
                                              "".join(self.reader.calls[i].arguments), item_id)
                               for i, (_, item_id) in self.calls_open.items()]
        else:
            if not self.message_open:
                out += self._message_delta("")
            text = "".join(self.text)
            final["output"] = [self.message_item(text, final["status"])]
            out += [self.event("response.output_text.done", item_id=self.message_id, output_index=0,
                               content_index=0, text=text, logprobs=[]),
                    self.event("response.content_part.done", item_id=self.message_id, output_index=0,
                               content_index=0, part=self.text_part(text)),
                    self.event("response.output_item.done", output_index=0, item=final["output"][0])]
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        out.append(self.event(kind, response=final))
        self.final = final
        return out


def conversation_after(ask: Ask, response: dict) -> list[dict]:
    """The conversation a later previous_response_id continues: the input, then the output."""
    out = list(ask.conversation)
    for item in response["output"]:
        if item["type"] == "message":
            out.append({"role": "assistant", "content": "".join(p["text"] for p in item["content"])})
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
    return out


# ---- the handlers -------------------------------------------------------------------------

async def create(state, request: Request) -> Response:
    engine = state.serving_engine()
    body = openai.parse_body(await read_body(request))
    ask = read_request(body, state.responses)
    try:
        parsed = parse(state, engine, ask.chat, chat=True)
    except ApiError as e:
        raise renamed(e) from None
    try:
        run = await start(state, engine, parsed)
    except ApiError as e:
        raise renamed(e) from None
    shape = Shape(ask, state.model.name, reader=CallReader() if parsed.tools is not None else None)
    queue = run.queues[0]

    def kept(response: dict) -> None:
        if ask.echo["store"] and response["status"] != "failed":
            state.responses.put(response, conversation_after(ask, response))

    if parsed.stream:
        async def events():
            for e in shape.opening():
                yield e
            while True:
                ev = await next_event(queue, engine)
                if isinstance(ev, Tokens):
                    for e in shape.on_text(ev.text):
                        yield e
                elif isinstance(ev, Finished):
                    if ev.reason not in ("stop", "length"):
                        failed = shape.response("failed", [], error={"code": "server_error", "message":
                                                                     ev.error or f"the request ended: {ev.reason}"})
                        yield shape.event("response.failed", response=failed)
                        return
                    for e in shape.closing(ev):
                        yield e
                    kept(shape.final)
                    return

        return EventStream(events(), run.cancel_all)
    async with hang_up_cancels(request, run.cancel_all):
        try:
            while True:
                ev = await next_event(queue, engine)
                if isinstance(ev, Tokens):
                    shape.text.append(ev.text)
                elif isinstance(ev, Finished):
                    break
        except BaseException:
            run.cancel_all()
            raise
    if ev.reason not in ("stop", "length"):
        raise failure(engine, ev)
    response = shape.finished(ev)
    kept(response)
    return JSONResponse(response)


def retrieve(state, rid: str) -> Response:
    kept = state.responses.get(rid)
    if kept is None:
        raise not_found(rid)
    return JSONResponse(kept.response)


def delete(state, rid: str) -> Response:
    if not state.responses.delete(rid):
        raise not_found(rid)
    return JSONResponse({"id": rid, "object": "response", "deleted": True})


def not_found(rid: str) -> ApiError:
    return ApiError(404, f"no stored response {rid!r} (unknown, deleted or evicted)", None, "response_not_found")

