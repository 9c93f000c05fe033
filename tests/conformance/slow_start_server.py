"""The reference server behind a long start that reports its progress, test-only:

    python tests/conformance/slow_start_server.py --loading-s S [--mutation NAME ...] [poot-serve options...]

For its first S seconds, and after them until the reference server itself is ready, every
request gets 503 with a loading body whose progress moves, as poot-serve's /health says while
it compiles and warms up (`{"status": "loading", "phase": ..., "detail": ..., "progress":
...}`); then the reference server answers as usual. For showing that the suite waits for a
start that makes progress past its startup timeout.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

PHASES = ("model", "compile", "measure", "warm_up")


class SlowStart:
    """ASGI wrapper answering 503 loading, with progress, for the first `seconds` seconds."""

    def __init__(self, app, seconds: float):
        self.app, self.seconds, self.began = app, seconds, time.monotonic()
        self.ready = False

    async def __call__(self, scope, receive, send):
        elapsed = time.monotonic() - self.began
        if scope["type"] != "http" or (elapsed >= self.seconds and await self.inner_ready()):
            return await self.app(scope, receive, send)
        done = min(elapsed / self.seconds, 1.0) if self.seconds else 1.0
        phase = PHASES[min(int(done * len(PHASES)), len(PHASES) - 1)]
        body = json.dumps({"status": "loading", "phase": phase, "detail": f"{int(elapsed)} s of {int(self.seconds)}",
                           "progress": round(done, 2)}).encode()
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def inner_ready(self) -> bool:
        """Whether the reference server's own /health answers 200 (once it has, for good)."""
        if not self.ready:
            status = []

            async def nothing():
                return {"type": "http.request", "body": b"", "more_body": False}

            async def keep(message):
                if message["type"] == "http.response.start":
                    status.append(message["status"])

            await self.app({"type": "http", "method": "GET", "path": "/health", "raw_path": b"/health",
                            "query_string": b"", "headers": [], "scheme": "http", "http_version": "1.1",
                            "root_path": "", "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}, nothing, keep)
            self.ready = status == [200]
        return self.ready


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for poot_mutants
    from poot_mutants import serve

    argv = sys.argv[1:]
    seconds = 0.0
    if "--loading-s" in argv:
        i = argv.index("--loading-s")
        seconds = float(argv[i + 1])
        del argv[i : i + 2]
    return serve.main(argv, outer=lambda app: SlowStart(app, seconds))


if __name__ == "__main__":
    sys.exit(main())
