"""Starts the reference server on the synthetic model with one api_defects wrapper around it:
`python serve_with_defect.py NAME PORT` (NAME "refuses_logprobs" or "none" for the controls)."""

from __future__ import annotations

import sys
from pathlib import Path

import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from api_defects import DEFECTS, REFUSES_LOGPROBS  # noqa: E402

from poot.server.app import ServerState, build_app  # noqa: E402


def main() -> None:
    name, port = sys.argv[1], int(sys.argv[2])
    state = ServerState(model_spec="synthetic")
    app = build_app(state)
    if name == "refuses_logprobs":
        app = REFUSES_LOGPROBS(app)
    elif name != "none":
        app = next(d for d in DEFECTS if d.name == name).wrap(app)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    state.request_exit = lambda: setattr(server, "should_exit", True)
    server.run()


if __name__ == "__main__":
    main()
