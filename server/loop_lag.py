"""How late the event loop runs what is due: the server's side of a stream's gaps.

Every token reaches its client through the event loop (the engine thread hands it over with
call_soon_threadsafe), so a loop held up by other work, or waiting for the GIL, delays every
stream at once, whatever the engine's steps took. A task that asks to wake every TICK_S and
records how late it woke measures that delay; /metrics exports it beside the engine's step
durations, so a long gap seen by a client can be told apart: a long step, a late loop, or
neither (then the client, or the network)."""

from __future__ import annotations

import asyncio
import time
from bisect import bisect_left

TICK_S = 0.02
BOUNDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class LoopLag:
    def __init__(self) -> None:
        self.bounds = BOUNDS
        self.counts = [0] * (len(BOUNDS) + 1)
        self.total = 0.0
        self.max = 0.0

    def observe(self, late: float) -> None:
        self.counts[bisect_left(self.bounds, late)] += 1
        self.total += late
        self.max = max(self.max, late)

    def cumulative(self) -> list[int]:
        out, running = [], 0
        for c in self.counts[:-1]:
            running += c
            out.append(running)
        return out

    async def watch(self) -> None:
        while True:
            due = time.perf_counter() + TICK_S
            await asyncio.sleep(TICK_S)
            self.observe(max(0.0, time.perf_counter() - due))
