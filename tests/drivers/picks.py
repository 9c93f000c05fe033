"""Steps whose rows are marked for picking on the device, and what the host's sampler
picks from the same logits: shared by the device drivers' tests."""

from __future__ import annotations

from poot.engine import SamplingParams, sampler
from poot.engine.random_stream import random_stream
from poot.engine.step import Pick, RowWork

PICKED = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8), SamplingParams(temperature=1.2, top_k=5),
          SamplingParams(temperature=1.0, top_p=0.7), SamplingParams(temperature=0.9, top_k=20, top_p=0.9),
          SamplingParams(temperature=1.5, top_k=100_000, top_p=0.95)]


def with_picks(steps, seed=0, host_every=5):
    """The steps with each row's tokens marked for the device, cycling through PICKED and
    leaving every `host_every`-th row to the host; each row draws at its own counter."""
    marked, n = [], 0
    for batch in steps:
        out = []
        for w in batch:
            params = PICKED[n % len(PICKED)]
            pick = None if n % host_every == host_every - 1 else Pick(params, random_stream(seed + n, n % 3), 7 * n)
            out.append(RowWork(w.row, w.tokens, w.start, w.block_table, w.num_logits, pick))
            n += 1
        marked.append(out)
    return marked


def host_picks(logits, batch):
    """What the host's sampler picks from a step's full logits, per logit index (-1: unmarked)."""
    ids, i = [], 0
    for w in batch:
        for j in range(w.num_logits):
            ids.append(-1 if w.pick is None else sampler.sample(logits[i + j], w.pick.params, w.pick.uniform(j)))
        i += w.num_logits
    return ids
