"""Chat templates: a conversation rendered to the prompt text the model was trained on.

A template comes from the model file, so it is untrusted code: it runs in jinja2's
ImmutableSandboxedEnvironment (no attribute tricks, no changes to what it is given, bounded
`range`). The environment matches Hugging Face's apply_chat_template: trim_blocks and
lstrip_blocks, loop controls, `raise_exception(msg)`, `strftime_now(fmt)`, a `tojson` that
keeps non-ASCII text, and the special-token texts (`bos_token`, `eos_token`, ...) as variables.

Anything wrong, whether with the messages or with the template, raises InvalidRequest
(param "messages"); rendering never crashes the caller.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from datetime import datetime

from jinja2 import TemplateError, meta
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..params import InvalidRequest
from .base import LoadedModel

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_OUTPUT_CHARS = 16 << 20  # a template that expands beyond this is refused

# Used when a model carries no template of its own.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class TemplateRaised(TemplateError):
    """What raise_exception() raises: the template refusing the conversation."""


def _raise_exception(message) -> None:
    raise TemplateRaised(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(str(fmt))


def _tojson(value, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.cache
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=32)
def _compile(template: str):
    return _environment().from_string(template)


def validate_messages(messages) -> list[dict]:
    """Copies of the messages, or InvalidRequest saying what is wrong with them."""
    if not isinstance(messages, list | tuple):
        raise InvalidRequest(f"messages must be a list of {{role, content}} objects; got {type(messages).__name__}",
                             "messages")
    if not messages:
        raise InvalidRequest("messages must not be empty", "messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequest(f"messages[{i}] must be an object with role and content; got {type(message).__name__}",
                                 "messages")
        role = message.get("role")
        if not isinstance(role, str):
            raise InvalidRequest(f"messages[{i}].role must be a string", "messages")
        if role not in ROLES:
            raise InvalidRequest(f"messages[{i}].role {role!r} is not one of {', '.join(ROLES)}", "messages")
        content = message.get("content")
        if not isinstance(content, str):
            got = "missing" if content is None else type(content).__name__
            raise InvalidRequest(f"messages[{i}].content must be a string; got {got}", "messages")
        out.append(dict(message))
    return out


def render_template(template: str, messages, *, add_generation_prompt: bool = True,
                    special_tokens: Mapping[str, str] | None = None, **extra) -> str:
    """Renders `template` for `messages` (validated first)."""
    checked = validate_messages(messages)
    variables = {"bos_token": "", "eos_token": "", **(special_tokens or {}), **extra}
    try:
        compiled = _compile(template)
        pieces, size = [], 0
        for piece in compiled.generate(messages=checked, add_generation_prompt=bool(add_generation_prompt),
                                       **variables):
            size += len(piece)
            if size > MAX_OUTPUT_CHARS:
                raise InvalidRequest("the chat template produced an oversized prompt", "messages")
            pieces.append(piece)
        text = "".join(pieces)
    except InvalidRequest:
        raise
    except TemplateRaised as e:
        raise InvalidRequest(f"the chat template refused the conversation: {_one_line(e)}", "messages") from None
    except TemplateError as e:
        raise InvalidRequest(f"the chat template failed: {type(e).__name__}: {_one_line(e)}", "messages") from None
    except Exception as e:  # a template can raise anything (TypeError, RecursionError, ...)
        raise InvalidRequest(f"the chat template failed: {type(e).__name__}: {_one_line(e)}", "messages") from None
    return text


def render_chat(model: LoadedModel, messages, add_generation_prompt: bool = True,
                tools: list[dict] | None = None) -> str:
    """The prompt text for a conversation with `model` (its own template, else ChatML);
    `tools` (OpenAI's function tools) for a template that renders them."""
    template = model.chat_template or CHATML_TEMPLATE
    extra = {"tools": tools} if tools else {}
    return render_template(template, messages, add_generation_prompt=add_generation_prompt,
                           special_tokens=model.special_tokens, **extra)


def renders_tools(model: LoadedModel) -> bool:
    """Whether the model's template reads a `tools` variable (Hugging Face's convention for
    templates that write the tools into the prompt themselves)."""
    return bool(model.chat_template) and "tools" in _variables(model.chat_template)


@functools.lru_cache(maxsize=32)
def _variables(template: str) -> frozenset[str]:
    """The variables a template reads from its caller (none, for one that does not parse)."""
    try:
        return frozenset(meta.find_undeclared_variables(_environment().parse(template)))
    except TemplateError:
        return frozenset()


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__
