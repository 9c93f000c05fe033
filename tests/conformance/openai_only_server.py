"""The reference server with everything but the OpenAI API hidden: /health, /metrics,
/debug/fault answer 404, so the suite knows only what it can time. Test-only.

    python tests/conformance/openai_only_server.py [--mutation NAME ...] [poot-serve options...]

A `--mutation NAME` starts the deliberately broken variant of tests/poot_mutants/ behind the
same wrapper.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HIDDEN = ("/health", "/metrics", "/debug/fault", "/props", "/slots")


class OpenAIOnly:
    """ASGI wrapper answering 404 for every path outside the OpenAI API."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] in HIDDEN:
            body = json.dumps({"error": {"message": "not found", "type": "not_found_error", "param": None,
                                         "code": None}}).encode()
            await send({"type": "http.response.start", "status": 404,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for poot_mutants
    from poot_mutants import serve

    return serve.main(sys.argv[1:], outer=OpenAIOnly)


if __name__ == "__main__":
    sys.exit(main())
