"""Speculative decoding: a draft policy that the driver owns, not a branch of the loop.

Each step the scheduler asks the driver's policy for a decoding row's drafts, feeds
[last token, *drafts] at the row's next positions and asks logits at every fed position.
The model scores all k+1 positions in the same forward as the other rows' decode tokens
and prefill chunks (a row fed more than one token takes the causal-attention path, which
is exactly verification). The commit then keeps the drafts the target agrees with and one
more token from the target, applying EOS, stop strings and max_tokens token by token, and
a row's KV length advances only over what was kept: the rejected positions are rolled back
by never being counted (later steps overwrite them).

Verification, per position i with draft d_i, from the target's logits there:
- greedy: the target's argmax; the draft is accepted when it equals it. The committed
  tokens are the ones plain greedy decoding would pick.
- sampling: standard rejection sampling. For a deterministic draft the draft distribution q
  is a point mass on d, so the rule "accept d with probability min(1, p(d)/q(d)) = p(d); on
  rejection draw from norm(max(0, p - q)) = p with d removed, renormalized" is exactly what
  Engine._keep does: draw x from p by inverse CDF with one uniform u
  (sampler.sample), and accept iff x == d. The event x == d has probability p(d), and given x != d, u is uniform over the
  rest of [0, 1), so x is distributed as p without d, renormalized. Each committed token
  draws the uniform at its own output index from the request's counter-based stream
  (engine/random_stream.py), as plain decoding does, and a rejected position's draw is
  simply never used, so a seeded request gives the same tokens with speculation on or off.

A policy only proposes; the scheduler still caps every row's drafts at the step's budget
and at max_tokens - len(output) - 1, so a round never writes past the positions reserved at
open (prompt + max_tokens) and never commits more than max_tokens.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

__all__ = ["DraftPolicy", "NgramPolicy", "POLICIES", "make_draft_policy"]


class DraftPolicy(ABC):
    """Proposes a decoding row's next tokens. Drafts may depend on the sequence so far (its
    tokens, how its earlier rounds went) but never on the random numbers of the round they
    are verified in, which rejection sampling needs."""

    name: str = ""

    @abstractmethod
    def propose(self, seq, room: int, num_decoding_rows: int) -> list[int]:
        """Drafts for the tokens after `seq.tokens`: at most `room` of them (the step's token
        budget left). `num_decoding_rows` lets a policy draft less when the batch is full."""


class NgramPolicy(DraftPolicy):
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens
    (longest n first, from max_ngram down to min_ngram) in its prompt and output, and
    propose the tokens that followed it. No second model.

    A verified round costs more than a plain decode step (on the NumPy driver, one row fed
    k+1 tokens: about 1.6x a one-token step for one draft, 2.3x for eight; measured by
    benchmarks/bench_speculative.py), so a round pays only when most of its drafts are
    accepted: at that cost, a per-draft acceptance under about 0.6 loses. Three rules keep
    the loss small where nothing is quoted:
    - backoff: after a round that accepted less than `min_acceptance` of its drafts, a row
      drafts again only after 1, 2, 4, ... (at most max_backoff) plain steps; a round that
      accepted enough resets it;
    - a full batch drafts less: from `full_rows` decoding rows on, the step is bound by
      arithmetic rather than by reading the weights, so a draft costs about as much as the
      token it may save; there a row drafts at most `full_drafts` tokens, and only on a
      match of at least `full_min_ngram` tokens (0 drafts: plain decoding at full rows);
    - only matches of at least `min_ngram` tokens are drafted from.
    Measurements: benchmarks/bench_speculative.py.
    """

    name = "ngram"

    def __init__(self, max_drafts: int = 10, min_ngram: int = 3, max_ngram: int = 4,
                 full_rows: int = 4, full_drafts: int = 0, full_min_ngram: int = 3, max_backoff: int = 32,
                 min_acceptance: float = 0.5):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_drafts = max_drafts
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.full_rows = full_rows  # from this many decoding rows on, the batch counts as full
        self.full_drafts = full_drafts
        self.full_min_ngram = max(full_min_ngram, min_ngram)
        self.max_backoff = max_backoff
        self.min_acceptance = min_acceptance  # a round accepting less of its drafts is a miss
        # request id -> (output length when it last drafted, drafts then, consecutive misses,
        # output length from which it may draft again); bounded, oldest dropped first
        self._rows: dict[int, tuple[int, int, int, int]] = {}

    def limits(self, num_decoding_rows: int) -> tuple[int, int]:
        """(most drafts per row, shortest match drafted from) at this many decoding rows."""
        if num_decoding_rows >= self.full_rows:
            return self.full_drafts, self.full_min_ngram
        return self.max_drafts, self.min_ngram

    def propose(self, seq, room: int, num_decoding_rows: int) -> list[int]:
        k, min_n = self.limits(num_decoding_rows)
        k = min(k, room, seq.params.max_tokens - len(seq.output) - 1)
        if k <= 0:
            return []
        now = len(seq.output)
        last_len, last_k, misses, resume = self._rows.get(seq.request_id, (-1, 0, 0, 0))
        if last_k and last_len >= 0 and now > last_len:  # the outcome of its last round
            accepted = now - last_len - 1  # committed tokens less the target's own one
            if accepted == 0 or accepted < self.min_acceptance * last_k:
                misses += 1
                resume = now + min(2 ** (misses - 1), self.max_backoff)
            else:
                misses = 0
            last_k = 0
            self._remember(seq.request_id, (last_len, 0, misses, resume))
        if now < resume:
            return []
        drafts = lookup(seq.tokens, k, min_n, self.max_ngram)
        if drafts:
            self._remember(seq.request_id, (now, len(drafts), misses, resume))
        return drafts

    def _remember(self, request_id: int, state: tuple[int, int, int, int]) -> None:
        self._rows.pop(request_id, None)
        self._rows[request_id] = state
        if len(self._rows) > 4096:
            del self._rows[next(iter(self._rows))]


def lookup(tokens: list[int], k: int, min_ngram: int, max_ngram: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of
    `tokens` (max_ngram down to min_ngram long) that occurs earlier; [] when none does."""
    length = len(tokens)
    if length < min_ngram + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = arr[length - n :]
        # Windows starting at 0 .. length-n-1: each is followed by at least one token.
        windows = np.lib.stride_tricks.sliding_window_view(arr[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return arr[start : start + k].tolist()
    return []


POLICIES = {"ngram": NgramPolicy}


def make_draft_policy(name: str, **options) -> DraftPolicy:
    """The draft policy for `poot-serve --draft NAME` (none: no policy, plain decoding)."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown draft policy {name!r}; this build has: none, {', '.join(POLICIES)}") from None
    return cls(**options)
