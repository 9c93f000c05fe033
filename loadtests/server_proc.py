"""Starts a server on a free loopback port and stops it afterwards: the bundled server, or
any command line with `{port}` in it (llama.cpp's server, vLLM, ...).

The process itself is the suite's (poot.conformance.target: ServerCommand spawns it through
the shell in a session of its own, ServerProcess waits for /health and stops the whole group
with SIGTERM, then SIGKILL); this module only adds what the load tests want of it: argument
lists, a log file of the caller's choosing (or none kept), a context manager and the exit code.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path

from poot.conformance.target import ServerCommand, ServerProcess, ServerStartError, poot_serve

STOP_GRACE_S = 20.0  # SIGTERM (poot-serve drains on it, as on SIGINT), then SIGKILL


def poot_serve_exe() -> str:
    """poot-serve next to this Python, else on PATH (else where it would be next to this Python)."""
    try:
        return poot_serve()
    except ServerStartError:
        return os.path.join(os.path.dirname(sys.executable), "poot-serve")


def serve_command(port: int | str, model: str = "synthetic", extra: list[str] | None = None) -> list[str]:
    """poot-serve's argument list; `port` may be "{port}", filled in when it starts."""
    return [poot_serve_exe(), "--model", model, "--host", "127.0.0.1", "--port", str(port)] + list(extra or [])


def _beside_python(command: str) -> str:
    """The command with its program found next to this Python when it is not on PATH (e.g.
    poot-serve in this Python's venv, not activated)."""
    parts = command.strip().split(None, 1)
    if not parts or os.sep in parts[0] or any(q in parts[0] for q in "'\"\\$") or shutil.which(parts[0]):
        return command
    beside = os.path.join(os.path.dirname(sys.executable), parts[0])
    return command if not os.path.exists(beside) else " ".join([shlex.quote(beside), *parts[1:]])


class CommandServer:
    """A server started from a command line in which `{port}` is replaced by a free port, or
    from an argument list (each argument may hold `{port}`). Ready once /health answers 200
    (or, without /health, /v1/models); `stop()` returns its exit code.

    Context manager: `with CommandServer("my-server --port {port}") as url: ...`."""

    def __init__(self, command: str | list[str], startup_timeout: float = 60.0, log_path: str | None = None,
                 name: str = "server", env: dict[str, str] | None = None):
        self.command = command
        self.env = env  # extra environment for the server (a key it requires, say)
        self.startup_timeout = startup_timeout
        self.log_path = log_path  # None: a temporary log, shown in a start error, removed on stop
        self.name = name
        self.process: ServerProcess | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.proc.pid

    def template(self) -> str:
        """The shell command line, `{port}` still in it."""
        return self.command if isinstance(self.command, str) else shlex.join(self.command)

    def start(self) -> str:
        command = ServerCommand(_beside_python(self.template()), self.startup_timeout)
        self.process = command.spawn(env=self.env, log_path=self.log_path)
        self.port = int(self.process.url.rsplit(":", 1)[1])
        try:
            self.process.wait_healthy(self.startup_timeout)
        except ServerStartError as exc:
            cmd = self.process.command
            self.stop()
            raise ServerStartError(f"{self.name} did not start (command: {cmd}): {exc}") from None
        return self.url

    def stop(self) -> int | None:
        process, self.process = self.process, None
        if process is None:
            return None
        process.stop(STOP_GRACE_S)
        if self.log_path is None:
            Path(process.log_path).unlink(missing_ok=True)
        return process.proc.returncode

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class BundledServer(CommandServer):
    """poot-serve on MODEL (synthetic by default) with extra options; with `api_key` the server
    requires it (POOT_API_KEY, in its environment, never its command line; /health stays open)."""

    def __init__(self, model: str = "synthetic", extra: list[str] | None = None, startup_timeout: float = 60.0,
                 log_path: str | None = None, api_key: str | None = None):
        self.model = model
        self.extra = extra or []
        super().__init__(serve_command("{port}", model, self.extra),
                         startup_timeout, log_path, name="poot-serve",
                         env={"POOT_API_KEY": api_key} if api_key else None)
