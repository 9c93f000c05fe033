"""Picks the next token of a row from its logits: greedy, or temperature with top-k and top-p.

Each request carries its own random generator, seeded from the request's seed when given,
so a sampled output does not depend on which other requests share the batch.
"""

from __future__ import annotations

import numpy as np

from .params import SamplingParams


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution a sampled token is drawn from (float64, sums to 1)."""
    z = logits.astype(np.float64) / max(params.temperature, 1e-6)
    if params.top_k and params.top_k < z.shape[-1]:
        kth = np.partition(z, -params.top_k)[-params.top_k]
        z = np.where(z >= kth, z, -np.inf)
    z -= z.max()
    p = np.exp(z)
    p /= p.sum()
    if params.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        keep = cum - p[order] < params.top_p  # smallest set whose mass reaches top_p
        mask = np.zeros_like(p, dtype=bool)
        mask[order[keep]] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return p


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    if params.greedy:
        return int(np.argmax(logits))
    p = probabilities(logits, params)
    # Inverse-CDF with one uniform per token keeps a seeded stream reproducible.
    index = int(np.searchsorted(np.cumsum(p), rng.random(), side="right"))
    if index >= len(p):  # rounding left the uniform past the last cumulative sum
        index = int(np.flatnonzero(p)[-1])
    return index


def logprob(logits: np.ndarray, token: int) -> float:
    z = logits.astype(np.float64)
    m = z.max()
    return float(z[token] - m - np.log(np.exp(z - m).sum()))
