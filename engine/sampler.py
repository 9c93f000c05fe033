"""Picks the next token of a row from its logits: greedy, or temperature with top-k and top-p.

A sampled token takes one uniform from the request's counter-based stream
(engine/random_stream.py), the draw at its own place (k = the outputs before it), so a
sampled output does not depend on which other requests share the batch, on speculation, or
on the backend: a driver that picks on its device computes this same function
(engine/drivers/wgsl.py's PICK, in float32).

The rules, in order: top-k keeps every token whose logit is at least the k-th largest (ties
with it included); temperature scales what is left, softmax; top-p keeps every token whose
strictly more likely tokens hold less than top_p of the mass (so tied tokens are kept or
cut together, as for top-k, and the kept set is the smallest whole probability levels that
reach top_p); the token is the inverse CDF of the uniform over the kept, renormalized
probabilities, in token id order.
"""

from __future__ import annotations

import numpy as np

from .params import SamplingParams


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution a sampled token is drawn from (float64, sums to 1)."""
    z = logits.astype(np.float64)
    if params.top_k and params.top_k < z.shape[-1]:
        kth = np.partition(z, -params.top_k)[-params.top_k]
        z = np.where(z >= kth, z, -np.inf)
    p = np.exp((z - z.max()) / max(params.temperature, 1e-6))
    p /= p.sum()
    if params.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        ranked = p[order]
        ahead = np.cumsum(ranked) - ranked  # the mass ranked before each token
        level = np.searchsorted(-ranked, -ranked, side="left")  # where each token's tie starts
        mask = np.zeros_like(p, dtype=bool)
        mask[order[ahead[level] < params.top_p]] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return p


def sample(logits: np.ndarray, params: SamplingParams, u: float) -> int:
    """The token the uniform `u` (in [0, 1)) picks; greedy ignores it."""
    if params.greedy:
        return int(np.argmax(logits))
    p = probabilities(logits, params)
    index = int(np.searchsorted(np.cumsum(p), u, side="right"))
    if index >= len(p):  # rounding left the uniform past the last cumulative sum
        index = int(np.flatnonzero(p)[-1])
    return index


def logprob(logits: np.ndarray, token: int) -> float:
    z = logits.astype(np.float64)
    m = z.max()
    return float(z[token] - m - np.log(np.exp(z - m).sum()))
