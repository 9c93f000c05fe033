"""tools/*: function tools on chat completions, tool_choice and parallel_tool_calls.

A server that refuses tools with a 4xx naming it does not offer function calling: those clauses
are not supported there. One that takes tools and answers calls the request does not allow, or
in a shape OpenAI's clients cannot read (arguments that are not a JSON string, a call without
an id, a finish_reason other than "tool_calls"), fails.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from poot.conformance.client import Client, Stream
from poot.conformance.documents import CLOCK, WEATHER, WEATHER_ASK
from poot.conformance.outcomes import NotSupported
from poot.conformance.scenarios import (
    arguments_accepted,
    error_param,
    refusal_names,
    refusal_of,
    refused_with_error,
)

clause = pytest.mark.clause

FIELD = "tools"
PATH = "/v1/chat/completions"

# Parameters as small as a useful schema gets (an enum, a boolean): a server that writes the
# tools into the prompt (poot-serve does, in a system message) of a model with a byte-level
# tokenizer and 512 positions must still fit the prompt and MAX_TOKENS. The longest call,
# written out as a block of text, is under 80 bytes, so MAX_TOKENS holds it even at one byte a
# token, and a server that ends "length" here did not end its call.
PARAMETERS = {"weather": WEATHER, "clock": CLOCK}
MAX_TOKENS = 90
ASK = WEATHER_ASK
ONE_CALL = {"parallel_tool_calls": False}  # a small model may otherwise call on until max_tokens
UNKNOWN = "no_such_function"


def tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": PARAMETERS[name]}}


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def chat_body(client: Client, **params: Any) -> dict:
    return {"model": client.model, "messages": [{"role": "user", "content": ASK}], "temperature": 0,
            "max_tokens": MAX_TOKENS, **params}


def tool_body(client: Client, names: tuple[str, ...] = ("weather",), **params: Any) -> dict:
    return chat_body(client, tools=[tool(n) for n in names], **params)


def refused(status: int, text: str, what: str) -> None:
    """Not supported where the server refuses tools by name (not where it names them in refusing
    another field, as in "tool_choice names x, which is not among the tools")."""
    if refusal_names(status, text, FIELD) and error_param(text) in (None, FIELD):
        raise NotSupported(f"the server refuses {FIELD} ({what}) with {status}: {text[:200]}")


def answer(client: Client, body: dict, what: str) -> dict:
    """The 200 answer to a request with tools; not supported where tools are refused."""
    r = client.post(PATH, body)
    refused(r.status_code, r.text, what)
    assert r.status_code == 200, f"{what} answered {r.status_code}: {r.text[:300]}"
    return r.json()


def streamed(client: Client, body: dict, what: str) -> Stream:
    s = client.stream(path=PATH, body={**body, "stream": True})
    refused(s.status, s.body, what)
    assert s.status == 200, f"{what} answered {s.status}: {s.body[:300]}"
    return s


def first_choice(body: dict) -> dict:
    return (body.get("choices") or [{}])[0]


def whole_calls(body: dict, what: str) -> list:
    """The tool calls of a whole answer that must call: a non-empty list, ended "tool_calls"."""
    choice = first_choice(body)
    message, finish = choice.get("message") or {}, choice.get("finish_reason")
    calls = message.get("tool_calls")
    assert isinstance(calls, list) and calls, \
        (f"{what}: the message holds no tool_calls (tool_calls {calls!r}, finish_reason {finish!r}, "
         f"content {str(message.get('content'))[:200]!r})")
    assert finish == "tool_calls", f"{what}: finish_reason is {finish!r}, expected 'tool_calls'"
    return calls


def offered_name(name: Any, offered: tuple[str, ...], where: str) -> None:
    assert isinstance(name, str) and name in offered, \
        f"{where}: function.name is {name!r}, which is not among the tools offered {list(offered)}"


def well_formed(calls: list, offered: tuple[str, ...], what: str) -> None:
    """Each call: its own string id, type "function", an offered name, valid arguments."""
    ids = []
    for i, call in enumerate(calls):
        where = f"{what}: call {i}"
        assert isinstance(call, dict), f"{where} is {call!r}, not an object"
        assert isinstance(call.get("id"), str) and call["id"], f"{where} has no id (id {call.get('id')!r})"
        assert call.get("type") == "function", f"{where} has type {call.get('type')!r}, expected 'function'"
        function = call.get("function")
        assert isinstance(function, dict), f"{where} has no function object: {call!r}"
        offered_name(function.get("name"), offered, where)
        arguments_accepted(function.get("arguments"), PARAMETERS[function["name"]], function["name"], where,
                           "function.arguments")
        ids.append(call["id"])
    assert len(set(ids)) == len(ids), f"{what}: calls share ids: {ids}"


# What a 200 to a request that must be refused means.
SERVED = "the request was served without the choice"


@clause("tools/required/1")
def test_required_answers_well_formed_calls(client: Client):
    what = 'a chat with tool_choice "required"'
    body = answer(client, tool_body(client, tool_choice="required", **ONE_CALL), what)
    well_formed(whole_calls(body, what), ("weather",), what)


@clause("tools/named/1")
def test_named_choice_calls_that_function_only(client: Client):
    what = "a chat whose tool_choice names clock"
    body = answer(client, tool_body(client, ("weather", "clock"), tool_choice=named("clock"), **ONE_CALL), what)
    calls = whole_calls(body, what)
    for i, call in enumerate(calls):
        name = (call.get("function") or {}).get("name") if isinstance(call, dict) else None
        assert name == "clock", f"{what}: call {i} calls {name!r}, but tool_choice named 'clock'"
    well_formed(calls, ("clock",), what)


def gathered_calls(s: Stream, what: str) -> dict[int, dict]:
    """The streamed calls by index: each call's id and name from its first delta entry, and its
    arguments joined from every entry."""
    calls: dict[int, dict] = {}
    for chunk in s.chunks:
        for choice in chunk.get("choices") or []:
            for entry in (choice.get("delta") or {}).get("tool_calls") or []:
                read_entry(calls, entry, what)
    return calls


def read_entry(calls: dict[int, dict], entry: Any, what: str) -> None:
    assert isinstance(entry, dict), f"{what}: a tool_calls delta entry is {entry!r}, not an object"
    index = entry.get("index")
    assert isinstance(index, int), f"{what}: a tool_calls delta entry has no index: {entry!r}"
    function = entry.get("function") or {}
    if index not in calls:
        where = f"{what}: the first delta of call {index}"
        assert isinstance(entry.get("id"), str) and entry["id"], f"{where} has no id: {entry!r}"
        assert entry.get("type") == "function", f"{where} has type {entry.get('type')!r}, expected 'function'"
        assert isinstance(function.get("name"), str) and function["name"], f"{where} has no function.name: {entry!r}"
        calls[index] = {"id": entry["id"], "name": function["name"], "arguments": ""}
    else:
        call, where = calls[index], f"{what}: a later delta of call {index}"
        assert entry.get("id") in (None, call["id"]), \
            f"{where} carries a new id {entry['id']!r} (its first delta's was {call['id']!r})"
        assert function.get("name") in (None, call["name"]), \
            f"{where} renames it {function['name']!r} (its first delta named {call['name']!r})"
    piece = function.get("arguments")
    if piece is not None:
        assert isinstance(piece, str), f"{what}: an arguments piece of call {index} is {piece!r}, not a string"
        calls[index]["arguments"] += piece


def finish_reasons(s: Stream) -> list:
    return [c.get("finish_reason") for chunk in s.chunks for c in chunk.get("choices") or []
            if c.get("finish_reason") is not None]


@clause("tools/stream/1")
def test_streamed_calls_are_indexed_deltas(client: Client):
    what = 'a streamed chat with tool_choice "required"'
    s = streamed(client, tool_body(client, tool_choice="required", **ONE_CALL), what)
    calls = gathered_calls(s, what)
    reasons = finish_reasons(s)
    assert calls, f"{what}: no chunk carried tool_calls (finish_reasons {reasons}, content {s.text[:200]!r})"
    assert sorted(calls) == list(range(len(calls))), f"{what}: call indices are {sorted(calls)}, expected 0 to " \
                                                     f"{len(calls) - 1}"
    for index, call in sorted(calls.items()):
        where = f"{what}: call {index} (its pieces joined)"
        offered_name(call["name"], ("weather",), where)
        arguments_accepted(call["arguments"], PARAMETERS[call["name"]], call["name"], where, "function.arguments")
    ids = [c["id"] for c in calls.values()]
    assert len(set(ids)) == len(ids), f"{what}: calls share ids: {ids}"
    assert len(reasons) == 1, f"{what}: the stream sent finish_reason {len(reasons)} times: {reasons}"
    assert reasons[0] == "tool_calls", f"{what}: finish_reason is {reasons[0]!r}, expected 'tool_calls'"
    assert s.done, f"{what}: the stream did not end with 'data: [DONE]'"


@clause("tools/parallel/1")
def test_no_parallel_calls_means_one_call(client: Client):
    what = 'a chat with tool_choice "required" and parallel_tool_calls false'
    body = answer(client, tool_body(client, tool_choice="required", **ONE_CALL), what)
    message = first_choice(body).get("message") or {}
    calls = message.get("tool_calls")
    assert isinstance(calls, list) and calls, \
        (f"{what}: the message holds no tool_calls (finish_reason {first_choice(body).get('finish_reason')!r}, "
         f"content {str(message.get('content'))[:200]!r})")
    assert len(calls) == 1, f"{what}: {len(calls)} tool calls, expected one: {json.dumps(calls)[:300]}"


CALL_ID = "call_weather_oslo"
EARLIER_TURNS = [
    {"role": "user", "content": ASK},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": CALL_ID, "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": CALL_ID, "content": '{"celsius": 4, "sky": "snow"}'},
]


@clause("tools/result/1")
def test_turn_after_a_call_and_its_result_is_answered(client: Client):
    what = "a chat carrying a tool call and its result"
    body = answer(client, {**tool_body(client, tool_choice="none", max_tokens=16), "messages": EARLIER_TURNS}, what)
    choice = first_choice(body)
    message = choice.get("message") or {}
    assert message.get("role") == "assistant", f"{what}: the message's role is {message.get('role')!r}"
    assert isinstance(message.get("content"), str), \
        f"{what} with tool_choice none: the message's content is {message.get('content')!r}, not a string"
    assert choice.get("finish_reason") in ("stop", "length"), \
        f"{what}: finish_reason is {choice.get('finish_reason')!r}, expected 'stop' or 'length'"


def unservable_choices(client: Client) -> dict[str, dict]:
    return {f"a tool_choice naming {UNKNOWN}, not among the tools":
            tool_body(client, tool_choice=named(UNKNOWN), max_tokens=16),
            'tool_choice "required" with no tools': chat_body(client, tool_choice="required", max_tokens=16)}


@clause("tools/invalid/1")
def test_unservable_tool_choice_is_refused(client: Client):
    answer(client, tool_body(client, tool_choice="required", max_tokens=1, **ONE_CALL),
           'a chat with tool_choice "required"')  # the server takes tools at all
    for what, body in unservable_choices(client).items():
        for stream, how in ((False, what), (True, what + ", streamed")):
            refused_with_error(*refusal_of(client, PATH, body, stream, how), how, SERVED)


@clause("tools/auto/1")
def test_auto_answers_text_or_calls(client: Client):
    what = 'a chat with tool_choice "auto"'
    body = answer(client, tool_body(client, tool_choice="auto", **ONE_CALL), what)
    choice = first_choice(body)
    message, finish = choice.get("message") or {}, choice.get("finish_reason")
    if message.get("tool_calls"):
        well_formed(whole_calls(body, what), ("weather",), what)
        return
    assert finish != "tool_calls", f"{what}: finish_reason is 'tool_calls' but the message holds no tool_calls: " \
                                   f"{json.dumps(message)[:300]}"
    assert isinstance(message.get("content"), str), \
        f"{what}: the message holds neither tool_calls nor string content: {json.dumps(message)[:300]}"
    assert finish in ("stop", "length"), f"{what}: a text answer ended with finish_reason {finish!r}"
