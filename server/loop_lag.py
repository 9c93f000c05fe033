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

from poot.engine.histogram import Histogram

TICK_S = 0.02
BOUNDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class LoopLag(Histogram):
    """Seconds late, per wake-up."""

    def __init__(self) -> None:
        super().__init__(BOUNDS)

    async def watch(self) -> None:
        while True:
            due = time.perf_counter() + TICK_S
            await asyncio.sleep(TICK_S)
            self.observe(max(0.0, time.perf_counter() - due))
