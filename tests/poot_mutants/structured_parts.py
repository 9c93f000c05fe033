"""Defects of structured outputs (response_format) and of the refusal of unknown fields: request
and answer rewrites around the unchanged app (api_parts.Rewrite), and a ServerState whose
failure to compile a schema escapes as a server error. Each factory takes (app, state), as the
registry's middleware parts do."""

from __future__ import annotations

from collections.abc import Callable

from poot.engine import InvalidRequest
from poot.server import openai
from poot.server.state import ServerState

from .api_parts import Json, _rewrite, _without, each_choice

FIELD = "response_format"


def _format_type(body: Json) -> str | None:
    rf = body.get(FIELD)
    return rf.get("type") if isinstance(rf, dict) else None


def _constrained(body: Json) -> bool:
    return body.get(FIELD) is not None


def _drop_format_when(holds: Callable[[Json], bool]) -> Callable[[Json], Json]:
    def request(body: Json) -> Json:
        if holds(body):
            body.pop(FIELD, None)
        return body
    return request


def _length_as_stop(choice: dict) -> None:
    if choice.get("finish_reason") == "length":
        choice["finish_reason"] = "stop"


def _only_implemented_fields(body: Json) -> Json:
    """Drops, before the server reads them, the fields it would refuse as not implemented."""
    known = openai.COMPLETION_FIELDS | openai.CHAT_FIELDS | openai.IGNORED_FIELDS
    return {k: v for k, v in body.items() if k in known}


response_format_dropped = _rewrite(request=_without(FIELD))
stream_unconstrained = _rewrite(request=_drop_format_when(lambda body: bool(body.get("stream"))))
completion_format_dropped = _rewrite(request=_drop_format_when(lambda body: "prompt" in body))  # chat keeps it
json_object_dropped = _rewrite(request=_drop_format_when(lambda body: _format_type(body) == "json_object"))
truncated_reported_stop = _rewrite(answer=each_choice(_length_as_stop), when=_constrained)
unknown_fields_dropped = _rewrite(request=_only_implemented_fields)
# Not a defect: a server without structured outputs that says so, naming the field.
refuses_response_format = _rewrite(refuse=lambda body: FIELD if _constrained(body) else None)


class SchemaError500(ServerState):
    """A schema that cannot be compiled is not caught as the client's error: 500."""

    def matchers(self, response_format, count: int) -> list:
        try:
            return super().matchers(response_format, count)
        except InvalidRequest as e:
            raise RuntimeError(f"grammar compile failed: {e}") from None
