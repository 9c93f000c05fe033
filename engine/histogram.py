"""A histogram of observations: a count per bucket, their sum and the largest.

One type for every histogram /metrics exports: the engine's step durations and step token
counts, and the server's event loop lag. Buckets are by upper bound, a value on a bound
counting in that bound's bucket (Prometheus's `le`); `cumulative` gives them as Prometheus
exports them, the +Inf bucket being `count`."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence


class Histogram:
    def __init__(self, bounds: Sequence[float], zero: float = 0.0):
        """`zero`: the sum and the largest before any observation, of the observations' type
        (0 for token counts), so an empty histogram reads as a full one would."""
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket, not cumulative; the last is above every bound
        self.sum = zero
        self.max = zero

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.max = max(self.max, value)

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[int]:
        """Observations at or below each bound."""
        out, total = [], 0
        for c in self.counts[:-1]:
            total += c
            out.append(total)
        return out

    def snapshot(self) -> dict:
        """{"buckets": cumulative counts per bound, "count", "sum"}."""
        return {"buckets": self.cumulative(), "count": self.count, "sum": self.sum}
