"""Tool calls over real HTTP, on SmolLM2 (its template renders no tools: the fallback prompt
offers them): tool_choice required, a named function and auto, blocking and streamed (read
by the official client), a following turn with the tool's result, and refusals naming the
field."""

from __future__ import annotations

import json

import jsonschema
import pytest

from .proc import Server
from .test_server import check_error

WEATHER_ARGS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                 "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER_ARGS}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone",
                                           "parameters": {"type": "object", "properties": {
                                               "zone": {"type": "string", "maxLength": 24}}, "required": ["zone"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def srv():
    s = Server(model="default")
    yield s
    s.stop()


def chat(srv, **body) -> dict:
    r = srv.post("/v1/chat/completions", {"messages": ASK, "max_tokens": 80, "temperature": 0, "tools": TOOLS,
                                          "parallel_tool_calls": False, **body})
    assert r.status_code == 200, r.text
    return r.json()


def the_call(body: dict) -> dict:
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    message = choice["message"]
    assert message["content"] is None and len(message["tool_calls"]) == 1, message
    call = message["tool_calls"][0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    return call


def test_required_calls_an_offered_tool_with_arguments_its_schema_accepts(srv):
    call = the_call(chat(srv, tool_choice="required"))
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER_ARGS)


def test_a_named_function_is_the_one_called(srv):
    call = the_call(chat(srv, tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert call["function"]["name"] == "get_time"
    assert set(json.loads(call["function"]["arguments"])) == {"zone"}


def test_parallel_calls_are_each_a_whole_call(srv):
    body = chat(srv, tool_choice="required", parallel_tool_calls=True, max_tokens=200,
                messages=[{"role": "user", "content": "Weather in Paris, and the time in Tokyo?"}])
    choice = body["choices"][0]
    if choice["finish_reason"] == "tool_calls":
        for call in choice["message"]["tool_calls"]:
            json.loads(call["function"]["arguments"])
    else:  # the model went on calling until max_tokens: the text comes back as it was
        assert choice["finish_reason"] == "length" and choice["message"]["content"].startswith("<tool_call>")


def test_auto_answers_text_or_calls_and_none_answers_text(srv):
    for choice in ("auto", "none"):
        message = chat(srv, tool_choice=choice, max_tokens=24)["choices"][0]["message"]
        if message.get("tool_calls"):
            assert choice == "auto"
        else:
            assert isinstance(message["content"], str) and message["content"]


def test_the_official_client_reads_the_streamed_call(srv):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    blocking = client.chat.completions.create(model="default", messages=ASK, tools=TOOLS, tool_choice="required",
                                              parallel_tool_calls=False, temperature=0, max_tokens=80)
    calls: dict[int, dict] = {}
    reasons = []
    with client.chat.completions.create(model="default", messages=ASK, tools=TOOLS, tool_choice="required",
                                        parallel_tool_calls=False, temperature=0, max_tokens=80, stream=True) as stream:
        for chunk in stream:
            for c in chunk.choices:
                reasons.append(c.finish_reason)
                for d in c.delta.tool_calls or []:
                    call = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
                    assert call["id"] and call["name"], "a call's first delta carries its id and name"
                    call["arguments"] += d.function.arguments or ""
    assert [r for r in reasons if r] == ["tool_calls"]
    want = blocking.choices[0].message.tool_calls[0].function
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [(want.name, want.arguments)]


def test_a_turn_with_the_tools_result_is_answered(srv):
    call = the_call(chat(srv, tool_choice="required"))
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call["id"], "content": '{"temperature": 18, "sky": "clear"}'}]
    body = chat(srv, messages=messages, tool_choice="none", max_tokens=24)
    assert isinstance(body["choices"][0]["message"]["content"], str)


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "get_news"}}}, "tool_choice"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}], "tool_choice": "required"},
     "tools"),  # a schema llguidance cannot enforce
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [*ASK, {"role": "tool", "content": "x"}]}, "messages"),
])
def test_bad_tool_requests_are_a_400_naming_the_field(srv, body, param):
    r = srv.post("/v1/chat/completions", {"messages": ASK, "max_tokens": 8, "tools": TOOLS, **body})
    check_error(r, 400, param)
