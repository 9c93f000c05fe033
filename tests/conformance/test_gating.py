"""What a CI gating its own server relies on: expectations, the side-by-side matrix, an API
key that never shows, and a suite that runs without the engine's libraries."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml

CLI = [sys.executable, "-m", "poot.conformance.cli"]
KEY = "sekrit-" + "k" * 16


class Stub(BaseHTTPRequestHandler):
    """/health and /v1/models only; with `key` set, /v1/* needs it as a bearer token."""

    health_status = 200
    key: str | None = None

    def do_GET(self):  # noqa: N802 - http.server's naming
        if self.path == "/health":
            return self._send(self.health_status, {"status": "ok"})
        if self.key and self.headers.get("authorization") != f"Bearer {self.key}":
            return self._send(401, {"error": {"message": "bad key", "type": "invalid_request_error",
                                              "param": None, "code": "invalid_api_key"}})
        if self.path == "/v1/models":
            return self._send(200, {"object": "list", "data": [{"id": "stub"}]})
        self._send(404, {"error": {"message": "no", "type": "not_found", "param": None, "code": None}})

    def _send(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    Stub.health_status, Stub.key = 200, None


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(CLI + list(args), capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None})


def test_expectations_round_trip(url, tmp_path):
    baseline = tmp_path / "expected.yaml"
    first = cli("--base-url", url, "api/health", "api/models", "metrics/names", "--write-expectations", str(baseline))
    assert first.returncode == 0, first.stdout[-2000:]
    written = yaml.safe_load(baseline.read_text())["clauses"]
    assert written["metrics/names/1"]["expected"] == "not_supported" and written["metrics/names/1"]["reason"]
    again = cli("--base-url", url, "api/health", "api/models", "metrics/names", "--expectations", str(baseline))
    assert again.returncode == 0, again.stdout[-2000:]
    assert "3 of 3 clauses as expected" in again.stdout

    Stub.health_status = 500  # a regression: expected to pass, now failed
    broken = cli("--base-url", url, "api/health", "api/models", "metrics/names", "--expectations", str(baseline))
    assert broken.returncode == 1
    regressions = broken.stdout.split("Regressions", 1)[1]
    assert "api/health/1: expected passed, got failed" in regressions.split("\n\n")[0]
    Stub.health_status = 200

    written["api/models/1"] = {"expected": "failed", "reason": "known gap"}  # now passes unexpectedly
    baseline.write_text(yaml.safe_dump({"clauses": written}))
    changed = cli("--base-url", url, "api/health", "api/models", "metrics/names", "--expectations", str(baseline))
    assert changed.returncode == 1
    assert "Unexpected passes" in changed.stdout and "api/models/1: expected failed, got passed" in changed.stdout


def test_a_rewrite_keeps_what_was_confirmed_by_hand(url, tmp_path):
    baseline = tmp_path / "expected.yaml"
    baseline.write_text(yaml.safe_dump({"clauses": {
        "metrics/names/1": {"expected": "not_supported", "reason": "no /metrics", "confirmed": "curl: 404"},
        "api/health/1": {"expected": "failed", "reason": "was down", "confirmed": "curl: 500"}}}))
    cli("--base-url", url, "api/health", "metrics/names", "--write-expectations", str(baseline))
    written = yaml.safe_load(baseline.read_text())["clauses"]
    assert written["metrics/names/1"] == {"expected": "not_supported", "reason": "no /metrics", "confirmed": "curl: 404"}
    assert written["api/health/1"] == {"expected": "passed"}  # the outcome changed: the confirmation goes


def test_known_failures_in_the_expectations_exit_zero(url, tmp_path):
    Stub.health_status = 500
    baseline = tmp_path / "expected.yaml"
    baseline.write_text(yaml.safe_dump({"clauses": {"api/health/1": {"expected": "failed", "reason": "no health"}}}))
    r = cli("--base-url", url, "api/health", "--expectations", str(baseline))
    assert r.returncode == 0, r.stdout[-2000:]
    plain = cli("--base-url", url, "api/health")
    assert plain.returncode == 1


def test_compare_writes_a_matrix_of_clauses_by_servers(url, tmp_path):
    a, b = tmp_path / "ours.json", tmp_path / "theirs.json"
    cli("--base-url", url, "api/health", "metrics/names", "--json", str(a))
    Stub.health_status = 500
    cli("--base-url", url, "api/health", "metrics/names", "--json", str(b))
    out = tmp_path / "matrix.md"
    r = cli("compare", str(a), str(b), "--markdown", str(out))
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert "| clause | title | source | ours | theirs |" in text
    row = next(line for line in text.splitlines() if line.startswith("| `api/health/1`"))
    assert "pass" in row and "**fail**" in row and "| design choice |" in row
    total = next(line for line in text.splitlines() if "**total**" in line)
    assert "1 failed (1 of them design choices)" in total, total
    took = next(line for line in text.splitlines() if "run took" in line)
    assert took.count(" s |") == 2, took  # each run's duration, in its column
    assert text == r.stdout


def test_the_api_key_is_sent_and_never_shown(url, tmp_path):
    Stub.key = KEY
    report, md = tmp_path / "r.json", tmp_path / "r.md"
    keyed = cli("--base-url", url, "api/models", "api/auth", "--api-key", KEY, "--json", str(report), "--markdown", str(md))
    outcomes = {c["id"]: c["outcome"] for c in json.loads(report.read_text())["clauses"]}
    assert outcomes["api/models/1"] == "passed", keyed.stdout[-2000:]
    for text in (keyed.stdout, keyed.stderr, report.read_text(), md.read_text()):
        assert KEY not in text
    from_env = cli("--base-url", url, "api/models", env={"OPENAI_API_KEY": KEY})
    assert from_env.returncode == 0, from_env.stdout[-2000:]
    unkeyed = cli("--base-url", url, "api/models", "api/auth", "--json", str(report), env={"OPENAI_API_KEY": None})
    outcomes = {c["id"]: c["outcome"] for c in json.loads(report.read_text())["clauses"]}
    assert unkeyed.returncode == 1 and outcomes == {"api/models/1": "failed", "api/auth/1": "not_supported"}


def test_auth_clause_fails_on_a_server_that_takes_any_request(url, tmp_path):
    """api/auth/1's broken variant: a server that takes unkeyed requests though a key was given."""
    report = tmp_path / "r.json"
    cli("--base-url", url, "api/auth", "--api-key", KEY, "--json", str(report))
    clause = json.loads(report.read_text())["clauses"][0]
    assert clause["outcome"] == "failed" and "expected 401" in clause["why"], clause


NO_NUMPY = """
import sys
from poot.conformance.cli import main
code = main(sys.argv[1:])
assert "numpy" not in sys.modules, "numpy was imported"
sys.exit(code)
"""


@pytest.mark.parametrize("args", [["--list"], ["--base-url", "URL", "api/health", "api/models"]])
def test_the_suite_imports_no_numpy(url, args):
    args = [url if a == "URL" else a for a in args]
    r = subprocess.run([sys.executable, "-c", NO_NUMPY, *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


def test_a_command_without_its_extra_says_which_to_install(monkeypatch, capsys):
    from poot import extras

    monkeypatch.setattr(extras, "missing", lambda extra: ["matplotlib"] if extra == "load" else [])
    assert extras.load() == 2
    assert "pip install 'poot[load]'" in capsys.readouterr().err
