"""The API key poot-load sends: `--api-key`, else OPENAI_API_KEY, as `Authorization: Bearer KEY`
on every request (locust users, the convoy's client, /metrics scrapes, model discovery). It is
handed to the locust child through its environment, never its command line, and never printed
or written to a report."""

from __future__ import annotations

import os

from poot.conformance.client import auth_headers

ENV_VAR = "OPENAI_API_KEY"


def api_key(given: str | None = None) -> str | None:
    """The key to send: the one given, else the environment's; None: send none."""
    return given or os.environ.get(ENV_VAR) or None


headers = auth_headers  # one way to send it, the suite's
