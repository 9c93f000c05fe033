"""Drives an engine by hand, one iteration at a time, and records what each request saw."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from poot.engine import Engine, SamplingParams
from poot.engine.drivers.base import RowWork, StepPlan
from poot.engine.drivers.cpu import CpuDriver
from poot.engine.events import Accepted, Finished, Rejected, Tokens
from poot.engine.models.synthetic import synthetic_llama


@dataclass
class Record:
    events: list = field(default_factory=list)

    def __call__(self, event) -> None:
        self.events.append(event)

    @property
    def finished(self) -> Finished | None:
        ends = [e for e in self.events if isinstance(e, Finished | Rejected)]
        assert len(ends) <= 1, f"request ended more than once: {ends}"
        return ends[0] if ends else None

    @property
    def accepted(self) -> bool:
        return any(isinstance(e, Accepted) for e in self.events)

    @property
    def token_ids(self) -> list[int]:
        return [t for e in self.events if isinstance(e, Tokens) for t in e.token_ids]

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events if isinstance(e, Tokens | Finished))


# How far a logit may move when only how a step is cut changes (chunks, batch, kernels) on a
# driver that keeps its KV cache in float16: two cuts whose products differ in a float32 last
# bit can round a key or value to neighbouring float16s (11 significant bits). Measured on the
# synthetic models: up to 1.2e-4; a wrong position or a missing length mask moves them by 1-3.
HALF_KV_ATOL = 5e-4


# How far a float16 KV cache moves the logits from a float32 one, relative to the largest logit
# (max |difference| / max |logit|): measured 2.6e-3 on SmolLM2 over 64 prompts of 12 greedy
# tokens each (64 of 64 continuations the same), about 1e-3 on the synthetic models.
HALF_KV_RELATIVE = 4e-3


def half_kv(driver, config) -> bool:
    return driver.kv_bytes_per_token(config) < config.kv_bytes_per_token(4)


def logit_tolerance(driver, config, float32_atol: float) -> float:
    """The tolerance for comparing a driver's logits across cuts: `float32_atol` where its KV
    cache is float32, HALF_KV_ATOL where it is float16."""
    return max(float32_atol, HALF_KV_ATOL) if half_kv(driver, config) else float32_atol


@functools.cache
def cached_model(seed: int):
    return synthetic_llama(seed)


def make_engine(seed: int = 0, memory_bytes: int = 1 << 30, **kw) -> Engine:
    model = cached_model(seed)
    driver = kw.pop("driver_class", CpuDriver)(memory_bytes=memory_bytes)
    return kw.pop("engine_class", Engine).create(model, driver=driver, **kw)


def greedy(max_tokens: int = 8, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def submit(engine: Engine, prompt, params: SamplingParams) -> tuple[Record, object]:
    rec = Record()
    handle = engine.submit(prompt, params, rec)
    return rec, handle


def run_until_idle(engine: Engine, limit: int = 10_000) -> int:
    steps = 0
    while engine.in_flight() and steps < limit:
        engine.iteration()
        steps += 1
    assert not engine.in_flight(), "engine did not finish its requests"
    return steps


def feed_steps(driver, rows: list[int], steps: list[list[tuple[int, list[int]]]]) -> list[np.ndarray]:
    """Opens each row on its own blocks of a prepared driver, then runs the steps: each a list
    of (row, tokens); returns every step's logits."""
    plan = driver.plan
    per_row = plan.blocks_for(plan.positions)
    fed = {}
    for row in rows:
        driver.step(StepPlan.opening({row: list(range(row * per_row, (row + 1) * per_row))}))
        fed[row] = 0
    outs = []
    for step in steps:
        batch = []
        for row, tokens in step:
            batch.append(RowWork(row, np.array(tokens, np.int32), fed[row], driver.open_rows[row], len(tokens)))
            fed[row] += len(tokens)
        outs.append(driver.step(StepPlan(batch)).logits.copy())
    for row in rows:
        driver.step(StepPlan.closing([row]))
    return outs
