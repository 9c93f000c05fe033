"""The rules that reshape a row's logits before a token is picked from them.

Penalties, logit bias and the minimum length run here, on the host, on the float32 logits
every driver returns, so they act the same for greedy and sampled requests and on every
backend. A request that asks for none of them gets its logits back untouched (no copy).

- repetition_penalty (r): each token seen in the prompt or the output has its logit divided
  by r when positive and multiplied by r when negative (the CTRL rule, as vLLM and
  transformers apply it);
- frequency_penalty (f) and presence_penalty (p): a token that occurs c times in the output
  loses f * c + p (the OpenAI rule; the prompt does not count);
- logit_bias: added to the named tokens' logits;
- min_tokens: end-of-sequence (unless ignore_eos) and stop_token_ids are masked to -inf
  until the output holds min_tokens tokens. Stop strings still apply.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np

from .params import InvalidRequest, SamplingParams


def is_active(params: SamplingParams, num_output: int) -> bool:
    return bool(params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0
                or params.logit_bias or num_output < params.min_tokens)


def apply(logits: np.ndarray, params: SamplingParams, prompt: Sequence[int], output: Sequence[int],
          eos_ids: Collection[int]) -> np.ndarray:
    """The logits the token is picked from: `logits` itself when no rule applies, else a copy."""
    if not is_active(params, len(output)):
        return logits
    z = np.array(logits, dtype=np.float32)
    if params.repetition_penalty != 1.0:
        seen = np.unique(np.fromiter((*prompt, *output), np.int64))
        v = z[seen]
        z[seen] = np.where(v > 0, v / params.repetition_penalty, v * params.repetition_penalty)
    if output and (params.presence_penalty or params.frequency_penalty):
        ids, counts = np.unique(np.asarray(output, np.int64), return_counts=True)
        z[ids] -= np.float32(params.frequency_penalty) * counts.astype(np.float32) + np.float32(params.presence_penalty)
    if params.logit_bias:
        ids = np.array([t for t, _ in params.logit_bias], np.int64)
        np.add.at(z, ids, np.array([b for _, b in params.logit_bias], np.float32))
    if len(output) < params.min_tokens:
        banned = list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_ids))
        if banned:
            z[np.asarray(banned, np.int64)] = -np.inf
    return z


def check_vocab(params: SamplingParams, vocab_size: int) -> None:
    """Token ids the rules name must be in the vocabulary; checked when the job is taken."""
    if any(t >= vocab_size for t, _ in params.logit_bias):
        raise InvalidRequest(f"logit_bias names a token id outside [0, {vocab_size})", "logit_bias")
    if any(t >= vocab_size for t in params.stop_token_ids):
        raise InvalidRequest(f"stop_token_ids holds a token id outside [0, {vocab_size})", "stop_token_ids")
