"""structured/*: structured outputs, response_format json_schema and json_object.

A server that refuses response_format with a 4xx naming it does not offer structured outputs:
those clauses are not supported there. One that takes it and answers text the format does not
allow fails, and so does one that takes a schema it cannot serve and answers free text.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from poot.conformance.client import Client, Stream
from poot.conformance.documents import ANIMAL, ANIMAL_ASK
from poot.conformance.outcomes import NotSupported
from poot.conformance.scenarios import refusal_names, refusal_of, refused_with_error

clause = pytest.mark.clause

FIELD = "response_format"

MAX_TOKENS = 256
# Far below the shortest document ({"animal": "cat", "legs": 0, "wild": true, "name": ""}).
TOO_FEW_TOKENS = 4
ASK = ANIMAL_ASK
SMALL_OBJECT_ASK = 'Reply with the JSON object {"ok": true} and nothing else.'
# What cannot be served: a schema that is not an object, and a type JSON Schema does not have.
UNSERVABLE = {"schema 5": 5, 'schema {"type": "no-such-type"}': {"type": "no-such-type"}}


def json_schema(schema: Any) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "animal", "schema": schema, "strict": True}}


def chat_body(client: Client, response_format: dict, **params: Any) -> dict:
    return {"model": client.model, "messages": [{"role": "user", "content": ASK}], "temperature": 0,
            "max_tokens": MAX_TOKENS, "response_format": response_format, **params}


def refused(status: int, text: str, what: str) -> None:
    """Not supported where the server refuses response_format by name."""
    if refusal_names(status, text, FIELD):
        raise NotSupported(f"the server refuses {FIELD} ({what}) with {status}: {text[:200]}")


def answer(client: Client, path: str, body: dict, what: str) -> dict:
    """The 200 answer to a request with response_format; not supported where it is refused."""
    r = client.post(path, body)
    refused(r.status_code, r.text, what)
    assert r.status_code == 200, f"{what} answered {r.status_code}: {r.text[:300]}"
    return r.json()


def streamed(client: Client, path: str, body: dict, what: str) -> Stream:
    s = client.stream(path=path, body={**body, "stream": True})
    refused(s.status, s.body, what)
    assert s.status == 200, f"{what} answered {s.status}: {s.body[:300]}"
    return s


def parsed(content: Any, finish: Any, what: str) -> Any:
    """The JSON of an answer's content, or a failure that says what came instead."""
    assert isinstance(content, str), f"{what}: content is {content!r}, not a string"
    try:
        return json.loads(content)
    except ValueError as e:
        raise AssertionError(f"{what}: content is not JSON ({e}); finish_reason {finish!r}: {content[:300]!r}") \
            from None


def validated(content: Any, finish: Any, what: str, schema: dict = ANIMAL) -> Any:
    document = parsed(content, finish, what)
    try:
        jsonschema.validate(document, schema)
    except jsonschema.ValidationError as e:
        raise AssertionError(f"{what}: content does not validate against the schema ({e.message}): "
                             f"{content[:300]!r}") from None
    return document


def ended_stop(finish: Any, what: str, content: str) -> None:
    assert finish == "stop", f"{what}: a whole document ended with finish_reason {finish!r}, expected 'stop': " \
                             f"{content[:300]!r}"


def whole_chat(body: dict) -> tuple[Any, Any]:
    choice = (body.get("choices") or [{}])[0]
    return (choice.get("message") or {}).get("content"), choice.get("finish_reason")


# What a 200 to a request that must be refused means.
SERVED = "the format was ignored and the request served"


@clause("structured/json-schema/1")
def test_json_schema_answer_validates(client: Client):
    what = "a chat with a json_schema response_format"
    content, finish = whole_chat(answer(client, "/v1/chat/completions", chat_body(client, json_schema(ANIMAL)), what))
    validated(content, finish, what)
    ended_stop(finish, what, content)


@clause("structured/json-schema/2")
def test_streamed_json_schema_answer_validates(client: Client):
    what = "a streamed chat with a json_schema response_format"
    s = streamed(client, "/v1/chat/completions", chat_body(client, json_schema(ANIMAL)), what)
    assert s.done, f"{what}: the stream did not end with 'data: [DONE]'"
    validated(s.text, s.finish_reason, f"{what} (its deltas joined)")
    ended_stop(s.finish_reason, what, s.text)


@clause("structured/json-object/1")
def test_json_object_answer_is_an_object(client: Client):
    what = "a chat with a json_object response_format"
    # json_object bounds no key and no length: the prompt asks for a small object, so that any
    # model ends it well inside max_tokens (asked to describe something, a small one writes
    # keys until max_tokens runs out, on every server).
    body = answer(client, "/v1/chat/completions", {**chat_body(client, {"type": "json_object"}), "messages": [
        {"role": "user", "content": SMALL_OBJECT_ASK}]}, what)
    content, finish = whole_chat(body)
    document = parsed(content, finish, what)
    assert isinstance(document, dict), f"{what}: content is JSON but not an object: {content[:300]!r}"
    ended_stop(finish, what, content)


@clause("structured/completions/1")
def test_completion_with_json_schema_validates(client: Client):
    what = "a completion with a json_schema response_format"
    body = answer(client, "/v1/completions", client.body(ASK + "\n", max_tokens=MAX_TOKENS, temperature=0,
                                                         response_format=json_schema(ANIMAL)), what)
    choice = (body.get("choices") or [{}])[0]
    text, finish = choice.get("text"), choice.get("finish_reason")
    validated(text, finish, what)
    ended_stop(finish, what, text)


def is_whole(content: str) -> bool:
    try:
        jsonschema.validate(json.loads(content), ANIMAL)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def finish_tells_whether_whole(content: str, finish: Any, completion_tokens: Any, what: str) -> None:
    """A document cut short ends "length" after max_tokens; a whole one (a tokenizer with long
    tokens) ends "stop"."""
    if is_whole(content):
        ended_stop(finish, what, content)
        return
    assert finish == "length", \
        (f"{what}: {content!r} is not a whole document, cut at max_tokens {TOO_FEW_TOKENS}, but finish_reason is "
         f"{finish!r}, expected 'length'")
    if completion_tokens is not None:
        assert completion_tokens == TOO_FEW_TOKENS, \
            f"{what}: finish_reason 'length' after {completion_tokens} tokens, not max_tokens {TOO_FEW_TOKENS}"


@clause("structured/length/1")
def test_document_cut_short_ends_length(client: Client):
    what = f"a chat with a json_schema response_format and max_tokens {TOO_FEW_TOKENS}"
    request = chat_body(client, json_schema(ANIMAL), max_tokens=TOO_FEW_TOKENS)
    body = answer(client, "/v1/chat/completions", request, what)
    content, finish = whole_chat(body)
    assert isinstance(content, str), f"{what}: content is {content!r}, not a string"
    finish_tells_whether_whole(content, finish, (body.get("usage") or {}).get("completion_tokens"), what)
    s = streamed(client, "/v1/chat/completions", request, what + ", streamed")
    finish_tells_whether_whole(s.text, s.finish_reason, None, what + ", streamed")


@clause("structured/invalid/1")
def test_unservable_schema_is_refused(client: Client):
    answer(client, "/v1/chat/completions", chat_body(client, json_schema(ANIMAL), max_tokens=TOO_FEW_TOKENS),
           "a chat with a valid json_schema response_format")  # the server takes response_format at all
    for name, schema in UNSERVABLE.items():
        body = chat_body(client, json_schema(schema), max_tokens=16)
        what = f"a chat with response_format json_schema {name}"
        for stream, how in ((False, what), (True, what + ", streamed")):
            refused_with_error(*refusal_of(client, "/v1/chat/completions", body, stream, how), how, SERVED)
