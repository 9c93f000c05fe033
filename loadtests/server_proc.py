"""Starts the bundled server on a free loopback port and stops it afterwards."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(port: int, model: str = "synthetic", extra: list[str] | None = None) -> list[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "poot-serve")
    if not os.path.exists(exe):
        exe = shutil.which("poot-serve") or exe
    return [exe, "--model", model, "--host", "127.0.0.1", "--port", str(port)] + list(extra or [])


class BundledServer:
    """Context manager: `with BundledServer() as url: ...`."""

    def __init__(self, model: str = "synthetic", extra: list[str] | None = None, startup_timeout: float = 60.0,
                 log_path: str | None = None, api_key: str | None = None):
        self.model = model
        self.extra = extra or []
        self.startup_timeout = startup_timeout
        self.log_path = log_path
        self.api_key = api_key  # the server requires it (POOT_API_KEY); /health stays open
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self._log = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> str:
        self.port = free_port()
        cmd = serve_command(self.port, self.model, self.extra)
        self._log = open(self.log_path, "w", encoding="utf-8") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        env = {**os.environ, "POOT_API_KEY": self.api_key} if self.api_key else None
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + self.startup_timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"poot-serve exited with code {self.proc.returncode} before it was healthy "
                                   f"(command: {' '.join(cmd)})")
            try:
                r = httpx.get(self.url + "/health", timeout=1.0)
                if r.status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"poot-serve did not answer GET /health with 200 within {self.startup_timeout:.0f}s")

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        if self._log not in (None, subprocess.DEVNULL):
            self._log.close()
        code = self.proc.returncode
        self.proc = None
        return code

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
