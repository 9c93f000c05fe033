"""The reference server with everything but the OpenAI API hidden: /health, /metrics,
/debug/fault answer 404, so the suite knows only what it can time. Test-only.

    python tests/conformance/openai_only_server.py [poot-serve options...]
"""

from __future__ import annotations

import json
import sys

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
    from poot.server import app, cli

    build = app.build_app
    app.build_app = lambda state: OpenAIOnly(build(state))
    return cli.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
