"""OpenAI request parsing and response shapes for /v1/completions and /v1/chat/completions.

Parsing never touches the engine: a bad request becomes an ApiError (a 4xx) before anything
is submitted. SamplingParams.validate does the range and type checks of the sampling fields.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from poot.engine import InvalidRequest, SamplingParams

from . import sampling_fields
from .sampling_fields import Choices

MAX_BODY_BYTES = 1 << 20  # 1 MiB
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


class ApiError(Exception):
    """An error answered as {"error": {message, type, param, code}} with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or ("invalid_request_error" if status < 500 else
                              "service_unavailable" if status == 503 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


@dataclass(slots=True, frozen=True)
class ResponseFormat:
    """What the output must be (response_format): any JSON object, or a document its JSON
    schema accepts."""

    kind: str  # json_object | json_schema
    schema: dict | None = None  # json_schema's
    name: str | None = None


@dataclass(slots=True)
class Parsed:
    chat: bool
    prompt: str | list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    choices: Choices = field(default_factory=Choices)  # n, best_of, echo, logprobs
    response_format: ResponseFormat | None = None
    tools: Any = None  # tools.ToolUse: the tools a chat answer may call, and how


# Every field a request may hold, by endpoint; anything else is refused with a 400 naming it
# (a field silently dropped is an answer that looks right and is not). A field sent as null
# asks for nothing and is let through. IGNORED are taken and do nothing here, for the reason
# server/README.md gives each.
COMMON_FIELDS = frozenset({
    "model", "stream", "stream_options", "max_tokens", "stop", "temperature", "top_p", "top_k", "seed", "n",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "logprobs", "response_format",
    "store",  # false only (checked below): nothing is kept
    # extensions other servers take too (vLLM, llama.cpp): the suite's extension clauses
    "ignore_eos", "min_tokens", "stop_token_ids"})
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "best_of", "suffix"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                               "parallel_tool_calls"}
IGNORED_FIELDS = frozenset({"user", "metadata", "service_tier"})


def check_fields(body: dict, chat: bool) -> None:
    known = (CHAT_FIELDS if chat else COMPLETION_FIELDS) | IGNORED_FIELDS
    unknown = sorted(k for k, v in body.items() if k not in known and v is not None)
    if unknown:
        raise ApiError(400, f"unsupported field{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)}; this server "
                       "does not implement " + ("them" if len(unknown) > 1 else "it"), unknown[0], "unsupported_parameter")
    if body.get("store") is True:
        raise ApiError(400, "store is not supported: this server keeps no completions", "store", "unsupported_parameter")


def parse_response_format(body: dict) -> ResponseFormat | None:
    """response_format: absent or {"type": "text"} asks for nothing; {"type": "json_object"};
    {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}. The schema itself is
    checked when compiled (engine/grammar.py)."""
    v = body.get("response_format")
    if v is None:
        return None
    if not isinstance(v, dict) or not isinstance(v.get("type"), str):
        raise bad("response_format must be an object with a type: text, json_object or json_schema", "response_format")
    kind = v["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object")
    if kind != "json_schema":
        raise bad(f"response_format.type must be text, json_object or json_schema; got {kind!r}", "response_format")
    spec = v.get("json_schema")
    if not isinstance(spec, dict):
        raise bad("response_format.json_schema must be an object with a name and a schema", "response_format")
    name, schema, strict = spec.get("name"), spec.get("schema"), spec.get("strict")
    if name is not None and not isinstance(name, str):
        raise bad("response_format.json_schema.name must be a string", "response_format")
    if strict is not None and not isinstance(strict, bool):
        raise bad("response_format.json_schema.strict must be a boolean", "response_format")
    if not isinstance(schema, dict):
        raise bad("response_format.json_schema.schema must be a JSON Schema object", "response_format")
    return ResponseFormat("json_schema", schema, name)


def parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"the request body is not valid JSON: {e}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, not {type(body).__name__}", None, "invalid_json")
    return body


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"{name} must be a boolean", name)
    return v


def _common(body: dict, *, chat: bool, default_max_tokens: int | None, models: tuple[str, ...]) -> dict:
    check_fields(body, chat)
    model = body.get("model")
    if model is not None:
        if not isinstance(model, str):
            raise bad("model must be a string", "model")
        if model not in models:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {models[0]!r}",
                           "model", "model_not_found")
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad("stream_options must be an object", "stream_options")
        include_usage = _bool(opts, "include_usage")
        if "include_usage" in opts and not isinstance(opts["include_usage"], bool):
            raise bad("stream_options.include_usage must be a boolean", "stream_options")
    max_tokens = body.get("max_tokens")
    if chat and max_tokens is None:
        max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = default_max_tokens
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list):
        stop = tuple(stop)
    else:
        raise bad("stop must be a string or a list of strings", "stop")
    try:
        extra, choices = sampling_fields.parse(body, chat=chat, stream=stream, max_tokens=max_tokens)
    except InvalidRequest as e:
        raise bad(str(e), e.param) from None
    top_k = body.get("top_k", 0)
    if top_k is None or (_is_int(top_k) and top_k == -1):  # -1: "no cut" in other servers' dialect
        top_k = 0
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.get("temperature") is None else body["temperature"],
        top_p=1.0 if body.get("top_p") is None else body["top_p"],
        top_k=top_k,
        seed=body.get("seed"),
        stop=stop,
        ignore_eos=_bool(body, "ignore_eos"),
        **extra,
    )
    try:
        params.validate()
    except InvalidRequest as e:
        raise bad(str(e), e.param) from None
    response_format = parse_response_format(body)
    if response_format is not None and params.min_tokens:
        # min_tokens holds end-of-sequence back, which a whole document needs next.
        raise bad("min_tokens cannot be used with a response_format that constrains the output", "min_tokens")
    return {"params": params, "stream": stream, "include_usage": include_usage, "choices": choices,
            "response_format": response_format}


def parse_completion(body: dict, models: tuple[str, ...]) -> Parsed:
    if "prompt" not in body or body["prompt"] is None:
        raise bad("prompt is required", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list):
        if not all(_is_int(t) for t in prompt):
            raise bad("prompt must be a string or a list of token ids (integers); batches are not supported",
                      "prompt")
    elif not isinstance(prompt, str):
        raise bad("prompt must be a string or a list of token ids", "prompt")
    if not prompt:
        raise bad("the prompt is empty", "prompt")
    common = _common(body, chat=False, default_max_tokens=16, models=models)
    return Parsed(False, prompt, **common)


def parse_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if messages is None:
        raise bad("messages is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object", "messages")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise bad(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}; got {role!r}", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text is understood
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise bad(f"messages[{i}].content parts must be text parts", "messages")
                texts.append(part["text"])
            content = "".join(texts)
        if content is None and role == "assistant" and m.get("tool_calls"):
            content = None  # a turn of tool calls alone (server/tools.py reads them)
        elif not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string or a list of text parts", "messages")
        out.append({"role": role, "content": content})
    return out


def parse_chat(body: dict, models: tuple[str, ...], prompt: list[int], default_max_tokens: int,
               tools=None) -> Parsed:
    """`tools`: the request's tools.ToolUse, parsed before its messages were rendered."""
    common = _common(body, chat=True, default_max_tokens=default_max_tokens, models=models)
    if tools is not None and common["response_format"] is not None:
        raise bad("response_format cannot be combined with tools the answer may call; send tool_choice none, or "
                  "leave one out", "response_format")
    if tools is not None and common["params"].min_tokens:
        raise bad("min_tokens cannot be used with tools: a call block ends where its grammar says", "min_tokens")
    return Parsed(True, prompt, **common, tools=tools)


# ---- responses ----------------------------------------------------------------------------

def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def timings(queued_s: float | None, prefill_s: float | None) -> dict:
    """Where a request's time to first token went, server side (as llama.cpp's server answers
    `timings`): waiting for a row, then prefilling until the first token was committed."""
    def ms(s):
        return None if s is None else round(s * 1e3, 3)
    return {"queued_ms": ms(queued_s), "prefill_ms": ms(prefill_s)}


def sse(obj) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


DONE = "data: [DONE]\n\n"
