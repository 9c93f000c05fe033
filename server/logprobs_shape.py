"""The two OpenAI shapes of token log-probabilities, built from the engine's events.

Completions (legacy): {"tokens", "token_logprobs", "top_logprobs", "text_offset"}, parallel
lists; each top_logprobs entry maps token text to logprob and always holds the picked token
(so up to logprobs + 1 entries); text_offset is each token's character offset in the
choice's text, counted across a stream's chunks; an echoed prompt's first token has null
logprob and null top_logprobs.

Chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
"bytes"}]}]}, top_logprobs holding exactly the asked number, most likely first.

A token's text is what the tokenizer decodes it to alone; bytes are that text's UTF-8, or,
for a token holding part of a character (whose text is U+FFFD), the token's own bytes. Logprobs of -inf (a masked token) are
sent as -9999.0, as vLLM does, since JSON has no infinity.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

FLOOR = -9999.0

Top = Sequence[tuple[int, float]]


def _finite(lp: float) -> float:
    return lp if math.isfinite(lp) and lp > FLOOR else FLOOR


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character a vocabulary piece uses -> its byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


BYTE_LEVEL = _byte_level_decoder()


class TokenTexts:
    """Each token's text (decoded alone) and bytes. A token holding part of a character
    decodes to U+FFFD; its bytes then come from its byte-level vocabulary piece when the
    tokenizer has one."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.text = lru_cache(maxsize=65536)(lambda token: tokenizer.decode([token]))
        self.bytes = lru_cache(maxsize=65536)(self._bytes)

    def _bytes(self, token: int) -> bytes:
        text = self.text(token)
        if "\ufffd" not in text:
            return text.encode("utf-8")
        own = getattr(self.tokenizer, "token_bytes", None)
        if own is not None:
            return own(token)
        piece = getattr(self.tokenizer, "id_to_token", lambda _: None)(token)
        if piece and all(c in BYTE_LEVEL for c in piece):
            return bytes(BYTE_LEVEL[c] for c in piece)
        return text.encode("utf-8")


class CompletionLogprobs:
    """Accumulates one choice's completions-shaped logprobs; `offset` runs across chunks."""

    def __init__(self, texts: TokenTexts, offset: int = 0):
        self.texts = texts
        self.offset = offset

    def shape(self, tokens: Sequence[int], logprobs: Sequence[float | None], tops: Sequence[Top]) -> dict:
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, lp, top in zip(tokens, logprobs, tops, strict=True):
            s = self.texts.text(token)
            out["tokens"].append(s)
            out["text_offset"].append(self.offset)
            self.offset += len(s)
            if lp is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(_finite(lp))
            alternatives = {self.texts.text(t): _finite(p) for t, p in top}
            alternatives.setdefault(s, _finite(lp))
            out["top_logprobs"].append(alternatives)
        return out


def merge_completion(parts: list[dict]) -> dict | None:
    if not parts:
        return None
    return {key: [v for p in parts for v in p[key]] for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def chat_content(texts: TokenTexts, tokens: Sequence[int], logprobs: Sequence[float], tops: Sequence[Top]) -> list[dict]:
    def entry(token: int, lp: float) -> dict:
        s = texts.text(token)
        return {"token": s, "logprob": _finite(lp), "bytes": list(texts.bytes(token))}

    return [{**entry(t, lp), "top_logprobs": [entry(a, p) for a, p in top]}
            for t, lp, top in zip(tokens, logprobs, tops, strict=True)]
