"""responses/*: OpenAI's Responses API, POST /v1/responses.

A server without the endpoint (POST /v1/responses answers 404) does not offer the API: every
clause is not supported there, never failed. A server that refuses function tools or
text.format with a 4xx naming them is not supported for those clauses. One that serves the
endpoint and answers in a shape OpenAI's clients cannot read, calls a cut answer complete, or
loses the conversation of a previous_response_id, fails.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

import jsonschema
import pytest

from poot.conformance.client import Client, RawRequest, ServerError, Stream
from poot.conformance.documents import ANIMAL, ANIMAL_ASK, WEATHER, WEATHER_ASK
from poot.conformance.outcomes import NotSupported
from poot.conformance.scenarios import (
    Probes,
    arguments_accepted,
    error_param,
    refusal_names,
    refusal_of,
    refused_with_error,
)

clause = pytest.mark.clause

PATH = "/v1/responses"
NO_ENDPOINT = f"{PATH} answered 404: the server has no Responses API"
PREVIOUS = "previous_response_id"
SHORT_INPUT = "Say hello to the reader."
# Greedy answers that run long on the models the suite meets; the first that writes more than
# CUT + 1 tokens is taken where a clause needs an answer cut by max_output_tokens.
LONG_INPUTS = ("Write a long story about a dragon who learns to sing.",
               "Count from one to one hundred in words, one number per line.",
               "List every month of the year, then every day of the week, twice.",
               "Describe the ocean, the sky and the forest, each in ten sentences.")
CUT = 16  # the least max_output_tokens OpenAI takes
LONGER = 48


def request(client: Client, given: Any, **params: Any) -> dict:
    return {"model": client.model, "input": given, "temperature": 0, **params}


def missing_endpoint(status: int | None, body: dict) -> None:
    """A 404 to a request that names no stored response says the endpoint is not there."""
    if status == 404 and PREVIOUS not in body:
        raise NotSupported(NO_ENDPOINT)


def answer(client: Client, body: dict, what: str) -> dict:
    """The 200 answer to a blocking request."""
    r = client.post(PATH, body)
    missing_endpoint(r.status_code, body)
    assert r.status_code == 200, f"{what} answered {r.status_code}: {r.text[:300]}"
    out = r.json()
    assert isinstance(out, dict), f"{what} answered {r.text[:300]!r}, not a JSON object"
    return out


def streamed(client: Client, body: dict, what: str) -> Stream:
    s = client.stream(path=PATH, body={**body, "stream": True})
    missing_endpoint(s.status, body)
    assert s.status == 200, f"{what} answered {s.status}: {s.body[:300]}"
    return s


# ---- reading a response ----------------------------------------------------------------------

def usage_of(response: dict, what: str) -> dict[str, int]:
    usage = response.get("usage")
    assert isinstance(usage, dict), f"{what}: the response has no usage object (usage {usage!r})"
    counts = {k: usage.get(k) for k in ("input_tokens", "output_tokens", "total_tokens")}
    bad = {k: v for k, v in counts.items() if isinstance(v, bool) or not isinstance(v, int)}
    assert not bad, f"{what}: usage fields are not integers: {bad} (usage {json.dumps(usage)[:200]})"
    return counts


def items_of(response: dict, kind: str) -> list[dict]:
    return [item for item in response.get("output") or [] if isinstance(item, dict) and item.get("type") == kind]


def output_types(response: dict) -> list:
    return [item.get("type") if isinstance(item, dict) else item for item in response.get("output") or []]


def message_text(response: dict, what: str) -> str:
    """The text of the response's assistant message: its output_text parts joined."""
    messages = items_of(response, "message")
    assert messages, f"{what}: the output holds no message item (output types {output_types(response)})"
    message = messages[0]
    assert message.get("role") == "assistant", f"{what}: the message's role is {message.get('role')!r}"
    content = message.get("content")
    assert isinstance(content, list), f"{what}: the message's content is {content!r}, not a list of parts"
    parts = [p for p in content if isinstance(p, dict) and p.get("type") == "output_text"]
    assert parts, f"{what}: the message holds no output_text part: {json.dumps(content)[:300]}"
    texts = [p.get("text") for p in parts]
    assert all(isinstance(t, str) for t in texts), f"{what}: an output_text part's text is not a string: {texts!r}"
    return "".join(texts)


def incomplete_for_length(response: dict, what: str, why: str) -> None:
    status, details = response.get("status"), response.get("incomplete_details")
    assert status == "incomplete", f"{what}: status {status!r}, expected 'incomplete' ({why})"
    reason = details.get("reason") if isinstance(details, dict) else None
    assert reason == "max_output_tokens", \
        f"{what}: incomplete_details is {details!r}, expected reason 'max_output_tokens' ({why})"


# ---- reading a stream ------------------------------------------------------------------------

MESSAGE_EVENTS = ("response.output_item.added", "response.content_part.added", "response.output_text.delta",
                  "response.output_text.done", "response.content_part.done", "response.output_item.done")
ENDINGS = ("response.completed", "response.incomplete")
ENDINGS_STATUS = ("completed", "incomplete")
# The events a plain text answer is made of; others (reasoning, annotations) are extensions of
# the API and are left out of the order, though not out of the numbering.
KNOWN = ("response.created", "response.in_progress", *MESSAGE_EVENTS, *ENDINGS, "response.failed", "error")


def events_of(s: Stream, what: str) -> list[tuple[str | None, dict]]:
    """Each event's name (its `event:` line, None where it has none) and its data."""
    out: list[tuple[str | None, dict]] = []
    name = None
    for line in s.lines:
        if line.startswith("event:"):
            name = line[len("event:"):].strip()
        elif line.startswith("data:"):
            payload = line[len("data:"):].strip()
            if payload == "[DONE]":
                continue
            try:
                data = json.loads(payload)
            except ValueError:
                raise AssertionError(f"{what}: a data line is not JSON: {payload[:200]!r}") from None
            assert isinstance(data, dict), f"{what}: an event's data is {payload[:200]!r}, not an object"
            out.append((name, data))
            name = None
    assert out, f"{what}: the stream sent no event: {' | '.join(s.lines)[:300]!r}"
    return out


def final_response(events: list[tuple[str | None, dict]], what: str) -> tuple[str, dict]:
    """The last event's type and the response it carries."""
    kind, response = events[-1][1].get("type"), events[-1][1].get("response")
    assert kind in ENDINGS, f"{what}: the last event is {kind!r}, expected one of {list(ENDINGS)}"
    assert isinstance(response, dict), f"{what}: {kind} carries no response object"
    return kind, response


def expected_order(kinds: list[str]) -> list[str]:
    deltas = kinds.count("response.output_text.delta")
    return ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
            *["response.output_text.delta"] * deltas, "response.output_text.done", "response.content_part.done",
            "response.output_item.done", kinds[-1] if kinds and kinds[-1] in ENDINGS else "response.completed"]


def check_order(events: list[tuple[str | None, dict]], what: str) -> None:
    kinds = [data.get("type") for _, data in events if data.get("type") in KNOWN]
    expected = expected_order(kinds)
    for i, (got, want) in enumerate(zip(kinds, expected, strict=False)):
        assert got == want, f"{what}: event {i} of the answer is {got!r}, expected {want!r} (events {kinds})"
    assert len(kinds) == len(expected), f"{what}: the events are {kinds}, expected {expected}"


def check_numbering(events: list[tuple[str | None, dict]], what: str) -> None:
    for i, (name, data) in enumerate(events):
        assert name is None or name == data.get("type"), \
            f"{what}: event {i} is named {name!r} but its data has type {data.get('type')!r}"
        number = data.get("sequence_number")
        assert number == i, f"{what}: event {i} ({data.get('type')}) has sequence_number {number!r}, expected {i}"


def check_item_ids(events: list[tuple[str | None, dict]], final: dict, what: str) -> None:
    """Every event of the message carries the id output_item.added opened, the final message's."""
    opened = next(data.get("item") for _, data in events if data.get("type") == "response.output_item.added")
    item_id = opened.get("id") if isinstance(opened, dict) else None
    assert isinstance(item_id, str) and item_id, f"{what}: output_item.added opened an item with no id: {opened!r}"
    for i, (_, data) in enumerate(events):
        kind = data.get("type")
        if kind not in MESSAGE_EVENTS:
            continue
        got = (data.get("item") or {}).get("id") if kind.startswith("response.output_item.") else data.get("item_id")
        assert got == item_id, f"{what}: event {i} ({kind}) has item_id {got!r}, but the message opened as {item_id!r}"
    ids = [m.get("id") for m in items_of(final, "message")]
    assert ids == [item_id], f"{what}: the final response's message ids are {ids}, expected [{item_id!r}]"


def check_text(events: list[tuple[str | None, dict]], final: dict, what: str) -> None:
    deltas = [data.get("delta") for _, data in events if data.get("type") == "response.output_text.delta"]
    assert all(isinstance(d, str) for d in deltas), f"{what}: a delta is not a string: {deltas!r}"
    joined = "".join(deltas)
    done = next(data.get("text") for _, data in events if data.get("type") == "response.output_text.done")
    assert joined == done, f"{what}: the deltas joined {joined[:200]!r} != output_text.done's text {str(done)[:200]!r}"
    text = message_text(final, f"{what}: the final response")
    assert joined == text, f"{what}: the deltas joined {joined[:200]!r} != the final response's text {text[:200]!r}"


# ---- cases ------------------------------------------------------------------------------------

def cut_request(client: Client, what: str) -> tuple[dict, int]:
    """A request with max_output_tokens CUT that is surely cut: the same greedy request with
    LONGER wrote more than CUT + 1 tokens (one more, so a count off by one cannot fake it).
    Returns the request and that longer count."""
    for text in LONG_INPUTS:
        longer = answer(client, request(client, text, max_output_tokens=LONGER), what)
        written = usage_of(longer, f"{what} (max_output_tokens {LONGER})")["output_tokens"]
        if written > CUT + 1:
            return request(client, text, max_output_tokens=CUT), written
    raise NotSupported(f"none of {len(LONG_INPUTS)} inputs made the model write more than {CUT + 1} tokens, so "
                       f"none is surely cut at max_output_tokens {CUT}")


@clause("responses/object/1")
def test_blocking_response_is_a_response_object(client: Client):
    what = "a blocking response"
    response = answer(client, request(client, SHORT_INPUT, max_output_tokens=CUT), what)
    assert isinstance(response.get("id"), str) and response["id"], f"{what}: id is {response.get('id')!r}"
    assert response.get("object") == "response", f"{what}: object is {response.get('object')!r}, expected 'response'"
    assert response.get("status") in ENDINGS_STATUS, \
        f"{what}: status is {response.get('status')!r}, expected one of {list(ENDINGS_STATUS)}"
    message_text(response, what)
    counts = usage_of(response, what)
    assert counts["total_tokens"] == counts["input_tokens"] + counts["output_tokens"], \
        (f"{what}: usage.total_tokens {counts['total_tokens']} != input_tokens {counts['input_tokens']} + "
         f"output_tokens {counts['output_tokens']}")
    assert counts["input_tokens"] > 0, f"{what}: usage.input_tokens is {counts['input_tokens']}"


@clause("responses/stream/1")
def test_streamed_events_are_ordered_numbered_and_add_up(client: Client):
    what = "a streamed response"
    events = events_of(streamed(client, request(client, SHORT_INPUT, max_output_tokens=24), what), what)
    check_numbering(events, what)
    check_order(events, what)
    _, final = final_response(events, what)
    created = next(data for _, data in events if data.get("type") == "response.created").get("response") or {}
    assert final.get("id") == created.get("id"), \
        f"{what}: response.created announced id {created.get('id')!r}, the final response has {final.get('id')!r}"
    check_item_ids(events, final, what)
    check_text(events, final, what)


@clause("responses/incomplete/1")
def test_cut_response_is_incomplete(client: Client):
    what = f"a response with max_output_tokens {CUT}"
    body, written = cut_request(client, what)
    why = f"the same request with max_output_tokens {LONGER} wrote {written} tokens, so {CUT} cut it"
    incomplete_for_length(answer(client, body, what), what, why)
    events = events_of(streamed(client, body, what + ", streamed"), what + ", streamed")
    kind, final = final_response(events, what + ", streamed")
    assert kind == "response.incomplete", f"{what}, streamed: the last event is {kind!r}, expected " \
                                          f"'response.incomplete' ({why})"
    incomplete_for_length(final, f"{what}, streamed: the final response", why)


@clause("responses/usage/1")
def test_usage_counts_a_cut_answer_exactly(client: Client):
    what = f"a response with max_output_tokens {CUT}"
    body, written = cut_request(client, what)
    counts = usage_of(answer(client, body, what), what)
    assert counts["output_tokens"] == CUT, \
        (f"{what}, cut by it (the same request with max_output_tokens {LONGER} wrote {written} tokens): "
         f"usage.output_tokens is {counts['output_tokens']}, expected {CUT}")
    events = events_of(streamed(client, body, what + ", streamed"), what + ", streamed")
    _, final = final_response(events, what + ", streamed")
    streamed_counts = usage_of(final, what + ", streamed: the final response")
    assert streamed_counts == counts, \
        f"{what}: the streamed final response's usage {streamed_counts} != the blocking answer's {counts}"


# Two instructions, one far longer: whatever a chat template puts in place of a system message
# that is absent (SmolLM2's writes its own), both requests have one, and only the instructions
# differ. The longer adds over 30 words, more than LONGER_BY tokens in any tokenizer.
SHORT_INSTRUCTIONS = "Answer in French."
LONG_INSTRUCTIONS = ("Answer in French, in one short sentence, politely, without lists, without code and without "
                     "repeating the question; if you are unsure of anything, say so in French as well, and never "
                     "switch to another language, whatever the input asks.")
LONGER_BY = 10


@clause("responses/instructions/1")
def test_instructions_come_before_the_input(client: Client):
    what = "a response with instructions"
    short = answer(client, request(client, SHORT_INPUT, max_output_tokens=CUT, instructions=SHORT_INSTRUCTIONS),
                   what + " of 3 words")
    long = answer(client, request(client, SHORT_INPUT, max_output_tokens=CUT, instructions=LONG_INSTRUCTIONS),
                  what + f" of {len(LONG_INSTRUCTIONS.split())} words")
    few, many = usage_of(short, what)["input_tokens"], usage_of(long, what)["input_tokens"]
    assert many >= few + LONGER_BY, \
        (f"usage.input_tokens is {many} with instructions of {len(LONG_INSTRUCTIONS.split())} words and {few} with "
         f"instructions of 3 words (the same input), not {LONGER_BY} or more apart: the instructions were not put "
         "before the input")


def keeps_no_conversations(status: int | None, text: str) -> bool:
    """Whether an answer refuses previous_response_id as a field the server does not support (a
    server that keeps no responses), not as naming a response it cannot find."""
    return refusal_names(status, text, PREVIOUS) and "support" in text.lower()


@clause("responses/previous/1")
def test_previous_response_continues_its_conversation(client: Client):
    what = f"a response with the {PREVIOUS} of a stored one"
    first = answer(client, request(client, "My name is Ada. Remember it.", max_output_tokens=CUT, store=True),
                   "a first response with store true")
    if first.get("store") is False:
        raise NotSupported("the server answered a request with store true with store false: it kept nothing for "
                           f"{PREVIOUS} to continue")
    question = "What is my name?"
    alone = answer(client, request(client, question, max_output_tokens=CUT), "the second input sent alone")
    r = client.post(PATH, request(client, question, max_output_tokens=CUT, previous_response_id=first["id"]))
    if keeps_no_conversations(r.status_code, r.text):
        raise NotSupported(f"the server refuses {PREVIOUS} with {r.status_code}: {r.text[:200]}")
    assert r.status_code == 200, f"{what} answered {r.status_code}: {r.text[:300]}"
    first_in, alone_in = usage_of(first, what)["input_tokens"], usage_of(alone, what)["input_tokens"]
    follow_in = usage_of(r.json(), what)["input_tokens"]
    assert follow_in > alone_in, \
        (f"{what}: usage.input_tokens {follow_in}, no more than the new input alone ({alone_in}): the earlier "
         "conversation was not put before it")
    assert follow_in > first_in, \
        f"{what}: usage.input_tokens {follow_in}, no more than the first response's ({first_in})"


@clause("responses/previous/2")
def test_unknown_previous_response_is_refused(client: Client):
    answer(client, request(client, SHORT_INPUT, max_output_tokens=CUT), "a plain response")  # the endpoint exists
    unknown = "resp_" + secrets.token_hex(16)
    body = request(client, SHORT_INPUT, max_output_tokens=CUT, previous_response_id=unknown)
    what = f"a response whose {PREVIOUS} {unknown} names no stored response"
    for stream, how in ((False, what), (True, what + ", streamed")):
        refused_with_error(*refusal_of(client, PATH, body, stream, how), how,
                           "answered as if the conversation were new")


# ---- function tools ---------------------------------------------------------------------------

TOOLS = "tools"
WEATHER_TOOL = {"type": "function", "name": "weather", "description": "The weather in a city", "parameters": WEATHER}
ASK = WEATHER_ASK
CALL_TOKENS = 90  # the longest call, written out, is under 80 bytes (see test_tools.py)
RESULT = '{"celsius": 4, "sky": "snow"}'


def tools_refused(status: int, text: str, what: str) -> None:
    """Not supported where the server refuses tools by name."""
    if refusal_names(status, text, TOOLS) and error_param(text) in (None, TOOLS):
        raise NotSupported(f"the server refuses {TOOLS} ({what}) with {status}: {text[:200]}")


def with_tools(client: Client, body: dict, what: str) -> dict:
    r = client.post(PATH, body)
    missing_endpoint(r.status_code, body)
    tools_refused(r.status_code, r.text, what)
    assert r.status_code == 200, f"{what} answered {r.status_code}: {r.text[:300]}"
    return r.json()


def call_request(client: Client) -> dict:
    return request(client, ASK, tools=[WEATHER_TOOL], tool_choice="required", parallel_tool_calls=False,
                   max_output_tokens=CALL_TOKENS)


def function_calls(response: dict, what: str) -> list[dict]:
    calls = items_of(response, "function_call")
    assert calls, (f"{what}: the output holds no function_call item (output types {output_types(response)}, "
                   f"status {response.get('status')!r})")
    for i, call in enumerate(calls):
        where = f"{what}: function_call {i}"
        assert isinstance(call.get("call_id"), str) and call["call_id"], f"{where} has no call_id: {call!r}"
        assert call.get("name") == "weather", f"{where} calls {call.get('name')!r}, not among the tools ['weather']"
        arguments_accepted(call.get("arguments"), WEATHER, "weather", where)
    return calls


@clause("responses/tools/1")
def test_required_tool_choice_answers_a_function_call(client: Client):
    what = 'a response with tool_choice "required"'
    function_calls(with_tools(client, call_request(client), what), what)


def output_turn(client: Client, first: dict, call: dict, what: str) -> dict:
    """The answer to the turn after a call: its output, by previous_response_id where the first
    response was stored, else (the server keeps no responses) with the call itself as input
    items."""
    output = {"type": "function_call_output", "call_id": call["call_id"], "output": RESULT}
    rest = {"tools": [WEATHER_TOOL], "tool_choice": "none", "max_output_tokens": CUT}
    if first.get("store") is not False:
        body = request(client, [output], previous_response_id=first["id"], **rest)
        r = client.post(PATH, body)
        if not keeps_no_conversations(r.status_code, r.text):
            tools_refused(r.status_code, r.text, what)
            assert r.status_code == 200, f"{what} (with {PREVIOUS}) answered {r.status_code}: {r.text[:300]}"
            return r.json()
    earlier = [{"type": "message", "role": "user", "content": ASK},
               {"type": "function_call", "call_id": call["call_id"], "name": call["name"],
                "arguments": call["arguments"]}]
    return with_tools(client, request(client, [*earlier, output], **rest), what + " (the call sent as input)")


@clause("responses/tools/2")
def test_function_call_output_turn_is_answered(client: Client):
    first_what = 'a response with tool_choice "required"'
    first = with_tools(client, call_request(client), first_what)
    call = function_calls(first, first_what)[0]
    what = "a response whose input is the function_call_output of that call"
    message_text(output_turn(client, first, call, what), what)


# ---- text.format ------------------------------------------------------------------------------

# As structured/*: every document is short whatever the model picks (about 130 bytes at most).
FORMAT = {"format": {"type": "json_schema", "name": "animal", "schema": ANIMAL, "strict": True}}


def format_refused(status: int, text: str, what: str) -> None:
    """Not supported where the server refuses text.format by name."""
    if refusal_names(status, text, "text") and (error_param(text) in ("text", "text.format") or "text.format" in text):
        raise NotSupported(f"the server refuses text.format ({what}) with {status}: {text[:200]}")


@clause("responses/json-schema/1")
def test_json_schema_format_answer_validates(client: Client):
    what = "a response with text.format json_schema"
    body = request(client, ANIMAL_ASK, text=FORMAT, max_output_tokens=256)
    r = client.post(PATH, body)
    missing_endpoint(r.status_code, body)
    format_refused(r.status_code, r.text, what)
    assert r.status_code == 200, f"{what} answered {r.status_code}: {r.text[:300]}"
    response = r.json()
    text = message_text(response, what)
    try:
        document = json.loads(text)
    except ValueError as e:
        raise AssertionError(f"{what}: the output text is not JSON ({e}); status {response.get('status')!r}: "
                             f"{text[:300]!r}") from None
    try:
        jsonschema.validate(document, ANIMAL)
    except jsonschema.ValidationError as e:
        raise AssertionError(f"{what}: the output text does not validate against the schema ({e.message}): "
                             f"{text[:300]!r}") from None


# ---- a client that hangs up -------------------------------------------------------------------

RUN_ON = 256  # the least tokens a hung-up stream would still write: far more than the step slack
# ... and about this long on the server as it runs now: a client slowed by a busy machine still
# hangs up while its stream runs (256 tokens took SmolLM2 under a second, which a suite on a
# loaded machine could spend between reading the third delta and hanging up).
RUN_ON_S = 3.0
HANG_UP_TRIES = 3
DELTA = b'"response.output_text.delta"'  # in each delta's data, once


def long_stream_request(client: Client, positions: int, probes: Probes) -> dict:
    """A greedy streamed request shown to run to its max_output_tokens, blocking: had the
    stream not been released, it would write on long after the hang-up."""
    lasting = probes.tokens_lasting(RUN_ON_S, positions, least=RUN_ON)
    for text in LONG_INPUTS:
        prompt = usage_of(answer(client, request(client, text, max_output_tokens=CUT), "a probe"), "a probe")
        tokens = min(lasting, positions - prompt["input_tokens"] - 8)
        if tokens <= 4 * CUT:
            continue
        body = request(client, text, max_output_tokens=tokens)
        if usage_of(answer(client, body, "a probe"), "a probe")["output_tokens"] == tokens:
            return body
    raise NotSupported(f"none of {len(LONG_INPUTS)} inputs made the model write to max_output_tokens "
                       f"(up to {RUN_ON}), so a stream that runs on after its hang-up could not be told from one "
                       "that ended by itself")


def steps_until_released(client: Client, hang_up) -> float:
    """Hangs up, then counts engine steps (from once the server has answered two requests sent
    after the hang-up, so its HTTP stack has had the turns noticing takes) until no request
    runs. One not released within 10 s is waited on to its end, so the failure says so."""
    hang_up()
    hung_up = time.monotonic()
    client.metrics()
    start = client.metric("engine_steps_total")
    try:
        snap = client.wait_until(lambda s: s.get("engine_requests_running", 0) <= 0, 10,
                                 "the streamed response to be released after its client hung up")
    except ServerError as e:
        end = client.wait_idle(timeout=30, gauges=("engine_requests_running",))
        raise ServerError(f"{e}: it ran on for {end.get('engine_steps_total') - start:.0f} engine steps, "
                          f"{time.monotonic() - hung_up:.0f} s after the hang-up, until it ended by itself") from None
    return snap.get("engine_steps_total") - start


@clause("responses/cancel/1")
def test_closed_response_stream_ends_within_one_step(target, client: Client, probes: Probes, idle):
    positions = client.need("steps", "running", "positions")["positions"]
    body = long_stream_request(client, positions, probes)
    for _ in range(HANG_UP_TRIES):
        stream = RawRequest(client.base_url, PATH, {**body, "stream": True}, api_key=client.api_key)
        try:
            seen = stream.read_until(DELTA, 3).count(DELTA)
            assert seen >= 3, f"the streamed response ended after {seen} deltas, though the same request ran on blocking"
            if client.metrics().get("engine_requests_running", 0) < 1:
                continue  # it ended before its client could hang up: a release could not be told from its end
            steps = steps_until_released(client, stream.close)
            break
        finally:
            stream.close()
    else:
        raise NotSupported(f"in {HANG_UP_TRIES} tries the streamed response of {body['max_output_tokens']} tokens "
                           "ended before its client could hang up, so its release could not be timed")
    assert steps <= target.step_slack, \
        (f"{steps:.0f} engine steps passed between the hang-up and the release of a streamed response "
         f"(allowed {target.step_slack})")


# ---- bad input --------------------------------------------------------------------------------

def bad_requests(client: Client) -> dict[str, tuple[dict, str]]:
    """What is wrong with each request, the request, and the field its refusal must name."""
    return {"input 5 (neither a string nor a list)": (request(client, 5, max_output_tokens=CUT), "input"),
            "an input item of type no_such_item": (
                request(client, [{"type": "no_such_item", "text": "hi"}], max_output_tokens=CUT), "input"),
            "max_output_tokens -1": (request(client, SHORT_INPUT, max_output_tokens=-1), "max_output_tokens")}


@clause("responses/invalid/1")
def test_bad_input_is_refused_naming_the_field(client: Client):
    answer(client, request(client, SHORT_INPUT, max_output_tokens=CUT), "a plain response")  # the endpoint exists
    for wrong, (body, field) in bad_requests(client).items():
        what = f"a response request with {wrong}"
        for stream, how in ((False, what), (True, what + ", streamed")):
            status, text = refusal_of(client, PATH, body, stream, how)
            refused_with_error(status, text, how, "the bad input was taken")
            assert field in text, f"{how} answered {status} without naming {field}: {text[:300]}"
