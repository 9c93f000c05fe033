"""Log-probabilities of picked tokens and of prompt tokens, for the requests that ask.

Which distribution: the one the token was picked from after the logits processors
(penalties, logit bias, min_tokens) and before temperature, top-k and top-p. A greedy
token is the argmax of exactly these logits, so its logprob is the largest of its
alternatives'; and the figures do not change with the temperature a client samples at
(vLLM documents the same kind of choice through its logprobs mode, whose default is the
raw logits before any processing). Prompt tokens (echo) are scored on the raw logits: no
processor has anything to act on there.

Computed in float32 with a log-softmax that subtracts the row's maximum before exp, so no
logit is large enough to overflow and -inf entries (masked tokens) give -inf.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the k most likely tokens, most likely first


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, dtype=np.float32)
    shifted = z - z.max()
    return shifted - np.log(np.exp(shifted).sum(dtype=np.float32))


def token_logprob(logits: np.ndarray, token: int, k: int) -> TokenLogprob:
    lp = log_softmax(logits)
    top: tuple[tuple[int, float], ...] = ()
    if k:
        k = min(k, lp.shape[-1])
        idx = np.argpartition(-lp, k - 1)[:k]
        idx = idx[np.lexsort((idx, -lp[idx]))]  # most likely first; ties by lower id, as argmax picks
        top = tuple((int(i), float(lp[i])) for i in idx)
    return TokenLogprob(int(token), float(lp[token]), top)


def score_prompt(rows: np.ndarray, prompt: Sequence[int], start: int, k: int) -> list[TokenLogprob]:
    """Row i holds the logits after position start + i; it scores prompt[start + i + 1]."""
    return [token_logprob(rows[i], prompt[start + i + 1], k)
            for i in range(len(rows)) if start + i + 1 < len(prompt)]
