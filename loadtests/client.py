"""One streamed request over asyncio and httpx, recorded chunk by chunk (convoy and serving).

Locust users stream through requests under gevent (locustfile.py); the in-process runs here
use httpx's async client and the same StreamRecorder, so every run times chunks one way.
"""

from __future__ import annotations

import httpx

from poot.conformance.client import auth_headers
from poot.conformance.kind import first_model
from poot.loadtests.sse import StreamRecorder


def discover_model(url: str, key: str | None = None) -> str:
    """The first model the server lists (asked with the key), else "default"."""
    with httpx.Client(base_url=url.rstrip("/"), timeout=5, headers=auth_headers(key)) as http:
        return first_model(http) or "default"


async def stream_into(client: httpx.AsyncClient, path: str, body: dict, timeout: float,
                      rec: StreamRecorder) -> tuple[str, str | None]:
    """POSTs `body` to `path` and feeds the response into `rec` until the stream ends.

    Returns (status, error): ("ok", None), or ("error", why) for an HTTP error, a transport
    error, an error event, or a stream that ended without tokens or a finish. A caller that
    cancels the task gets asyncio.CancelledError; `rec` then holds what had arrived."""
    status, err = "ok", None
    try:
        async with client.stream("POST", path, json=body, timeout=timeout) as resp:
            if resp.status_code != 200:
                await resp.aread()
                status, err = "error", f"HTTP {resp.status_code}: {resp.text[:160]}"
            else:
                async for data in resp.aiter_raw():
                    rec.feed(data)
        rec.finish()
        if status == "ok" and (rec.error or not rec.chunks):
            status, err = "error", rec.error or "no tokens"
        elif status == "ok" and not rec.done and rec.finish_reason is None:
            status, err = "error", "stream ended without a finish_reason or [DONE]"
    except httpx.HTTPError as exc:
        status, err = "error", f"{type(exc).__name__}: {exc}"[:160]
        if rec.end is None:
            rec.finish()
    return status, err
