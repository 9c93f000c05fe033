"""Constrained decoding: what a request's output must match (any JSON object, a JSON schema,
or a grammar in llguidance's Lark dialect, which server/tools.py builds for tool calls),
compiled by llguidance, and each choice's matcher, which says which tokens may come
next and follows the tokens the row keeps.

Three parts, so that nothing slow runs on the engine thread:
- `Grammars` (one per served tokenizer): the vocabulary as llguidance sees it, built once,
  and the compiled grammars, kept by their source (a schema sent again is not compiled again);
- `Grammar`: one compiled, checked grammar; `matcher()` makes a fresh matcher from it, a copy
  of one started at compile (the server makes one per choice, off the engine thread, before
  it submits the request);
- `Matcher`: one row's state. The picker masks the row's logits with `mask()` (every token
  the grammar does not allow next goes to -inf), and the loop feeds it each kept token
  (`consume`). Once the document is whole (nothing but end-of-sequence could follow),
  `done` says the request has ended: no step is spent picking end-of-sequence.

JSON is compact with one space after `,` and `:` (llguidance's `whitespace_flexible` off):
with free whitespace a small model can spend its whole max_tokens on newlines. A schema that
uses what llguidance does not implement is refused (not "lenient"), as is one it cannot
compile: an InvalidRequest naming `response_format` (or the field a Lark grammar was built
from).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .params import InvalidRequest

# The JSON compiler's settings for every grammar poot builds from a schema.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": False}
KEPT_GRAMMARS = 256  # compiled grammars kept per tokenizer, least recently used out first
PARAM = "response_format"


class Matcher:
    """One choice's place in its grammar."""

    __slots__ = ("_matcher", "_bits", "vocab_size")

    def __init__(self, matcher, vocab_size: int):
        self._matcher = matcher
        self.vocab_size = vocab_size
        self._bits = np.empty((1, (vocab_size + 31) // 32), np.int32)

    def allowed(self) -> np.ndarray:
        """Which token ids may come next (bool, one per token of the vocabulary)."""
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(self._matcher, self._bits)
        return np.unpackbits(self._bits.view(np.uint8), bitorder="little", count=self.vocab_size).view(bool)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """The logits with every token the grammar does not allow next at -inf (a copy). Logits
        past the tokenizer's vocabulary (a model's padded head) are never allowed."""
        n = min(len(logits), self.vocab_size)
        allowed = np.where(self.allowed()[:n], logits[:n], np.float32(-np.inf))
        if n == len(logits):
            return allowed
        return np.concatenate([allowed, np.full(len(logits) - n, -np.inf, np.float32)])

    def consume(self, token: int) -> None:
        """Follows a kept token. A token the grammar did not allow (it never is: the mask rules
        it out) puts the matcher in its error state, which `done` reports as an end."""
        self._matcher.consume_token(int(token))

    @property
    def done(self) -> bool:
        """The output is whole (end-of-sequence kept) or cannot go on: the request ends."""
        return self._matcher.is_stopped() or self._matcher.is_error()

    def error(self) -> str:
        return self._matcher.get_error() if self._matcher.is_error() else ""


class Grammar:
    """A compiled, checked grammar; `matcher()` starts one choice on it.

    Compiling keeps a started matcher that never moves: llguidance builds a grammar's parser
    against the vocabulary when a matcher is made (half a second for a large schema), and a
    copy of a started one costs microseconds, so each choice's matcher is a copy."""

    __slots__ = ("source", "param", "_started", "_vocab_size")

    def __init__(self, source: str, started, vocab_size: int, param: str = PARAM):
        self.source = source  # what it was compiled from, for logs
        self.param = param  # the request field it was built from
        self._started = started  # llguidance's LLMatcher, never advanced
        self._vocab_size = vocab_size

    def matcher(self) -> Matcher:
        return Matcher(self._started.deep_copy(), self._vocab_size)


class Grammars:
    """The grammars of one tokenizer. Thread-safe: the server compiles on its worker threads."""

    def __init__(self, tokenizer, start: Callable[[Callable[[], Any]], Any] | None = None):
        """`tokenizer`: the model's (HFTokenizer, or any with eos_token_ids, bos_token_id and
        either to_json() or token_bytes()). `start(work)` runs the long part of a compile, the
        grammar's parser built against the vocabulary (native code, the GIL released), and
        returns its result: by default on the calling thread; the server runs it on a thread
        below the engine's priority."""
        self._source_tokenizer = tokenizer
        self._start = start or (lambda work: work())
        self._tokenizer = None
        self._unreadable: str | None = None  # why llguidance could not read the vocabulary
        self._kept: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()

    def json_object(self) -> Grammar:
        """Any JSON object (response_format json_object)."""
        return self.json_schema({"type": "object"})

    def json_schema(self, schema: dict) -> Grammar:
        """The documents `schema` accepts; InvalidRequest naming response_format when it is
        not a schema llguidance can compile."""
        if not isinstance(schema, dict):
            raise InvalidRequest(f"{PARAM}.json_schema.schema must be a JSON object (a JSON Schema)", PARAM)
        try:
            # the schema's own key order: properties are written in the order it names them
            source = json.dumps(closed(schema), separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as e:
            raise InvalidRequest(f"{PARAM}.json_schema.schema is not JSON: {e}", PARAM) from None
        return self._kept_or_compiled("json:" + source, lambda: self._compile_json(source))

    def lark(self, text: str, param: str) -> Grammar:
        """A grammar in llguidance's Lark dialect (which may embed JSON schemas with %json);
        InvalidRequest naming `param`, the request field it was built from, when it cannot
        be compiled."""
        return self._kept_or_compiled("lark:" + text, lambda: self._compile_lark(text, param))

    def _kept_or_compiled(self, key: str, compile) -> Grammar:
        with self._lock:
            kept = self._kept.get(key)
            if kept is not None:
                self._kept.move_to_end(key)
                return kept
        grammar = compile()
        with self._lock:
            self._kept[key] = grammar
            while len(self._kept) > KEPT_GRAMMARS:
                self._kept.popitem(last=False)
        return grammar

    def _compile_json(self, source: str) -> Grammar:
        from llguidance import LLMatcher

        self.tokenizer()  # an unreadable vocabulary is refused before any compile
        try:
            text = LLMatcher.grammar_from_json_schema(source, defaults=JSON_OPTIONS)
        except ValueError as e:
            raise InvalidRequest(f"{PARAM}: the schema cannot be compiled: {_one_line(e)}", PARAM) from None
        return self._checked(source, text, PARAM, "the schema")

    def _compile_lark(self, source: str, param: str) -> Grammar:
        from llguidance import LLMatcher

        self.tokenizer(param)
        try:
            text = LLMatcher.grammar_from_lark(source)
        except ValueError as e:
            raise InvalidRequest(f"{param}: the grammar built from it cannot be compiled: {_one_line(e)}",
                                 param) from None
        return self._checked(source, text, param, "the grammar built from it")

    def _checked(self, source: str, text: str, param: str, what: str) -> Grammar:
        """The grammar started against the vocabulary once, which checks it too."""
        from llguidance import LLMatcher

        tokenizer = self.tokenizer(param)
        started = self._start(lambda: LLMatcher(tokenizer, text, log_level=0))
        if started.is_error():
            raise InvalidRequest(f"{param}: {what} cannot be compiled: {_one_line(started.get_error())}", param)
        return Grammar(source, started, tokenizer.vocab_size, param)

    def tokenizer(self, param: str = PARAM):
        """llguidance's view of the vocabulary, built at first use (about 0.36 s for SmolLM2's,
        holding the GIL); InvalidRequest naming response_format where it cannot be built."""
        with self._lock:
            if self._tokenizer is None and self._unreadable is None:
                try:
                    self._tokenizer = _ll_tokenizer(self._source_tokenizer)
                except Exception as e:  # the vocabulary comes from a model file: untrusted
                    self._unreadable = _one_line(e)
            if self._tokenizer is None:
                raise InvalidRequest(f"{param}: constrained decoding is unavailable for this model's tokenizer: "
                                     f"{self._unreadable}", param)
            return self._tokenizer


SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
SCHEMA_VALUES = ("items", "additionalItems", "additionalProperties", "contains", "not", "if", "then", "else",
                 "propertyNames", "unevaluatedItems", "unevaluatedProperties")


def closed(schema):
    """`schema` with no properties beyond those named, wherever an object schema names its
    properties and says nothing of others. Every answer is still a document the schema
    accepts; left open, a small model invents keys until max_tokens runs out."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key, value in schema.items():
        if key in SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: closed(sub) for name, sub in value.items()}
        elif key in SCHEMA_LISTS and isinstance(value, list):
            out[key] = [closed(sub) for sub in value]
        elif key in SCHEMA_VALUES:
            out[key] = closed(value)
    if isinstance(schema.get("properties"), dict) and not ({"additionalProperties", "patternProperties",
                                                             "unevaluatedProperties"} & schema.keys()):
        out["additionalProperties"] = False
    return out


def _ll_tokenizer(tokenizer):
    from llguidance import LLTokenizer, TokenizerWrapper

    eos = sorted(tokenizer.eos_token_ids)
    if hasattr(tokenizer, "to_json"):  # a Hugging Face tokenizer: llguidance reads its JSON
        return LLTokenizer(tokenizer.to_json(), eos_token=eos)
    return LLTokenizer(TokenizerWrapper(_ByteVocabulary(tokenizer)), eos_token=eos)


class _ByteVocabulary:
    """A tokenizer that knows each token's bytes (the synthetic models' byte tokenizer) in the
    shape llguidance's TokenizerWrapper reads."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.eos_token_id = min(tokenizer.eos_token_ids)
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens: Sequence[bytes] = [tokenizer.token_bytes(i) or f"<special {i}>".encode()
                                        for i in range(tokenizer.vocab_size)]
        self.special_token_ids = [i for i in range(tokenizer.vocab_size) if not tokenizer.token_bytes(i)]

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text)


def _one_line(e) -> str:
    return " ".join(str(e).split())[:300]
