"""The server's life in a run, against a stub server (tests/conformance/stub_server.py): a
start that reports progress is waited for, one that never gets ready is reported once, and a
clause during which the server stopped serving is `crashed`, naming its request, with the
clauses after it judged on a fresh server (a command) or not run (a URL)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from poot.conformance.client import JOURNAL, Client
from poot.conformance.life import Life, trigger_of
from poot.conformance.target import ServerCommand, ServerStartError, free_port, loading_body, wait_ready

STUB = Path(__file__).resolve().parent / "stub_server.py"
CLI = [sys.executable, "-m", "poot.conformance.cli"]
SCOPE = ["api/models", "api/errors/2", "api/errors/5"]  # run in this order: the crash falls between two passes


def stub(*args: str) -> str:
    return " ".join([shlex.quote(sys.executable), shlex.quote(str(STUB)), "--port", "{port}", *args])


def run(tmp_path: Path, *args: str, timeout: float = 180) -> tuple[subprocess.CompletedProcess, dict, float]:
    out = tmp_path / "report.json"
    began = time.monotonic()
    r = subprocess.run(CLI + ["--strict", "--json", str(out), *args], capture_output=True, text=True, timeout=timeout)
    took = time.monotonic() - began
    assert out.exists(), r.stdout[-3000:] + r.stderr[-3000:]
    return r, json.loads(out.read_text()), took


def outcomes(report: dict) -> dict[str, str]:
    return {c["id"]: c["outcome"] for c in report["clauses"]}


# ---- starting ---------------------------------------------------------------------------------


def test_loading_bodies_of_poot_and_llamacpp_are_told_apart_from_other_503s():
    assert loading_body(503, '{"status": "loading", "phase": "compile", "progress": 0.27}')["phase"] == "compile"
    assert loading_body(503, '{"error": {"message": "Loading model", "type": "unavailable_error", "code": 503}}')
    assert loading_body(503, '{"status": "dead", "cause": "fault"}') is None
    assert loading_body(500, '{"status": "loading"}') is None
    assert loading_body(503, "Service Unavailable") is None


def test_a_start_that_reports_progress_is_waited_for_beyond_the_timeout():
    process = ServerCommand(stub("--loading-s", "4"), startup_timeout=1.0).spawn()
    try:
        seen = []
        began = time.monotonic()
        process.wait_healthy(1.0, on_progress=seen.append)
        assert time.monotonic() - began >= 3.0
        assert len({json.dumps(b) for b in seen}) >= 3 and seen[0]["status"] == "loading"
    finally:
        process.stop()


def test_a_start_that_reports_no_progress_is_bounded_by_the_timeout():
    process = ServerCommand(stub("--loading-s", "60", "--no-progress"), startup_timeout=1.5).spawn()
    began = time.monotonic()
    with pytest.raises(ServerStartError, match="reported no progress for 2 s") as e:
        process.wait_healthy(1.5)
    assert time.monotonic() - began < 15
    assert '"status": "loading"' in str(e.value) and "stub server on port" in str(e.value)  # its log
    assert process.proc.poll() is not None  # stopped


def test_the_overall_cap_ends_even_a_wait_with_progress(tmp_path):
    process = ServerCommand(stub("--loading-s", "60")).spawn()
    try:
        # the stub's body changes once a second: a 2.5 s stall window leaves a busy machine's
        # late polls room, so only the cap can end this wait
        with pytest.raises(ServerStartError, match="still starting after 5 s"):
            wait_ready(process.url, 2.5, process.proc.poll, cap=5.0)
    finally:
        process.stop()


def test_a_server_that_never_gets_ready_is_reported_once_and_nothing_is_run(tmp_path):
    r, report, took = run(tmp_path, "--server-cmd", "sleep 600 # {port}", "--startup-timeout", "4", *SCOPE)
    assert r.returncode == 1
    assert set(outcomes(report).values()) == {"not_run"}
    assert {c["why"] for c in report["clauses"]} == {"not run: the server did not start"}
    assert "was not ready for 4 s" in report["not_started"] and report["summary"]["server_started"] is False
    assert r.stdout.count("The server did not start") == 1 and r.stdout.count("was not ready for 4 s") == 1
    assert took < 60  # within the startup timeout and a few seconds, not the default 60 s per clause


def test_a_command_without_a_port_is_a_usage_error_said_once():
    r = subprocess.run(CLI + ["--server-cmd", "sleep 600"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 4 and r.stdout.count("{port}") + r.stderr.count("{port}") == 1, r.stdout + r.stderr


def test_a_command_that_exits_at_once_is_reported_with_its_log(tmp_path):
    command = f"{shlex.quote(sys.executable)} -c 'import sys; print(\"no model here\"); sys.exit(3)' {{port}}"
    r, report, took = run(tmp_path, "--server-cmd", command, *SCOPE)
    assert r.returncode == 1 and set(outcomes(report).values()) == {"not_run"}
    assert "exited with status 3" in report["not_started"] and "no model here" in report["not_started"]
    assert r.stdout.count("\n  no model here\n") == 1  # the log's line, once (the command quotes it too)


def test_a_server_that_reports_progress_past_the_timeout_is_judged(tmp_path):
    r, report, _ = run(tmp_path, "--server-cmd", stub("--loading-s", "6"), "--startup-timeout", "2",
                       "api/models", "api/errors/5")
    assert outcomes(report) == {"api/models/1": "passed", "api/errors/5": "passed"}, r.stdout[-2000:]
    assert "the server is starting: compile" in r.stderr


# ---- crashing ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["die", "exit"])
def test_a_crash_is_named_and_a_fresh_server_judges_the_rest(tmp_path, mode):
    r, report, _ = run(tmp_path, "--server-cmd", stub("--on-no-prompt", mode), *SCOPE)
    got = outcomes(report)
    assert got == {"api/models/1": "passed", "api/errors/2": "crashed", "api/errors/5": "passed"}, r.stdout[-3000:]
    assert r.returncode == 1
    [crash] = report["crashes"]
    assert crash["clause"] == "api/errors/2"
    assert crash["request"].startswith("POST /v1/completions") and '"max_tokens":4' in crash["request"]
    assert '"prompt"' not in crash["request"]  # the request without a prompt is the one named
    seen = "its process exited with status 1" if mode == "exit" else "/health answered 503"
    assert crash["seen"].startswith(seen), crash
    assert crash["then"].startswith("a fresh server judged the clauses after it")
    why = next(c["why"] for c in report["clauses"] if c["id"] == "api/errors/2")
    assert why.startswith("the server stopped serving during this clause") and "POST /v1/completions" in why
    said = r.stdout.find("The server stopped serving once:\n  at api/errors/2, after POST /v1/completions")
    assert 0 <= said < r.stdout.find("api: OpenAI-compatible HTTP API"), r.stdout  # first, before the tree


@pytest.mark.parametrize("mode", ["die", "exit"])
def test_with_a_url_the_clauses_after_a_crash_are_not_run(tmp_path, mode):
    port = free_port()
    server = ServerCommand(stub("--on-no-prompt", mode)).start(port=port)
    try:
        r, report, _ = run(tmp_path, "--base-url", server.url, *SCOPE)
    finally:
        server.stop()
    assert outcomes(report) == {"api/models/1": "passed", "api/errors/2": "crashed", "api/errors/5": "not_run"}
    assert report["clauses"][2]["why"] == "not run: the server stopped serving at api/errors/2"
    assert report["crashes"][0]["then"].startswith("the clauses after it were not run")
    assert r.returncode == 1


def test_a_server_whose_health_says_ok_while_every_request_fails_is_seen_to_crash(tmp_path):
    r, report, _ = run(tmp_path, "--server-cmd", stub("--on-no-prompt", "die", "--health-stays-ok"), *SCOPE)
    assert outcomes(report) == {"api/models/1": "passed", "api/errors/2": "crashed", "api/errors/5": "passed"}
    assert report["crashes"][0]["seen"].startswith("a one-token completion answered 503"), report["crashes"]


def test_a_server_that_keeps_serving_after_5xx_answers_is_not_crashed(tmp_path):
    """The stub's plain mode answers the bad requests with 400 or 200, and serves on: no crash."""
    r, report, _ = run(tmp_path, "--server-cmd", stub(), *SCOPE)
    assert outcomes(report)["api/errors/2"] == "failed" and report["crashes"] == []


def test_the_journal_names_the_request_that_stopped_the_server():
    server = ServerCommand(stub("--on-no-prompt", "die")).start()
    client = Client(server.url, model="stub")
    try:
        life = Life(server.url, process=server, model=lambda: "stub")
        life.begin()
        client.complete("hello", max_tokens=2)
        assert life.end("a") is None  # serving
        life.begin()
        client.post("/v1/completions", {"model": "stub", "max_tokens": 3})
        client.post("/v1/completions", {"model": "stub", "prompt": "after", "max_tokens": 3})
        crash = life.end("b")
        assert crash is not None and crash.clause == "b"
        assert crash.trigger.request_line() == 'POST /v1/completions {"model":"stub","max_tokens":3}'
        assert crash.trigger.status == 500 and b"worker crashed" in crash.trigger.answer
        assert [s.status for s in crash.last] == [500, 503]
    finally:
        client.close()
        server.stop()


def test_the_trigger_is_the_first_of_the_failures_that_end_a_clause():
    sent = [JOURNAL.add("http://x", "POST", f"/{i}") for i in range(4)]
    for s, status in zip(sent, (200, 500, 200, 503), strict=True):
        s.status = status
    assert trigger_of(sent).path == "/3"
    sent[2].status = 502
    assert trigger_of(sent).path == "/1"
    assert trigger_of([]) is None


@pytest.mark.slow
def test_the_reference_server_behind_a_long_start_with_progress_is_judged(tmp_path):
    slow = Path(__file__).resolve().parent / "slow_start_server.py"
    command = " ".join([shlex.quote(sys.executable), shlex.quote(str(slow)), "--loading-s", "12",
                        "--model", "synthetic", "--port", "{port}"])
    r, report, took = run(tmp_path, "--server-cmd", command, "--startup-timeout", "5", "api/health", "api/models",
                          timeout=400)
    assert outcomes(report) == {"api/health/1": "passed", "api/models/1": "passed"}, r.stdout[-3000:]
    assert "the server is starting: model" in r.stderr and took >= 12
