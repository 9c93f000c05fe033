"""Defects of function tools (tools, tool_choice, parallel_tool_calls): request and answer
rewrites around the unchanged app (api_parts.Rewrite). Each factory takes (app, state), as the
registry's middleware parts do."""

from __future__ import annotations

import json
import uuid

from .api_parts import Json, _rewrite, each_choice

FIELD = "tools"
TOOL_FIELDS = (FIELD, "tool_choice", "parallel_tool_calls")


def _whole(body: Json) -> bool:
    return body.get("object") == "chat.completion"


def _chunk(body: Json) -> bool:
    return body.get("object") == "chat.completion.chunk"


def _tool_names(body: Json) -> list:
    return [(t.get("function") or {}).get("name") for t in body.get(FIELD) or [] if isinstance(t, dict)]


def _named(body: Json) -> str | None:
    """The function a request's tool_choice names, if it names one."""
    choice = body.get("tool_choice")
    return (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None


def _auto(body: Json) -> bool:
    return bool(body.get(FIELD)) and body.get("tool_choice") in (None, "auto")


def _one_call(body: Json) -> bool:
    return body.get("parallel_tool_calls") is False


def _message_calls(choice: dict) -> list:
    return (choice.get("message") or {}).get("tool_calls") or []


def _delta_calls(choice: dict) -> list:
    return (choice.get("delta") or {}).get("tool_calls") or []


def _on_whole(change):
    """An answer rewrite that changes the choices of whole answers only, not stream chunks."""
    each = each_choice(change)
    return lambda body: each(body) if _whole(body) else body


def _on_chunks(change):
    each = each_choice(change)
    return lambda body: each(body) if _chunk(body) else body


# ---- the changes ------------------------------------------------------------------------------

def _arguments_as_object(choice: dict) -> None:
    for call in _message_calls(choice):
        call["function"]["arguments"] = json.loads(call["function"]["arguments"])


def _tool_calls_as_stop(choice: dict) -> None:
    if choice.get("finish_reason") == "tool_calls":
        choice["finish_reason"] = "stop"


def _another_call(choice: dict) -> None:
    calls = _message_calls(choice)
    if calls:
        calls.append({**calls[0], "id": "call_" + uuid.uuid4().hex[:24]})


def _no_call_ids(choice: dict) -> None:
    for entry in _delta_calls(choice):
        entry.pop("id", None)


def _pieces_without_index(choice: dict) -> None:
    for entry in _delta_calls(choice):
        if "id" not in entry:  # an arguments piece, not a call's first entry
            entry.pop("index", None)


def _text_as_tool_calls(choice: dict) -> None:
    if "message" in choice and not _message_calls(choice) and choice.get("finish_reason") in ("stop", "length"):
        choice["finish_reason"] = "tool_calls"


def _another_tool_named(body: Json) -> Json:
    """Serves a named tool_choice as the choice of another of the request's tools."""
    names = _tool_names(body)
    others = [n for n in names if n != _named(body)]
    if _named(body) in names and others:
        body["tool_choice"] = {"type": "function", "function": {"name": others[0]}}
    return body


def _unknown_choice_dropped(body: Json) -> Json:
    """Drops a tool_choice naming a function that is not among the tools, instead of refusing it."""
    if _named(body) is not None and _named(body) not in _tool_names(body):
        body.pop("tool_choice")
    return body


def _tool_message_field(body: Json) -> str | None:
    messages = body.get("messages")
    holds = isinstance(messages, list) and any(isinstance(m, dict) and m.get("role") == "tool" for m in messages)
    return "messages" if holds else None


def _tool_field(body: Json) -> str | None:
    return next((f for f in TOOL_FIELDS if f in body), None)


tool_arguments_as_object = _rewrite(answer=_on_whole(_arguments_as_object), when=lambda body: FIELD in body)
tool_calls_finish_stop = _rewrite(answer=each_choice(_tool_calls_as_stop), when=lambda body: FIELD in body)
named_choice_swapped = _rewrite(request=_another_tool_named)
parallel_calls_ignored = _rewrite(answer=_on_whole(_another_call), when=_one_call)
stream_call_without_id = _rewrite(answer=_on_chunks(_no_call_ids), when=lambda body: FIELD in body)
stream_pieces_without_index = _rewrite(answer=_on_chunks(_pieces_without_index), when=lambda body: FIELD in body)
tool_messages_refused = _rewrite(refuse=_tool_message_field)
unknown_tool_choice_dropped = _rewrite(request=_unknown_choice_dropped)
auto_text_reported_tool_calls = _rewrite(answer=_on_whole(_text_as_tool_calls), when=_auto)
# Not a defect: a server without function tools that says so, naming the field.
refuses_tools = _rewrite(refuse=_tool_field)
