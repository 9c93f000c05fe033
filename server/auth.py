"""An API key in front of the reference server: an ASGI wrapper around the unchanged app.

The key comes from the POOT_API_KEY environment variable or from a file (`--api-key-file`),
never from the command line alone, where a process list would show it. Every request but the
probes' and scrapers' (`/health`, `/metrics`) must carry `Authorization: Bearer KEY`; a
missing or wrong key gets 401 in the OpenAI error shape. Keys are compared in constant time.
"""

from __future__ import annotations

import hmac
import json
import os
from pathlib import Path

ENV_VAR = "POOT_API_KEY"
OPEN_PATHS = frozenset({"/health", "/metrics"})


class ApiKeyError(ValueError):
    pass


def read_key(path: str | None, env: dict[str, str] | None = None) -> str | None:
    """The key from a file (its first line), else from POOT_API_KEY; None: no key required."""
    if path:
        try:
            text = Path(path).read_text().strip()
        except OSError as e:
            raise ApiKeyError(f"cannot read the API key file: {e}") from e
        key = text.splitlines()[0].strip() if text else ""
        if not key:
            raise ApiKeyError(f"the API key file {path} is empty")
        return key
    key = (env if env is not None else os.environ).get(ENV_VAR, "").strip()
    return key or None


def _refusal(message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": "invalid_api_key"}}).encode()


class RequireKey:
    """Answers 401 unless the request carries the bearer key; /health and /metrics stay open."""

    def __init__(self, app, key: str):
        self.app = app
        self._key = key.encode()

    def _allowed(self, scope) -> bool:
        for name, value in scope.get("headers") or ():
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)
        return False

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        has_header = any(name == b"authorization" for name, _ in scope.get("headers") or ())
        body = _refusal("Incorrect API key provided." if has_header else
                        "Missing API key: send it as 'Authorization: Bearer KEY'.")
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
