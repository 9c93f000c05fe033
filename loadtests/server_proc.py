"""Starts a server on a free loopback port and stops it afterwards: the bundled server, or
any command line with `{port}` in it (llama.cpp's server, vLLM, ...)."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

import httpx

from poot.conformance.client import auth_headers
from poot.conformance.target import free_port


def poot_serve_exe() -> str:
    """poot-serve next to this Python, else on PATH."""
    exe = os.path.join(os.path.dirname(sys.executable), "poot-serve")
    if not os.path.exists(exe):
        exe = shutil.which("poot-serve") or exe
    return exe


def serve_command(port: int, model: str = "synthetic", extra: list[str] | None = None) -> list[str]:
    return [poot_serve_exe(), "--model", model, "--host", "127.0.0.1", "--port", str(port)] + list(extra or [])


def is_ready(url: str, timeout: float = 1.0, key: str | None = None) -> bool:
    """GET /health answers 200, or GET /v1/models does (servers without /health); asked with
    the key, for a server that wants it on both."""
    for path in ("/health", "/v1/models"):
        try:
            if httpx.get(url + path, timeout=timeout, headers=auth_headers(key)).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
    return False


class CommandServer:
    """A server started from an argument list, or a command line in which `{port}` is replaced
    by a free port. Ready once `is_ready`; stopped with SIGINT, then SIGTERM, then SIGKILL.

    Context manager: `with CommandServer("my-server --port {port}") as url: ...`."""

    def __init__(self, command: str | list[str], startup_timeout: float = 60.0, log_path: str | None = None,
                 name: str = "server", env: dict[str, str] | None = None, api_key: str | None = None):
        self.command = command
        self.api_key = api_key  # sent while waiting for it to be ready
        self.env = env  # extra environment for the server (a key it requires, say)
        self.startup_timeout = startup_timeout
        self.log_path = log_path
        self.name = name
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self._log = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def argv(self, port: int) -> list[str]:
        if isinstance(self.command, str):
            args = shlex.split(self.command.replace("{port}", str(port)))
        else:
            args = [a.replace("{port}", str(port)) for a in self.command]
        if args and os.sep not in args[0] and shutil.which(args[0]) is None:
            beside = os.path.join(os.path.dirname(sys.executable), args[0])
            if os.path.exists(beside):  # e.g. poot-serve in this Python's venv, not activated
                args[0] = beside
        return args

    def start(self) -> str:
        self.port = free_port()
        cmd = self.argv(self.port)
        self._log = open(self.log_path, "w", encoding="utf-8") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        env = {**os.environ, **self.env} if self.env else None
        # A session of its own: a Ctrl-C meant for the caller does not reach the server first.
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, env=env)
        deadline = time.time() + self.startup_timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.stop()
                raise RuntimeError(f"{self.name} exited with code {code} before it was ready "
                                   f"(command: {shlex.join(cmd)})")
            if is_ready(self.url, key=self.api_key):
                return self.url
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{self.name} answered neither GET /health nor GET /v1/models with 200 within "
                           f"{self.startup_timeout:.0f}s (command: {shlex.join(cmd)})")

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        for sig, wait in ((signal.SIGINT, 15), (signal.SIGTERM, 5), (signal.SIGKILL, 5)):
            if self.proc.poll() is not None:
                break
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
        if self._log not in (None, subprocess.DEVNULL):
            self._log.close()
        code = self.proc.returncode
        self.proc = None
        return code

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class BundledServer(CommandServer):
    """poot-serve on MODEL (synthetic by default) with extra options."""

    def __init__(self, model: str = "synthetic", extra: list[str] | None = None, startup_timeout: float = 60.0,
                 log_path: str | None = None, api_key: str | None = None):
        self.model = model
        self.extra = extra or []
        # the server requires it (POOT_API_KEY); /health stays open
        super().__init__(serve_command(0, model, self.extra), startup_timeout, log_path, name="poot-serve",
                         env={"POOT_API_KEY": api_key} if api_key else None, api_key=api_key)

    def argv(self, port: int) -> list[str]:
        return serve_command(port, self.model, self.extra)
