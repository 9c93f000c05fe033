"""Picks each row's next token: logits processors, the row's grammar (engine/grammar.py: the
tokens it does not allow next go to -inf), then the sampler, then (when asked) logprobs.

One component, so the loop calls it for every committed position, greedy or sampled, plain
or speculative. A row that needs nothing but the sampler (no logprobs, no logits processor
acting, no prompt to score: the plain case) may be picked by the driver, where its logits
are: `device_pick` says so, and the driver then applies this same sampler (on the host, or
the same function in a device kernel) with the same stream.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import numpy as np

from . import logits_processors, sampler
from .logprobs import TokenLogprob, token_logprob
from .sequence import Sequence
from .step import Pick


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
        if seq.grammar is not None:
            z = seq.grammar.mask(z)
        token = sampler.sample(z, params, 0.0 if params.greedy else seq.stream.uniform(len(seq.output)))
        if params.logprobs is None:
            return Picked(token)
        return Picked(token, token_logprob(z, token, params.logprobs))

    def device_pick(self, seq: Sequence) -> Pick | None:
        """How the driver may pick the row's next tokens in this step, or None when the host
        needs its logits (logprobs, a logits processor acting, a grammar, a prompt being scored)."""
        params = seq.params
        if params.logprobs is not None or logits_processors.is_active(params, len(seq.output)) or \
                seq.grammar is not None:
            return None
        if seq.prefilling and params.prompt_logprobs is not None:
            return None
        return Pick(params, seq.stream, len(seq.output))
