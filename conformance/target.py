"""The server under test: a URL, a command the suite starts, or the bundled reference server.

A command is a shell command line; `{port}` in it is replaced by a free port (the suite then
speaks to http://127.0.0.1:PORT). Only with a command can the suite start private servers for
the clauses that restart, kill or misconfigure one (startup, draining, dead engine).
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from .client import api_key_from_env, auth_headers

BUNDLED_MODEL = "synthetic"
BUNDLED_RECURRENT_MODEL = "synthetic-mamba"  # engine.models: a tiny seeded Mamba (recurrent state)


class ServerStartError(RuntimeError):
    pass


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

    def wait_healthy(self, timeout: float) -> None:
        """Until /health answers 200; a server with no /health (404) is ready once /v1/models answers 200."""
        deadline = time.monotonic() + timeout
        headers = auth_headers(api_key_from_env())
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(f"server exited with status {self.proc.returncode} before "
                                       f"/health answered 200:\n{self.log_tail()}")
            try:
                status = httpx.get(self.url + "/health", timeout=2.0, headers=headers).status_code
                if status == 200:
                    return
                if status == 404 and httpx.get(self.url + "/v1/models", timeout=2.0,
                                               headers=headers).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.stop()
        raise ServerStartError(f"neither /health nor (where /health answers 404) /v1/models answered 200 within "
                               f"{timeout:.0f}s:\n{self.log_tail()}")

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
              port: int | None = None, log_path: str | Path | None = None) -> ServerProcess:
        """Starts the command (not waiting for health); `extra_args` are appended. Its output
        goes to `log_path`, else to a temporary file."""
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
        return ServerProcess(proc, f"http://127.0.0.1:{port}", log, command)

    def start(self, extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> ServerProcess:
        server = self.spawn(extra_args, env)
        server.wait_healthy(self.startup_timeout)
        return server
