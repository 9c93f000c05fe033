"""Picks each row's next token: logits processors, then the sampler, then (when asked) logprobs.

One component with one method, so the loop calls it for every committed position, greedy or
sampled, plain or speculative.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import numpy as np

from . import logits_processors, sampler
from .logprobs import TokenLogprob, token_logprob
from .sequence import Sequence


@dataclass(slots=True, frozen=True)
class Picked:
    token: int
    logprob: TokenLogprob | None = None  # only when the request asked for logprobs


class Picker:
    def __init__(self, eos_ids: Collection[int]):
        self.eos_ids = frozenset(eos_ids)

    def pick(self, logits: np.ndarray, seq: Sequence) -> Picked:
        params = seq.params
        z = logits_processors.apply(logits, params, seq.prompt, seq.output, self.eos_ids)
        token = sampler.sample(z, params, 0.0 if params.greedy else seq.stream.uniform(len(seq.output)))
        if params.logprobs is None:
            return Picked(token)
        return Picked(token, token_logprob(z, token, params.logprobs))
