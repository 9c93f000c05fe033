"""The API key poot-load sends: `--api-key`, else OPENAI_API_KEY, as `Authorization: Bearer KEY`
on every request (locust users, the convoy's client, /metrics scrapes, model discovery). It is
handed to the locust child through its environment, never its command line, and never printed
or written to a report."""

from __future__ import annotations

import os

ENV_VAR = "OPENAI_API_KEY"


def api_key(given: str | None = None) -> str | None:
    """The key to send: the one given, else the environment's; None: send none."""
    return given or os.environ.get(ENV_VAR) or None


def headers(key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"} if key else {}
