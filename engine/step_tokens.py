"""Tokens fed per step, as a histogram split by whether any row in the step was decoding.

A step beside decoding rows must keep to the plan's token budget and one without may take
the idle budget; both budgets are bucket bounds, so a scrape shows at once whether any step
went over (vLLM exports tokens per iteration the same way)."""

from __future__ import annotations

from bisect import bisect_left

from .plan import Plan


class StepTokens:
    def __init__(self, plan: Plan):
        bounds = {plan.token_budget, plan.max_step_tokens}
        b = 1
        while b < plan.max_step_tokens:
            bounds.add(b)
            b *= 2
        self.bounds = sorted(bounds)
        # per kind: observations in each bucket (not cumulative; the last is above every bound)
        self._counts = {kind: [0] * (len(self.bounds) + 1) for kind in ("decoding", "idle")}
        self._sums = {"decoding": 0, "idle": 0}

    def observe(self, tokens: int, decoding: bool) -> None:
        kind = "decoding" if decoding else "idle"
        self._counts[kind][bisect_left(self.bounds, tokens)] += 1
        self._sums[kind] += tokens

    def snapshot(self) -> dict:
        """{"bounds": [...], kind: {"buckets": cumulative counts per bound, "count", "sum"}}."""
        out: dict = {"bounds": list(self.bounds)}
        for kind, counts in self._counts.items():
            cumulative, total = [], 0
            for c in counts[:-1]:
                total += c
                cumulative.append(total)
            out[kind] = {"buckets": cumulative, "count": total + counts[-1], "sum": self._sums[kind]}
        return out
