"""/v1/responses over real HTTP, through the official client: blocking and streamed answers,
a response cut by max_output_tokens, stored responses (retrieve, delete, continue with
previous_response_id, evicted past the bound), function tools and text.format on the same
engine path as chat, and bad input refused naming the field."""

from __future__ import annotations

import json

import httpx
import pytest

from .proc import Server
from .test_server import check_error

openai = pytest.importorskip("openai")

WEATHER = {"type": "function", "name": "weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}}, "required": ["city"]}}
PET = {"format": {"type": "json_schema", "name": "pet", "strict": True, "schema": {
    "type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "ok": {"type": "boolean"}},
    "required": ["kind", "ok"]}}}


@pytest.fixture(scope="module")
def srv():
    s = Server("--responses-max-count", "3")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    yield c
    c.close()


def test_a_blocking_response_cut_by_max_output_tokens_is_incomplete(client):
    r = client.responses.create(model="synthetic", input="Hello", instructions="Be brief.", max_output_tokens=8,
                                temperature=0)
    assert r.id.startswith("resp_") and r.object == "response"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 8 and r.usage.total_tokens == r.usage.input_tokens + 8
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert r.output_text == item.content[0].text and r.instructions == "Be brief."


def test_streamed_events_come_in_order_and_add_up_to_the_response(client):
    blocking = client.responses.create(model="synthetic", input="Hello", max_output_tokens=12, temperature=0)
    events = list(client.responses.create(model="synthetic", input="Hello", max_output_tokens=12, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == blocking.output_text == events[-4].text
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")} | {events[2].item.id, final.output[0].id}
    assert len(item_ids) == 1
    assert final.usage.output_tokens == blocking.usage.output_tokens == 12
    assert final.id == events[0].response.id != blocking.id


def test_a_stored_response_is_retrieved_continued_and_deleted(client):
    first = client.responses.create(model="synthetic", input="Hello", max_output_tokens=4, temperature=0)
    assert client.responses.retrieve(first.id).output_text == first.output_text
    follow = client.responses.create(model="synthetic", input="And?", previous_response_id=first.id,
                                     max_output_tokens=4, temperature=0)
    assert follow.previous_response_id == first.id
    # the first turn's input and output came before the new input
    assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="synthetic", input="x", previous_response_id=first.id, max_output_tokens=2)


def test_stores_are_bounded_and_store_false_keeps_nothing(client):
    kept = [client.responses.create(model="synthetic", input=f"n{i}", max_output_tokens=2) for i in range(4)]
    with pytest.raises(openai.NotFoundError):  # --responses-max-count 3: the oldest went first
        client.responses.retrieve(kept[0].id)
    assert client.responses.retrieve(kept[3].id).id == kept[3].id
    unkept = client.responses.create(model="synthetic", input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)


def test_a_function_call_then_its_output(client):
    r = client.responses.create(model="synthetic", input="weather?", tools=[WEATHER], tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=100, temperature=0)
    assert r.status == "completed"
    [call] = r.output
    assert call.type == "function_call" and call.name == "weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments)["city"] in ("Oslo", "Lima")
    after = client.responses.create(model="synthetic", previous_response_id=r.id, max_output_tokens=4,
                                    input=[{"type": "function_call_output", "call_id": call.call_id,
                                            "output": '{"sky": "clear"}'}])
    assert after.output[0].type == "message"


def test_a_streamed_function_call(client):
    with client.responses.stream(model="synthetic", input="weather?", tools=[WEATHER], tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=100, temperature=0) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    assert json.loads(final.output[0].arguments)["city"] in ("Oslo", "Lima")


def test_text_format_json_schema_and_the_clients_parse_helper(client):
    from typing import Literal

    pydantic = pytest.importorskip("pydantic")

    class Pet(pydantic.BaseModel):
        kind: Literal["cat", "dog"]
        ok: bool

    r = client.responses.create(model="synthetic", input="a pet", text=PET, max_output_tokens=60, temperature=0)
    assert r.status == "completed" and set(json.loads(r.output_text)) == {"kind", "ok"}
    parsed = client.responses.parse(model="synthetic", input="a pet", text_format=Pet, max_output_tokens=60)
    assert isinstance(parsed.output_parsed, Pet)


@pytest.mark.parametrize("body, status, param", [
    ({"input": 5}, 400, "input"),
    ({"input": [{"type": "image", "url": "x"}]}, 400, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, 400, "input"),
    ({"input": "x", "max_output_tokens": -1}, 400, "max_output_tokens"),
    ({"input": "x", "background": True}, 400, "background"),
    ({"input": "x", "reasoning": {"effort": "low"}}, 400, "reasoning"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, 400, "text"),
    ({"input": "x", "previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
    ({}, 400, "input"),
])
def test_bad_input_is_refused_naming_the_field(srv, body, status, param):
    check_error(srv.post("/v1/responses", body), status, param)


def test_unknown_ids_and_the_endpoint_count(srv):
    assert httpx.get(srv.url + "/v1/responses/resp_nope").status_code == 404
    assert httpx.delete(srv.url + "/v1/responses/resp_nope").status_code == 404
    metrics = httpx.get(srv.url + "/metrics").text
    assert 'http_requests_total{endpoint="/v1/responses"}' in metrics
