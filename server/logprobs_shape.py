"""The two OpenAI shapes of token log-probabilities, built from the engine's events.

Completions (legacy): {"tokens", "token_logprobs", "top_logprobs", "text_offset"}, parallel
lists; each top_logprobs entry maps token text to logprob and always holds the picked token
(so up to logprobs + 1 entries); text_offset is each token's character offset in the
choice's text, counted across a stream's chunks; an echoed prompt's first token has null
logprob and null top_logprobs.

Chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
"bytes"}]}]}, top_logprobs holding exactly the asked number, most likely first.

A token's text is what the tokenizer decodes it to alone; bytes are that text's UTF-8 (a
token holding part of a character decodes to U+FFFD). Logprobs of -inf (a masked token) are
sent as -9999.0, as vLLM does, since JSON has no infinity.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import lru_cache

FLOOR = -9999.0

Top = Sequence[tuple[int, float]]


def _finite(lp: float) -> float:
    return lp if math.isfinite(lp) and lp > FLOOR else FLOOR


class TokenTexts:
    def __init__(self, decode: Callable[[Sequence[int]], str]):
        self.text = lru_cache(maxsize=65536)(lambda token: decode([token]))


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
        return {"token": s, "logprob": _finite(lp), "bytes": list(s.encode("utf-8"))}

    return [{**entry(t, lp), "top_logprobs": [entry(a, p) for a, p in top]}
            for t, lp, top in zip(tokens, logprobs, tops, strict=True)]
