"""The driver interface: one implementation per backend.

A driver prepares every entry its steps will use once, in `prepare(plan)`, and counts each
build as a compile. A step takes plain host-side metadata and returns host-side logits; it
never builds another entry, whatever the batch looks like.

A driver fails in one of two ways, and the loop treats them differently:
- StepRefused: raised before anything ran; no state changed, only this step's requests fail.
- DeviceFault: raised after work may have been half applied; the engine must stop serving.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from ..plan import DeviceInfo, Plan


class StepRefused(Exception):
    """The driver refused the step before running any of it."""


class DeviceFault(Exception):
    """The step may have been half applied; device state can no longer be trusted."""


@dataclass(slots=True)
class RowWork:
    """One row's share of a step: tokens at consecutive positions from `start`."""

    row: int  # the row's slot (recurrent families index their state by it)
    tokens: np.ndarray  # int32 token ids to feed
    start: int  # position of tokens[0]
    block_table: list[int]  # physical blocks of positions 0.. (covers start + len(tokens))
    num_logits: int  # logits wanted for the last num_logits positions (0: mid-prefill chunk)


@dataclass(slots=True)
class StepOutput:
    logits: np.ndarray  # (sum of num_logits, vocab) float32, rows in batch order


class Driver(ABC):
    backend: str = ""

    def __init__(self) -> None:
        self.compiles = 0
        # Speculative decoding (engine/speculative.py): the scheduler asks this policy for each
        # decoding row's drafts; None decodes one token per row per step.
        self.draft_policy = None
        self.plan: Plan | None = None
        self._armed_failure: str | None = None

    @abstractmethod
    def device(self) -> DeviceInfo: ...

    def weight_bytes(self, model) -> int:
        """Device memory the model's weights will take once prepared, for fitting the plan
        before prepare() runs: the weights themselves, plus any copy a driver keeps."""
        return sum(w.nbytes for w in model.weights.values())

    @abstractmethod
    def prepare(self, plan: Plan, model) -> None:
        """Builds every entry a step will use (weights, caches, kernels)."""

    @abstractmethod
    def _run(self, batch: list[RowWork]) -> StepOutput: ...

    def step(self, batch: list[RowWork]) -> StepOutput:
        if self.plan is None:
            raise StepRefused("the driver was not prepared")
        armed, self._armed_failure = self._armed_failure, None
        if armed == "refuse":
            raise StepRefused("injected: the driver refused the step")
        self._check(batch)
        out = self._run(batch)
        if armed == "fault":
            raise DeviceFault("injected: device fault after the step ran")
        return out

    def arm_failure(self, kind: str) -> None:
        """Test hook behind --fault-injection: the next step is refused or faults."""
        if kind not in ("refuse", "fault"):
            raise ValueError(f"unknown driver failure {kind!r}")
        self._armed_failure = kind

    def _check(self, batch: list[RowWork]) -> None:
        plan = self.plan
        total = sum(len(w.tokens) for w in batch)
        if len(batch) > plan.rows or total > plan.max_step_tokens:
            raise StepRefused(f"step of {len(batch)} rows and {total} tokens exceeds the plan")

    def _built(self) -> None:
        """Every entry build goes through here, so the compile count is honest."""
        self.compiles += 1
