"""What a starting engine is doing, for whoever waits on it.

Loading a model, compiling kernels, timing products and warming up take from a second to
minutes; a server that is starting says which, and how far it has got (poot-serve's /health
and its console line). The one who starts the engine makes a `Progress` and hands it to
`load_model` and `Engine.create`, which hand it on to the driver; each stage reports what it
is doing there, and the reader asks `now` whenever it likes (from any thread: a report is
one immutable `Stage`, swapped in whole).

    model     reading the model (the file, or its cached float32 weights) and fitting the plan
    compile   building or loading what steps run on (kernels, weight layouts, the KV pool)
    measure   timing which path runs each product on this machine
    warm_up   running one step of every kind, so the first request costs what the next does

`fraction` is how far the current stage has got through the items it counted (1 of 11
kernels compiled: 1/11), or None where it counts none: a stage is not weighed against the
others, whose durations vary from machine to machine far more than their order.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

PHASES = ("model", "compile", "measure", "warm_up")

T = TypeVar("T")


@dataclass(slots=True, frozen=True)
class Stage:
    phase: str
    detail: str
    fraction: float | None
    at: float  # time.monotonic() when it was reported

    def as_dict(self) -> dict:
        """What /health says while the server loads."""
        return {"status": "loading", "phase": self.phase, "detail": self.detail,
                "progress": None if self.fraction is None else round(self.fraction, 3)}


class Progress:
    """The current stage of one start, and the listeners told of each new one."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.started = clock()
        self._now = Stage("model", "starting", None, self.started)
        self._listeners: list[Callable[[Stage], None]] = []
        self._lock = threading.Lock()
        self.finished: str | None = None  # "ready" or "failed" once the start is over

    @property
    def now(self) -> Stage:
        return self._now

    def elapsed(self) -> float:
        return self.clock() - self.started

    def listen(self, listener: Callable[[Stage], None]) -> None:
        """`listener(stage)` on every report from now on, on the reporting thread."""
        with self._lock:
            self._listeners.append(listener)

    def report(self, phase: str, detail: str, done: int | None = None, total: int | None = None) -> None:
        """The start is at `phase`, doing `detail`; with `total`, item `done + 1` of `total` is
        under way (the detail says so: "compiling kernels (3 of 11)")."""
        if phase not in PHASES:
            raise ValueError(f"unknown start-up phase {phase!r}; phases: {', '.join(PHASES)}")
        fraction = None
        if total:
            done = min(max(done or 0, 0), total)
            fraction = done / total
            detail = f"{detail} ({min(done + 1, total)} of {total})"
        self._tell(Stage(phase, detail, fraction, self.clock()))

    def each(self, phase: str, detail: str, items: Iterable[T]) -> Iterator[T]:
        """Yields `items`, reporting each before it is worked on, and the whole when done."""
        items = list(items)
        for i, item in enumerate(items):
            self.report(phase, detail, i, len(items))
            yield item
        if items:
            self.report(phase, detail, len(items), len(items))

    def finish(self, outcome: str = "ready") -> None:
        """The start is over: "ready", or "failed". Listeners get the last stage once more."""
        self.finished = outcome
        self._tell(self._now)

    def _tell(self, stage: Stage) -> None:
        self._now = stage
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            listener(stage)
