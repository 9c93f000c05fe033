"""The plugin end to end, without the reference server: traceability, and outcomes against a
stub server that lacks /metrics (not supported) or answers /health 500 (failure)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from poot.conformance.clauses import SUITE_DIR, load_spec
from poot.conformance.plugin import check_traceability

CLI = [sys.executable, "-m", "poot.conformance.cli"]


def test_traceability_flags_unknown_untagged_and_untested():
    spec = load_spec()
    tagged = {"a::t1": ("api/health/1",), "a::t2": (), "a::t3": ("api/nope/1",)}
    problems = check_traceability(spec, tagged, complete=True)
    assert "a::t2 names no clause (add @pytest.mark.clause(...))" in problems
    assert "a::t3 names unknown clause 'api/nope/1'" in problems
    assert "clause api/sse/1 has no test" in problems
    assert not any("api/health/1 has no test" in p for p in problems)
    assert check_traceability(spec, {"a::t1": ("api/health/1",)}, complete=False) == []


def test_installed_suite_is_traceable():
    r = subprocess.run([sys.executable, "-m", "pytest", "-c", str(SUITE_DIR / "pytest.ini"), "--rootdir",
                        str(SUITE_DIR), str(SUITE_DIR), "--collect-only", "-q"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


class Stub(BaseHTTPRequestHandler):
    health_status = 200

    def do_GET(self):  # noqa: N802 - http.server's naming
        if self.path == "/health":
            self._send(self.health_status, {"status": "ok"})
        elif self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": "stub"}]})
        else:
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
def stub():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    Stub.health_status = 200


def run_cli(url: str, tmp_path, *args: str) -> tuple[int, dict]:
    out = tmp_path / "report.json"
    r = subprocess.run(CLI + ["--base-url", url, "--json", str(out), *args], capture_output=True, text=True, timeout=120)
    return r.returncode, json.loads(out.read_text())


def test_missing_metrics_is_not_supported_and_partial(stub, tmp_path):
    url = f"http://127.0.0.1:{stub.server_address[1]}"
    code, report = run_cli(url, tmp_path, "metrics/names", "api/health")
    outcomes = {c["id"]: c["outcome"] for c in report["clauses"]}
    assert outcomes == {"api/health/1": "passed", "metrics/names/1": "not_supported"}
    assert report["summary"]["result"] == "partial" and code == 0


def test_startup_clauses_are_not_supported_with_only_a_url(stub, tmp_path):
    url = f"http://127.0.0.1:{stub.server_address[1]}"
    code, report = run_cli(url, tmp_path, "startup/options")
    assert report["clauses"][0]["outcome"] == "not_supported"
    assert "--base-url" in report["clauses"][0]["why"]


def test_failing_clause_makes_the_run_fail(stub, tmp_path):
    Stub.health_status = 500
    url = f"http://127.0.0.1:{stub.server_address[1]}"
    code, report = run_cli(url, tmp_path, "api/health")
    assert report["summary"]["result"] == "failure" and code == 1
    assert "answered 500" in report["clauses"][0]["why"]
