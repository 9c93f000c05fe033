"""A tiny throwaway OpenAI-style SSE server for testing the load pipeline (stdlib only).

Streams `max_tokens` one-character chunks, one every `step_s` seconds, and exposes /health,
/v1/models and a /metrics page with the gauges the reports read. Clients that disconnect stop
their stream at the next write. With a key, every path but /health needs it as a bearer token
(as llama.cpp's server does), and refused requests are counted. Loopback only.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeState:
    def __init__(self, step_s: float, max_tokens_cap: int = 400, key: str | None = None):
        self.step_s = step_s
        self.key = key
        self.refused: dict[str, int] = {}  # path -> requests answered 401
        self.cap = max_tokens_cap
        self.lock = threading.Lock()
        self.running = 0
        self.finished = {"stop": 0, "length": 0, "cancelled": 0}
        self.generated = 0
        self.prompt_tokens = 0


def make_handler(state: FakeState):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def _json(self, code: int, obj) -> None:
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _refused(self) -> bool:
            if state.key is None or self.path == "/health" \
                    or self.headers.get("Authorization") == f"Bearer {state.key}":
                return False
            if self.command == "POST":
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
            with state.lock:
                state.refused[self.path] = state.refused.get(self.path, 0) + 1
            self._json(401, {"error": {"message": "Invalid API Key", "type": "authentication_error", "code": 401}})
            return True

        def do_GET(self):
            if self._refused():
                return
            if self.path == "/health":
                self._json(200, {"status": "ok", "plan": {"rows": 64}})
            elif self.path == "/v1/models":
                self._json(200, {"object": "list", "data": [{"id": "fake", "object": "model"}]})
            elif self.path == "/metrics":
                with state.lock:
                    text = (f"engine_requests_running {state.running}\nengine_requests_waiting 0\n"
                            f"kv_blocks_reserved {state.running * 4}\nkv_blocks_in_use {state.running * 2}\n"
                            f"kv_blocks_total 256\nprefix_cache_hit_rate 0.5\n"
                            f"generation_tokens_total {state.generated}\n")
                body = text.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            else:
                self._json(404, {"error": {"message": "not found", "type": "not_found", "param": None, "code": None}})

        def _chunk(self, payload: str) -> None:
            data = payload.encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        def do_POST(self):
            if self._refused():
                return
            n = int(self.headers.get("Content-Length") or 0)
            req = json.loads(self.rfile.read(n) or b"{}")
            if self.path not in ("/v1/completions", "/v1/chat/completions"):
                self._json(404, {"error": {"message": "not found", "type": "not_found", "param": None, "code": None}})
                return
            max_tokens = req.get("max_tokens", 16)
            if not isinstance(max_tokens, int) or max_tokens < 1 or max_tokens > state.cap:
                self._json(400, {"error": {"message": "bad max_tokens", "type": "invalid_request_error",
                                           "param": "max_tokens", "code": None}})
                return
            chat = self.path.endswith("chat/completions")
            prompt = req.get("prompt") or "".join(m.get("content", "") for m in req.get("messages", []))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            with state.lock:
                state.running += 1
                state.prompt_tokens += len(prompt)
            reason = "cancelled"
            try:
                for i in range(max_tokens):
                    time.sleep(state.step_s)
                    ch = "abcdefghij"[i % 10]
                    choice = {"index": 0, "delta": {"content": ch}} if chat else {"index": 0, "text": ch}
                    choice["finish_reason"] = None
                    self._chunk("data: " + json.dumps({"choices": [choice]}) + "\n\n")
                    with state.lock:
                        state.generated += 1
                fin = {"index": 0, "finish_reason": "length"}
                fin.update({"delta": {}} if chat else {"text": ""})
                self._chunk("data: " + json.dumps({"choices": [fin]}) + "\n\n")
                if (req.get("stream_options") or {}).get("include_usage"):
                    usage = {"prompt_tokens": len(prompt), "completion_tokens": max_tokens,
                             "total_tokens": len(prompt) + max_tokens}
                    self._chunk("data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n")
                self._chunk("data: [DONE]\n\n")
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
                reason = "length"
            except (BrokenPipeError, ConnectionResetError, OSError):
                pass
            finally:
                with state.lock:
                    state.running -= 1
                    state.finished[reason] += 1

    return Handler


class FakeServer:
    def __init__(self, step_s: float = 0.005, key: str | None = None):
        self.state = FakeState(step_s, key=key)
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(self.state))
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> FakeServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
