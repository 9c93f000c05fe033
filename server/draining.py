"""Shutting down without cutting requests off: count what is in flight, exit once it is done."""

from __future__ import annotations

import asyncio

from .state import ServerState


async def drain_watch(state: ServerState) -> None:
    """Once draining and nothing is in flight (engine or HTTP), lets uvicorn shut down."""
    while True:
        await asyncio.sleep(0.02)
        if not state.draining:
            continue
        engine = state.engine
        if (engine is None or engine.in_flight() == 0) and state.active == 0:
            state.drained()
            return


class CountActive:
    """ASGI wrapper counting generation requests until their response (stream included) ends."""

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/") and scope["method"] == "POST":
            self.state.active += 1
            try:
                await self.app(scope, receive, send)
            finally:
                self.state.active -= 1
        else:
            await self.app(scope, receive, send)
