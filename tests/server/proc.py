"""Starts `poot-serve` as a real process on a free loopback port, for the server tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from poot.conformance import prometheus
from poot.conformance.target import free_port

EXE = str(Path(sys.executable).parent / "poot-serve")
TESTS = str(Path(__file__).resolve().parents[1])
MUTANTS = (sys.executable, "-m", "poot_mutants.serve")  # the deliberately broken servers (tests only)


class Server:
    def __init__(self, *extra: str, model: str = "synthetic", wait: bool = True, env: dict | None = None,
                 exe: tuple[str, ...] = (EXE,)):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile()  # noqa: SIM115
        self.cmd = [*exe, "--model", model, "--port", str(self.port), "--log-level", "warning", *extra]
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONPATH": TESTS, **(env or {})})
        self.client = httpx.Client(base_url=self.url, timeout=30)
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"poot-serve exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"poot-serve not healthy within {timeout}s:\n{self.output()}")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def stop(self) -> int:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()
        return self.proc.returncode

    # ---- HTTP helpers --------------------------------------------------------------------

    def post(self, path: str, body) -> httpx.Response:
        return self.client.post(path, json=body)

    def complete(self, **body) -> dict:
        r = self.post("/v1/completions", body)
        assert r.status_code == 200, r.text
        return r.json()

    def stream(self, path: str, body: dict) -> tuple[list, httpx.Response]:
        """Streams a request; returns (events, response): each event a dict, or "[DONE]"."""
        with self.client.stream("POST", path, json={**body, "stream": True}) as r:
            if r.status_code != 200:
                r.read()
                return [], r
            assert r.headers["content-type"].startswith("text/event-stream")
            return parse_sse(r.iter_lines()), r

    def metrics(self) -> dict[str, float]:
        return prometheus.parse_flat(self.client.get("/metrics").text)

    def wait_metric(self, name: str, pred, timeout: float = 10.0, moving: str | None = None) -> dict[str, float]:
        """Polls /metrics until `name` satisfies `pred`, for `timeout` seconds; with `moving`
        (a counter's name), for `timeout` seconds after that counter last moved, so a request
        that runs to its end on a slow or busy machine is waited for while it still runs."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            m = self.metrics()
            if pred(m.get(name)):
                return m
            if moving is not None and m.get(moving) != last:
                last, deadline = m.get(moving), time.monotonic() + timeout
            time.sleep(0.005)
        raise AssertionError(f"{name} never satisfied the condition; last {m.get(name)}")


def parse_sse(lines) -> list:
    """Parses SSE strictly: each event is one `data: ` line followed by a blank line."""
    events, expect_blank = [], False
    for line in lines:
        if expect_blank:
            assert line == "", f"expected a blank line after an event, got {line!r}"
            expect_blank = False
            continue
        assert line.startswith("data: "), f"not an SSE data line: {line!r}"
        assert not events or events[-1] != "[DONE]", "data after [DONE]"
        payload = line[len("data: "):]
        events.append("[DONE]" if payload == "[DONE]" else json.loads(payload))
        expect_blank = True
    return events


def run_cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([EXE, *args], capture_output=True, text=True, timeout=timeout)
