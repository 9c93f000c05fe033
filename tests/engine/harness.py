"""Drives an engine by hand, one iteration at a time, and records what each request saw."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from poot.engine import Engine, SamplingParams
from poot.engine.drivers.numpy_driver import NumpyDriver
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


@functools.cache
def cached_model(seed: int):
    return synthetic_llama(seed)


def make_engine(seed: int = 0, memory_bytes: int = 1 << 30, **kw) -> Engine:
    model = cached_model(seed)
    driver = kw.pop("driver_class", NumpyDriver)(memory_bytes=memory_bytes)
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
