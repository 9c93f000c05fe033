"""Tokens fed per step, as a histogram split by whether any row in the step was decoding.

A step beside decoding rows must keep to the plan's token budget and one without may take
the idle budget; both budgets are bucket bounds, so a scrape shows at once whether any step
went over (vLLM exports tokens per iteration the same way)."""

from __future__ import annotations

from .histogram import Histogram
from .plan import Plan


class StepTokens:
    def __init__(self, plan: Plan):
        bounds = {plan.token_budget, plan.max_step_tokens}
        b = 1
        while b < plan.max_step_tokens:
            bounds.add(b)
            b *= 2
        self.bounds = sorted(bounds)
        self._tokens = {kind: Histogram(self.bounds, zero=0) for kind in ("decoding", "idle")}

    def observe(self, tokens: int, decoding: bool) -> None:
        self._tokens["decoding" if decoding else "idle"].observe(tokens)

    def snapshot(self) -> dict:
        """{"bounds": [...], kind: {"buckets": cumulative counts per bound, "count", "sum"}}."""
        return {"bounds": list(self.bounds), **{kind: h.snapshot() for kind, h in self._tokens.items()}}
