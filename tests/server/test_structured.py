"""response_format over real HTTP: constrained answers on both endpoints, blocking and
streamed, through curl-shaped bodies and the official client's parse helper; schemas and
fields the server cannot serve are refused with a 400 naming them, never a 500 or a 200
that ignored them."""

from __future__ import annotations

import json

import jsonschema
import pytest

from .proc import Server
from .test_server import check_error, text_of

PET = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "age": {"type": "integer", "minimum": 0,
                                                                                   "maximum": 30},
                                        "name": {"type": "string", "maxLength": 8}},
       "required": ["kind", "age", "name"], "additionalProperties": False}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET, "strict": True}}
MESSAGES = [{"role": "user", "content": "Describe a pet."}]


@pytest.fixture(scope="module")
def srv():
    s = Server()
    yield s
    s.stop()


def chat(srv, **body) -> dict:
    r = srv.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 64, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_chat_answer_is_a_document_the_schema_accepts(srv):
    for temperature in (0, 1.2):
        body = chat(srv, response_format=SCHEMA_FORMAT, temperature=temperature, seed=3)
        choice = body["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), PET)


def test_a_completion_takes_response_format_too(srv):
    body = srv.complete(prompt="A pet:", max_tokens=64, temperature=0, response_format=SCHEMA_FORMAT)
    jsonschema.validate(json.loads(body["choices"][0]["text"]), PET)
    body = srv.complete(prompt="A pet:", max_tokens=64, temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(body["choices"][0]["text"]), dict)


def test_streamed_choices_each_match(srv):
    events, r = srv.stream("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 64, "n": 2, "seed": 5,
                                                    "temperature": 1.0, "response_format": SCHEMA_FORMAT})
    for index in (0, 1):
        mine = [e for e in events if e != "[DONE]" and e["choices"] and e["choices"][0]["index"] == index]
        text, reason = text_of(mine, chat=True)
        assert reason == "stop"
        jsonschema.validate(json.loads(text), PET)


def test_a_document_cut_by_max_tokens_says_length(srv):
    body = chat(srv, response_format=SCHEMA_FORMAT, temperature=0, max_tokens=4)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 4


def test_text_asks_for_nothing(srv):
    plain = chat(srv, temperature=0, max_tokens=12)
    assert chat(srv, temperature=0, max_tokens=12, response_format={"type": "text"})["choices"] == plain["choices"]


@pytest.mark.parametrize("response_format, says", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}, "cannot be compiled"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {"type": "string"}}}}, "Unimplemented"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}, "JSON Schema object"),
    ({"type": "json_schema"}, "json_schema must be an object"),
    ({"type": "xml"}, "text, json_object or json_schema"),
    ("json", "must be an object"),
])
def test_a_format_that_cannot_be_served_is_a_400_naming_response_format(srv, response_format, says):
    r = srv.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 8, "response_format": response_format})
    err = check_error(r, 400, "response_format")
    assert says in err["message"], err


def test_the_server_still_serves_after_refusals(srv):
    test_a_chat_answer_is_a_document_the_schema_accepts(srv)


@pytest.mark.parametrize("path, field, value", [
    ("/v1/chat/completions", "reasoning_effort", "high"),
    ("/v1/chat/completions", "modalities", ["text", "audio"]),
    ("/v1/chat/completions", "prediction", {"type": "content", "content": "x"}),
    ("/v1/chat/completions", "functions", [{"name": "f", "parameters": {}}]),  # tools' deprecated forerunner
    ("/v1/chat/completions", "store", True),
    ("/v1/completions", "top_logprobs", 2),  # chat's field, not the legacy endpoint's
    ("/v1/completions", "no_such_field", 1),
])
def test_a_field_the_server_does_not_implement_is_named_in_a_400(srv, path, field, value):
    body = {"max_tokens": 4, field: value, **({"messages": MESSAGES} if "chat" in path else {"prompt": "x"})}
    err = check_error(srv.post(path, body), 400, field)
    assert field in err["message"] and err["code"] == "unsupported_parameter", err


def test_fields_that_only_tune_the_answer_are_taken(srv):
    chat(srv, user="someone", metadata={"k": "v"}, service_tier="auto", tool_choice="none", store=False,
         parallel_tool_calls=None)


def test_min_tokens_with_a_format_is_refused(srv):
    r = srv.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 8, "min_tokens": 2,
                                          "response_format": {"type": "json_object"}})
    check_error(r, 400, "min_tokens")


def test_the_official_clients_parse_helper():
    openai = pytest.importorskip("openai")
    pydantic = pytest.importorskip("pydantic")

    from typing import Literal

    class Pet(pydantic.BaseModel):
        kind: Literal["cat", "dog"]
        legs: int = pydantic.Field(ge=0, le=8)

    s = Server()
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.parse(model="synthetic", messages=MESSAGES, max_tokens=48, temperature=0,
                                          response_format=Pet)
        assert isinstance(r.choices[0].message.parsed, Pet), r.choices[0].message
    finally:
        s.stop()
