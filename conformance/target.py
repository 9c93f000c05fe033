"""The server under test: a URL, a command the suite starts, or the bundled reference server.

A command is a shell command line; `{port}` in it is replaced by a free port (the suite then
speaks to http://127.0.0.1:PORT). Only with a command can the suite start private servers for
the clauses that restart, kill or misconfigure one (startup, draining, dead engine).

A server is ready once /health answers 200 (or, where /health answers 404, /v1/models 200).
While it starts it may say so: a 503 whose body reads as loading (poot-serve's
`{"status": "loading", "phase": ..., "detail": ..., "progress": ...}`, llama.cpp's
`{"error": {"message": "Loading model"}}`). Any change of that body is progress, and the wait
lasts as long as progress comes (up to STARTUP_CAP_S in all); the startup timeout bounds only
how long the server may go with nothing new to say.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from .client import api_key_from_env, auth_headers

BUNDLED_MODEL = "synthetic"
BUNDLED_RECURRENT_MODEL = "synthetic-mamba"  # engine.models: a tiny seeded Mamba (recurrent state)


STARTUP_CAP_S = 900.0  # the longest a starting server that keeps reporting progress is waited for


class ServerStartError(RuntimeError):
    pass


def loading_body(status: int, text: str) -> dict | None:
    """The body of an answer that says the server is still starting, else None: a 503 with
    status "loading" (poot-serve), or an error whose message speaks of loading (llama.cpp)."""
    if status != 503:
        return None
    try:
        body = json.loads(text)
    except ValueError:
        return None
    if not isinstance(body, dict):
        return None
    if body.get("status") == "loading":
        return body
    error = body.get("error")
    message = error.get("message") if isinstance(error, dict) else None
    return body if isinstance(message, str) and "loading" in message.lower() else None


def describe_loading(body: dict) -> str:
    """One line for a progress report: phase, detail, and the fraction where there is one."""
    if body.get("status") != "loading":
        return str((body.get("error") or {}).get("message") or "loading")
    parts = [str(body[k]) for k in ("phase", "detail") if body.get(k)]
    progress = body.get("progress")
    if isinstance(progress, int | float) and not isinstance(progress, bool):
        parts.append(f"{progress:.0%}")
    return ", ".join(parts) or "loading"


def wait_ready(url: str, timeout: float, exited: Callable[[], int | None] = lambda: None,
               on_progress: Callable[[dict], None] | None = None, cap: float = STARTUP_CAP_S) -> None:
    """Until the server at `url` is ready. Raises ServerStartError when `exited()` gives an exit
    status, when `timeout` seconds pass with no sign of progress (no loading body that differs
    from the last one), or after max(cap, timeout) seconds in all; its message says what the
    server last answered."""
    started = news = time.monotonic()
    headers = auth_headers(api_key_from_env())
    last_body, last_seen = None, "nothing yet"
    while True:
        code = exited()
        if code is not None:
            raise ServerStartError(f"the server exited with status {code} before it was ready "
                                   f"(last seen: {last_seen})")
        try:
            r = httpx.get(url + "/health", timeout=2.0, headers=headers)
            if r.status_code == 200:
                return
            if r.status_code == 404 and httpx.get(url + "/v1/models", timeout=2.0, headers=headers).status_code == 200:
                return
            last_seen = f"/health answered {r.status_code} {' '.join(r.text.split())[:300]}"
            body = loading_body(r.status_code, r.text)
            if body is not None and body != last_body:
                last_body, news = body, time.monotonic()
                if on_progress is not None:
                    on_progress(body)
        except httpx.HTTPError as e:
            last_seen = f"no answer ({type(e).__name__})"
        now = time.monotonic()
        if now - news > timeout:
            said = "reported no progress" if last_body is not None else "was not ready"
            raise ServerStartError(f"the server {said} for {timeout:.0f} s (last seen: {last_seen})")
        if now - started > max(cap, timeout):
            raise ServerStartError(f"the server was still starting after {max(cap, timeout):.0f} s "
                                   f"(last seen: {last_seen})")
        time.sleep(0.05)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def poot_serve() -> str:
    """The bundled server's launcher: next to this Python, else on PATH."""
    here = Path(sys.executable).parent / "poot-serve"
    if here.exists():
        return str(here)
    found = shutil.which("poot-serve")
    if found is None:
        raise ServerStartError("poot-serve is not installed next to this Python nor on PATH")
    return found


def bundled_command(model: str = BUNDLED_MODEL, *extra: str) -> str:
    args = [poot_serve(), "--model", model, "--port", "{port}", "--fault-injection", *extra]
    return " ".join(a if a == "{port}" else shlex.quote(a) for a in args)


@dataclass(slots=True)
class ServerProcess:
    proc: subprocess.Popen
    url: str
    log_path: Path
    command: str

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])

    def wait_healthy(self, timeout: float, on_progress: Callable[[dict], None] | None = None) -> None:
        """Until the server is ready (module docstring): as long as it reports progress, and at
        most `timeout` seconds with nothing new. A server that never gets ready is stopped, and
        the error ends with the last lines of its log."""
        try:
            wait_ready(self.url, timeout, self.proc.poll, on_progress)
        except ServerStartError as e:
            self.stop()
            tail = self.log_tail()
            raise ServerStartError(f"{e}; command: {self.command}" + (f"\n{tail}" if tail else "")) from None

    def signal(self, sig: int = signal.SIGTERM, group: bool = False) -> None:
        """Signals the server (a plain command is exec'd, so that is the server itself), or its
        whole process group."""
        try:
            if group:
                os.killpg(self.proc.pid, sig)
            else:
                self.proc.send_signal(sig)
        except ProcessLookupError:
            pass

    def wait_exit(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, grace: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM, group=True)
            if self.wait_exit(grace) is None:
                self.signal(signal.SIGKILL, group=True)
                self.proc.wait(5)


@dataclass(slots=True)
class ServerCommand:
    """A command line that starts a server; `{port}` picks where it listens."""

    template: str
    startup_timeout: float = 60.0

    @property
    def has_port(self) -> bool:
        return "{port}" in self.template

    def spawn(self, extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None,
              port: int | None = None, log_path: str | Path | None = None, url: str | None = None) -> ServerProcess:
        """Starts the command (not waiting for health); `extra_args` are appended. Its output
        goes to `log_path`, else to a temporary file. `url` says where it listens, for a
        command with no `{port}`."""
        port = port or free_port()
        command = self.template.replace("{port}", str(port))
        if extra_args:
            command += " " + shlex.join(extra_args)
        if not any(ch in command for ch in ";&|`$()<>\n"):
            command = "exec " + command  # the shell becomes the server: signals reach it directly
        log = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="poot-server-", suffix=".log")[1])
        with open(log, "wb") as out:
            proc = subprocess.Popen(command, shell=True, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    env={**os.environ, **(env or {})})
        where = f"http://127.0.0.1:{port}" if self.has_port or url is None else url.rstrip("/")
        return ServerProcess(proc, where, log, command)

    def start(self, extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None,
              port: int | None = None, url: str | None = None,
              on_progress: Callable[[dict], None] | None = None) -> ServerProcess:
        server = self.spawn(extra_args, env, port, url=url)
        server.wait_healthy(self.startup_timeout, on_progress)
        return server
