"""A tiny OpenAI-shaped stub server for the suite's own tests of a server's life, test-only:
a start that reports loading, and a crash on a completion request without a prompt.

    python tests/conformance/stub_server.py --port PORT [--loading-s S] [--no-progress]
                                            [--on-no-prompt die|exit] [--health-stays-ok]

It answers /health, /v1/models, a completion with a prompt (a fixed text), 400 for any other
bad request, 404 for unknown paths. `--loading-s S`: for its first S seconds every request
gets 503 with poot-serve's loading body, its progress moving (or, with --no-progress, the
same body throughout, as llama.cpp's). `--on-no-prompt die`: from a completion without a
prompt on, every request gets 503 (as a server whose batching worker died; with
--health-stays-ok, all but /health, which still answers 200); `exit`: the process exits at once.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "stub"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    options: argparse.Namespace
    started = time.monotonic()
    dead = False

    def do_GET(self):  # noqa: N802 - http.server's naming
        if self.refused():
            return
        if self.path == "/health":
            return self.send(200, {"status": "ok"})
        if self.path == "/v1/models":
            return self.send(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        self.send(404, error("no such path", "not_found_error"))

    def do_POST(self):  # noqa: N802
        raw = self.rfile.read(int(self.headers.get("content-length") or 0))
        if self.refused():
            return
        if self.path != "/v1/completions":
            return self.send(404, error("no such path", "not_found_error"))
        try:
            body = json.loads(raw)
        except ValueError:
            return self.send(400, error("the body is not JSON", param=None))
        if not isinstance(body, dict):
            return self.send(400, error("the body must be an object", param=None))
        if not body.get("prompt"):
            if self.options.on_no_prompt == "exit":
                os._exit(1)
            if self.options.on_no_prompt == "die":
                Handler.dead = True
                return self.send(500, error("the worker crashed", "server_error"))
            return self.send(400, error("prompt is required", param="prompt"))
        max_tokens = body.get("max_tokens", 16)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            return self.send(400, error("max_tokens must be a positive integer", param="max_tokens"))
        self.send(200, {"id": "cmpl-1", "object": "text_completion", "created": int(time.time()), "model": MODEL,
                        "choices": [{"index": 0, "text": " ok", "finish_reason": "length", "logprobs": None}],
                        "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}})

    def refused(self) -> bool:
        """Answers 503 while loading or dead; False when the request is served."""
        elapsed = time.monotonic() - self.started
        if elapsed < self.options.loading_s:
            progress = None if self.options.no_progress else round(elapsed / self.options.loading_s, 1)
            detail = "loading" if progress is None else f"step {int(elapsed)} of {int(self.options.loading_s)}"
            self.send(503, {"status": "loading", "phase": "compile", "detail": detail, "progress": progress})
            return True
        if Handler.dead and not (self.path == "/health" and self.options.health_stays_ok):
            self.send(503, error("the batching worker is dead and can't take requests", "server_error"))
            return True
        return False

    def send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def error(message: str, kind: str = "invalid_request_error", param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--loading-s", type=float, default=0.0)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--on-no-prompt", choices=("refuse", "die", "exit"), default="refuse")
    p.add_argument("--health-stays-ok", action="store_true")
    Handler.options = p.parse_args()
    print(f"stub server on port {Handler.options.port}", flush=True)
    ThreadingHTTPServer(("127.0.0.1", Handler.options.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
