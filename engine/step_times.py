"""How long each loop iteration took, as a histogram split by what its step carried.

A stream's gap between two tokens is one iteration (phases 1-5), so the histogram is of
whole iterations, by kind: "decode" (decoding rows only), "mixed" (decoding rows and prefill
chunks), "prefill" (prefill chunks only, nobody's next token waiting). The host's share of
each iteration (everything but the driver's step) is summed apart, so a scrape tells a slow
device from a slow loop."""

from __future__ import annotations

from .histogram import Histogram

KINDS = ("decode", "mixed", "prefill")
# Seconds: from a tiny model's millisecond steps to a stall anyone would notice.
BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


def kind_of(decoding: bool, prefilling: bool) -> str:
    if decoding and prefilling:
        return "mixed"
    return "decode" if decoding else "prefill"


class StepTimes:
    def __init__(self) -> None:
        self.bounds = BOUNDS
        self._seconds = {kind: Histogram(BOUNDS) for kind in KINDS}
        self._host = dict.fromkeys(KINDS, 0.0)

    def observe(self, kind: str, seconds: float, host_seconds: float) -> None:
        self._seconds[kind].observe(seconds)
        self._host[kind] += host_seconds

    def snapshot(self) -> dict:
        """{"bounds": [...], kind: {"buckets": cumulative counts, "count", "sum", "host_sum", "max"}}."""
        out: dict = {"bounds": list(self.bounds)}
        for kind, h in self._seconds.items():
            out[kind] = {**h.snapshot(), "host_sum": self._host[kind], "max": h.max}
        return out
