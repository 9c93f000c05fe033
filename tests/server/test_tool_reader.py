"""Tool calls read back from a chat answer (server/tools.py): the request's tools checked,
the grammar each tool_choice builds, and the answer's text turned into tool_calls, whole or
in streamed pieces that add up to the same calls."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poot.server.openai import ApiError
from poot.server.tools import CallReader, call_block, parse_tool_messages, parse_tool_use, prompt_messages

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


def blocks(*calls) -> str:
    return "\n".join(call_block(name, args) for name, args in calls)


def read_in_pieces(text: str, cuts: list[int]) -> tuple[str, list[dict], CallReader]:
    reader, content, entries, at = CallReader(), "", [], 0
    for cut in [*sorted(cuts), len(text)]:
        piece, new = reader.feed(text[at:cut])
        content += piece
        entries += new
        at = max(at, cut)
    return content + reader.finish(), entries, reader


def merged(entries: list[dict]) -> list[dict]:
    """Streamed tool_calls entries merged by index, as OpenAI's clients do."""
    calls: dict[int, dict] = {}
    for e in entries:
        c = calls.setdefault(e["index"], {"id": None, "name": None, "arguments": ""})
        if "id" in e:
            assert c["id"] is None, "a call's id came twice"
            c["id"], c["name"] = e["id"], e["function"]["name"]
        else:
            assert c["id"] is not None, "arguments came before the call's id and name"
        c["arguments"] += e["function"].get("arguments", "")
    return [calls[i] for i in sorted(calls)]


arguments = st.dictionaries(st.text(alphabet="abc}{\"\\\n<>/ ", max_size=6),
                            st.one_of(st.integers(), st.text(alphabet="}\n</tool_call>\"\\", max_size=12), st.none()),
                            max_size=3)


@settings(max_examples=300, deadline=None)
@given(calls=st.lists(st.tuples(st.sampled_from(["get_weather", "get_time"]), arguments), min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 400), max_size=30))
def test_streamed_pieces_add_up_to_the_calls_however_the_text_is_cut(calls, cuts):
    text = blocks(*calls)
    content, entries, reader = read_in_pieces(text, cuts)
    assert content == ""
    assert reader.made_calls
    got = merged(entries)
    assert [(c["name"], json.loads(c["arguments"])) for c in got] == [(n, a) for n, a in calls]
    assert [c["id"] for c in got] == [c.id for c in reader.calls] and len({c["id"] for c in got}) == len(calls)
    assert [c.as_dict()["function"]["arguments"] for c in reader.calls] == [c["arguments"] for c in got]


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="<tol_ca>\n hi{}", max_size=30), cuts=st.lists(st.integers(0, 40), max_size=10))
def test_text_that_opens_no_block_comes_back_whole(text, cuts):
    if text.startswith("<tool_call>\n"):
        return
    content, entries, reader = read_in_pieces(text, cuts)
    assert content == text and entries == [] and not reader.made_calls


def test_text_that_might_open_a_block_is_held_until_it_cannot():
    reader = CallReader()
    assert reader.feed("<tool") == ("", [])
    assert reader.feed("s are") == ("<tools are", [])
    assert reader.feed(" fun") == (" fun", [])


def test_a_call_cut_short_is_not_a_call():
    text = blocks(("get_time", {}))[:-5]
    _, entries, reader = read_in_pieces(text, [])
    assert entries and not reader.made_calls


def use(**body):
    return parse_tool_use({"tools": [WEATHER, TIME], **body})


def test_tool_choice_decides_what_the_grammar_allows():
    auto = use()
    assert auto.choice == "auto" and "TEXT" in auto.grammar({}) and "get_time" in auto.grammar({})
    required = use(tool_choice="required")
    assert "TEXT" not in required.grammar({}) and "call)*" in required.grammar({})
    named = use(tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert [t.name for t in named.offered] == ["get_time"] and "get_weather" not in named.grammar({})
    single = use(tool_choice="required", parallel_tool_calls=False)
    assert "call)*" not in single.grammar({})
    assert use(tool_choice="none") is None
    assert parse_tool_use({}) is None


@pytest.mark.parametrize("body, param, says", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice", "not among the tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "must be one of"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]}, "tools",
     "not a JSON Schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools", "JSON Schema object"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "letters, digits"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "two tools are named"),
    ({"tools": [{"type": "retrieval"}]}, "tools", '"type": "function"'),
    ({"tools": {"a": 1}}, "tools", "must be a list"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
])
def test_tools_that_cannot_be_served_are_refused_naming_the_field(body, param, says):
    with pytest.raises(ApiError) as e:
        parse_tool_use(body)
    err = e.value.body()["error"]
    assert err["param"] == param and says in err["message"], err


def test_earlier_calls_and_their_results_are_written_for_a_template_without_tools():
    raw = [{"role": "user", "content": "Weather?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    parsed = [{"role": m["role"], "content": m["content"]} for m in raw]
    messages = parse_tool_messages(parsed, raw)
    assert messages[2]["tool_call_id"] == "call_1"
    rendered = prompt_messages(messages, use(), template_renders_tools=False)
    assert rendered[0]["role"] == "system" and "get_weather" in rendered[0]["content"]
    assert rendered[2] == {"role": "assistant", "content": call_block("get_weather", {"city": "Oslo"})}
    assert rendered[3] == {"role": "tool", "content": "sunny"}
    own = prompt_messages(messages, use(), template_renders_tools=True)
    assert own[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"} and own[1]["content"] == ""


@pytest.mark.parametrize("raw, says", [
    ({"role": "tool", "content": "x"}, "tool_call_id"),
    ({"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}, "not JSON"),
    ({"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]}, "function.arguments"),
])
def test_bad_tool_turns_are_refused_naming_messages(raw, says):
    with pytest.raises(ApiError) as e:
        parse_tool_messages([{"role": raw["role"], "content": raw["content"]}], [raw])
    err = e.value.body()["error"]
    assert err["param"] == "messages" and says in err["message"], err
