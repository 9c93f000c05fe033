"""The SSE response of a streaming request, which cancels its request however it ends."""

from __future__ import annotations

import asyncio

from starlette.responses import StreamingResponse


class EventStream(StreamingResponse):
    """An SSE response that cancels its request however the response ends.

    A task awaits `receive()` beside the sending, and the moment it sees `http.disconnect` it
    cancels the engine request (before anything else is unwound), so a client that hangs up is
    released at the engine's next iteration rather than whenever a send notices. An error or the
    normal end cancels too (a no-op: the request is finished already)."""

    def __init__(self, events, on_close):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        async def hang_up() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            self.on_close()  # at once: the engine releases the request at its next iteration

        sending = asyncio.ensure_future(self.stream_response(send))
        watching = asyncio.ensure_future(hang_up())
        try:
            await asyncio.wait((sending, watching), return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.on_close()
            for task in (sending, watching):
                task.cancel()
            await asyncio.gather(sending, watching, return_exceptions=True)
        if sending.done() and not sending.cancelled() and isinstance(sending.exception(), Exception):
            if not isinstance(sending.exception(), OSError):  # OSError: the client is gone
                raise sending.exception()
