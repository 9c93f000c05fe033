"""Function tools on chat completions: the request's `tools`, `tool_choice` and
`parallel_tool_calls`; the prompt that offers the tools; the grammar that holds the answer to
them; and the answer read back as OpenAI's `tool_calls`, whole or streamed.

A call is written as a block the Hermes and Qwen families were trained on, one block per call:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

with blocks separated by one newline. The grammar (llguidance's Lark dialect, compiled by
engine/grammar.py) allows, by tool_choice:
- `required`: one or more blocks, each naming an offered tool with arguments its parameters
  schema accepts;
- a named function: blocks calling that function only;
- `auto`: those blocks, or text that does not start with a block;
- `none`: no grammar, and the tools are not offered in the prompt.
`parallel_tool_calls: false` allows one block. JSON inside a block is compact, with the
separators of engine/grammar.py's JSON_OPTIONS, so the name comes first and the arguments
last, and both can be streamed as they are written.

Where the model's chat template renders tools itself (it reads a `tools` variable), it is
given them; otherwise a system message written here offers them (FALLBACK_PROMPT).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

from .openai import bad

CALL_OPEN = "<tool_call>\n"
CALL_CLOSE = "\n</tool_call>"
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
TOOL_CHOICES = ("none", "auto", "required")

# Short: a small model's context is short too.
FALLBACK_PROMPT = (
    "To call a function, answer only with:\n"
    "<tool_call>\n{{\"name\": NAME, \"arguments\": ARGUMENTS}}\n</tool_call>\n"
    "{many}Functions:\n{functions}"
)


@dataclass(slots=True, frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict


@dataclass(slots=True, frozen=True)
class ToolUse:
    """What the request allows: the tools offered, and how they must be used."""

    tools: tuple[Tool, ...]
    choice: str  # auto | required | function (a named function)
    parallel: bool = True
    named: str | None = None

    @property
    def offered(self) -> tuple[Tool, ...]:
        """The tools the grammar lets the model call."""
        return tuple(t for t in self.tools if self.named in (None, t.name))

    def grammar(self, json_options: dict) -> str:
        """The Lark grammar (llguidance's dialect) an answer must match."""
        from poot.engine.grammar import closed

        calls = [{"x-guidance": json_options, "type": "object", "additionalProperties": False,
                  "properties": {"name": {"const": t.name}, "arguments": closed(t.parameters)},
                  "required": ["name", "arguments"]} for t in self.offered]
        body = calls[0] if len(calls) == 1 else {"x-guidance": json_options, "anyOf": calls}
        rules = [
            f"start: {'TEXT | calls' if self.choice == 'auto' else 'calls'}",
            f'calls: call {"(" + json.dumps(chr(10)) + " call)*" if self.parallel else ""}',
            f"call: {json.dumps(CALL_OPEN)} %json {json.dumps(body)} {json.dumps(CALL_CLOSE)}",
        ]
        if self.choice == "auto":
            # any text that does not open with a call block
            rules.append(f"TEXT: /(.|\\n)*/ & ~/{re.escape(CALL_OPEN.strip())}(.|\\n)*/")
        return "\n".join(rules)

    def system_prompt(self) -> str:
        functions = "\n".join(json.dumps({"name": t.name, **({"description": t.description} if t.description else {}),
                                          "parameters": t.parameters}, ensure_ascii=False) for t in self.offered)
        many = "One block per call.\n" if self.parallel else ""
        return FALLBACK_PROMPT.format(many=many, functions=functions)

    def as_template_tools(self) -> list[dict]:
        """The tools as chat templates read them (OpenAI's request shape)."""
        return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                  "parameters": t.parameters}} for t in self.offered]


# ---- the request ----------------------------------------------------------------------------

def parse_tool_use(body: dict) -> ToolUse | None:
    """The request's tool use, or None where the answer is plain text (no tools, or
    tool_choice none). A 400 naming the field for anything it cannot serve."""
    tools = _tools(body.get("tools"))
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    named = None
    if choice is None:
        choice = "auto" if tools else "none"
    elif isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise bad(f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or a named function; got {choice!r}",
                      "tool_choice")
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        named = choice["function"].get("name")
        if not isinstance(named, str):
            raise bad("tool_choice.function.name must be a string", "tool_choice")
        if named not in {t.name for t in tools}:
            raise bad(f"tool_choice names {named!r}, which is not among the tools", "tool_choice")
        choice = "function"
    else:
        raise bad('tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
                  "tool_choice")
    if choice in ("required", "function") and not tools:
        raise bad(f"tool_choice {choice!r} needs tools", "tool_choice")
    if choice == "none" or not tools:
        return None
    return ToolUse(tools, choice, parallel is not False, named)


def _tools(value) -> tuple[Tool, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise bad("tools must be a list of function tools", "tools")
    out, names = [], set()
    for i, t in enumerate(value):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise bad(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}', "tools")
        f = t["function"]
        name = f.get("name")
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise bad(f"tools[{i}].function.name must be 1 to 64 letters, digits, _ or -; got {name!r}", "tools")
        if name in names:
            raise bad(f"tools[{i}]: two tools are named {name!r}", "tools")
        names.add(name)
        description = f.get("description")
        if description is not None and not isinstance(description, str):
            raise bad(f"tools[{i}].function.description must be a string", "tools")
        parameters = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise bad(f"tools[{i}].function.parameters must be a JSON Schema object", "tools")
        _check_schema(parameters, i)
        out.append(Tool(name, description, parameters))
    return tuple(out)


def _check_schema(schema: dict, i: int) -> None:
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise bad(f"tools[{i}].function.parameters is not a JSON Schema: {e.message}", "tools") from None


def parse_tool_messages(messages: list[dict], raw: list) -> list[dict]:
    """The conversation's tool turns: an assistant message's `tool_calls` (its content may be
    null) and a `tool` message's `tool_call_id`, checked and kept on the parsed messages."""
    out = []
    for i, (m, r) in enumerate(zip(messages, raw, strict=True)):
        m = dict(m)
        if m["role"] == "assistant" and r.get("tool_calls") is not None:
            m["tool_calls"] = _calls(r["tool_calls"], i)
        if m["role"] == "tool":
            if not isinstance(r.get("tool_call_id"), str):
                raise bad(f"messages[{i}]: a tool message needs its tool_call_id (a string)", "messages")
            m["tool_call_id"] = r["tool_call_id"]
        out.append(m)
    return out


def _calls(value, i: int) -> list[dict]:
    if not isinstance(value, list):
        raise bad(f"messages[{i}].tool_calls must be a list", "messages")
    calls = []
    for j, c in enumerate(value):
        f = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(f, dict) and isinstance(f.get("name"), str) and isinstance(f.get("arguments"), str)):
            raise bad(f"messages[{i}].tool_calls[{j}] must hold function.name and function.arguments (strings)",
                      "messages")
        try:
            arguments = json.loads(f["arguments"])
        except ValueError:
            raise bad(f"messages[{i}].tool_calls[{j}].function.arguments is not JSON", "messages") from None
        calls.append({"id": c.get("id"), "type": "function", "function": {"name": f["name"], "arguments": arguments}})
    return calls


def prompt_messages(messages: list[dict], use: ToolUse | None, template_renders_tools: bool) -> list[dict]:
    """The messages as the chat template gets them. A template that renders tools reads the
    tool turns' own fields; for one that does not, the tools are offered in a system message
    and earlier calls are written as the blocks the model answers with."""
    if template_renders_tools:
        return [{**m, "content": m["content"] or ""} for m in messages]
    out = []
    for m in messages:
        if m.get("tool_calls"):
            blocks = "\n".join(call_block(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"])
            out.append({"role": "assistant", "content": ((m["content"] or "") + blocks)})
        else:
            out.append({"role": m["role"], "content": m["content"] or ""})
    if use is not None:
        prompt = use.system_prompt()
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def call_block(name: str, arguments) -> str:
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False, separators=(", ", ": "))
    return CALL_OPEN + body + CALL_CLOSE


# ---- the answer -----------------------------------------------------------------------------

NAME_HEAD = re.compile(r'\{"name": ("(?:[^"\\]|\\.)*"), "arguments": ')
ARGS_END = "}" + CALL_CLOSE


@dataclass(slots=True)
class Call:
    id: str
    name: str
    arguments: list[str] = field(default_factory=list)
    whole: bool = False

    def as_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": "".join(self.arguments)}}


class CallReader:
    """Reads one choice's text as it streams: plain text, or call blocks turned into
    tool_calls deltas (the first delta of a call carries its index, id and name; later ones
    its arguments, piece by piece, under the same index). Text that could still open a block
    is held back until it cannot."""

    def __init__(self):
        self.mode = "undecided"  # -> text | calls
        self.calls: list[Call] = []
        self._buf = ""
        self._at = 0  # how far the calls text has been read
        self._args_at: int | None = None  # where the open call's arguments begin

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """The content and the tool_calls delta entries that `text` releases."""
        if self.mode == "text":
            return text, []
        self._buf += text
        if self.mode == "undecided":
            if self._buf.startswith(CALL_OPEN):
                self.mode = "calls"
            elif CALL_OPEN.startswith(self._buf):
                return "", []
            else:
                self.mode = "text"
                return self._buf, []
        return "", list(self._read_calls())

    def finish(self) -> str:
        """Text still held back when the answer ended (a start of a block that never came)."""
        return self._buf if self.mode == "undecided" else ""

    @property
    def made_calls(self) -> bool:
        return bool(self.calls) and all(c.whole for c in self.calls)

    def _read_calls(self) -> Iterator[dict]:
        while True:
            if self._args_at is None:
                rest = self._buf[self._at:]
                if rest.startswith("\n"):
                    self._at += 1
                    rest = rest[1:]
                if not rest.startswith(CALL_OPEN):
                    return
                head = NAME_HEAD.match(rest, len(CALL_OPEN))
                if head is None:
                    return
                call = Call("call_" + uuid.uuid4().hex[:24], json.loads(head.group(1)))
                self.calls.append(call)
                self._args_at = self._at + head.end()
                yield {"index": len(self.calls) - 1, "id": call.id, "type": "function",
                       "function": {"name": call.name, "arguments": ""}}
            call, args = self.calls[-1], self._buf[self._args_at:]
            end = args.find(ARGS_END)
            ready = args[:end] if end >= 0 else args[: len(args) - _held(args)]
            piece = ready[len("".join(call.arguments)):]
            if piece:
                call.arguments.append(piece)
                yield {"index": len(self.calls) - 1, "function": {"arguments": piece}}
            if end < 0:
                return
            call.whole = True
            self._at = self._args_at + end + len(ARGS_END)
            self._args_at = None


def _held(args: str) -> int:
    """How many characters at the end of `args` could be the start of the block's end."""
    for n in range(min(len(args), len(ARGS_END)), 0, -1):
        if ARGS_END.startswith(args[-n:]):
            return n
    return 0
