"""The facts layer: what a server publishes per kind, what a user gives, and what the suite
measures by timing on a server that shows nothing but the OpenAI API."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from poot.conformance.facts import Fact, Facts, FactsError, command_option, read_given
from poot.conformance.outcomes import NotSupported

CLI = [sys.executable, "-m", "poot.conformance.cli"]
HERE = Path(__file__).parent
OPENAI_ONLY = f"{sys.executable} {HERE / 'openai_only_server.py'} --model synthetic --step-delay 0.02 --port {{port}}"


def fake(routes: dict[str, tuple[int, object]]) -> httpx.Client:
    def handle(request: httpx.Request) -> httpx.Response:
        status, body = routes.get(request.url.path, (404, {"error": {"message": "no"}}))
        if isinstance(body, str):
            return httpx.Response(status, text=body)
        return httpx.Response(status, json=body)

    return httpx.Client(base_url="http://server", transport=httpx.MockTransport(handle))


LLAMACPP_METRICS = "\n".join(["# TYPE llamacpp:n_decode_total counter", "llamacpp:n_decode_total 12",
                              "llamacpp:requests_processing 0", "llamacpp:requests_deferred 0"])


def test_llamacpp_server_is_detected_from_props_and_its_metrics():
    http = fake({"/health": (200, {"status": "ok"}),
                 "/props": (200, {"total_slots": 8, "default_generation_settings": {"n_ctx": 2048}}),
                 "/metrics": (200, LLAMACPP_METRICS), "/v1/models": (200, {"object": "list", "data": [{"id": "m"}]})})
    facts = Facts.discover(http, command="llama-server -m x.gguf --port {port} -b 512 --parallel 8")
    assert facts.dialect == "llamacpp"
    assert facts.need("kind", "rows", "positions", "token_budget", "reservation") == {
        "kind": "llamacpp", "rows": 8, "positions": 2048, "token_budget": 512, "reservation": "per_slot"}
    assert facts.known["rows"].source == "/props total_slots"
    assert "--batch-size" in facts.known["token_budget"].source


def test_vllm_server_is_detected_from_its_metric_names():
    metrics = 'vllm:num_requests_running 0\nvllm:num_requests_waiting 0\nvllm:cache_config_info{block_size="16"} 1'
    http = fake({"/metrics": (200, metrics),
                 "/v1/models": (200, {"object": "list", "data": [{"id": "m", "max_model_len": 4096}]})})
    facts = Facts.discover(http, command="vllm serve m --max-num-seqs 64")
    assert facts.known["kind"].value == "vllm" and facts.dialect == "vllm"
    assert facts.need("positions", "block_size", "rows") == {"positions": 4096, "block_size": 16, "rows": 64}


def test_a_missing_fact_is_named_and_a_given_one_wins(tmp_path):
    http = fake({"/v1/models": (200, {"object": "list", "data": [{"id": "m"}]})})
    facts = Facts.discover(http)
    assert facts.known["kind"].value == "openai"
    with pytest.raises(NotSupported, match="needs fact token_budget"):
        facts.need("token_budget")
    file = tmp_path / "facts.yaml"
    file.write_text("rows: 4\nreservation: per_slot\n")
    given = read_given(str(file), ["token_budget=256"])
    facts = Facts.discover(http, given=given)
    assert facts.need("rows", "token_budget") == {"rows": 4, "token_budget": 256}
    report = facts.report()
    assert report["rows"]["source"] == f"facts file {file}" and report["token_budget"]["source"] == "--fact"
    assert "token_budget" in facts.report()


def test_bad_facts_are_refused(tmp_path):
    with pytest.raises(FactsError, match="unknown fact"):
        read_given(None, ["slots=4"])
    with pytest.raises(FactsError, match="whole number"):
        read_given(None, ["rows=many"])
    with pytest.raises(FactsError, match="reservation"):
        read_given(None, ["reservation=sometimes"])


def test_command_options_are_read_both_ways():
    assert command_option("srv -b 64 --port {port}", "-b", "--batch-size") == "64"
    assert command_option("srv --batch-size=32", "-b", "--batch-size") == "32"
    assert command_option("srv", "-b") is None


def outcomes(path: Path) -> dict[str, str]:
    return {c["id"]: c["outcome"] for c in json.loads(path.read_text())["clauses"]}


@pytest.mark.slow
@pytest.mark.parametrize("mutation, fails", [(None, None), ("one_row_per_step", "loop/batching/1"),
                                             ("ignore_disconnect_stream", "cancel/stream/1")])
def test_timing_alone_judges_batching_and_release(tmp_path, mutation, fails):
    """With /health, /metrics and /debug/fault hidden, both clauses still get verdicts, and each
    fails against a server that steps one row at a time or ignores a closed stream."""
    cmd = OPENAI_ONLY + (f" --mutation {mutation}" if mutation else "")
    report = tmp_path / "report.json"
    r = subprocess.run([*CLI, "--startup-timeout", "300", "--server-cmd", cmd, "--json", str(report),
                        "loop/batching/1", "cancel/stream/1"], capture_output=True, text=True, timeout=600)
    got = outcomes(report)
    data = json.loads(report.read_text())
    assert data["facts"]["kind"]["value"] == "openai", data["facts"]
    if fails is None:
        assert got == {"loop/batching/1": "passed", "cancel/stream/1": "passed"}, r.stdout[-3000:]
        assert data["facts"]["rows"]["source"].startswith("measured"), data["facts"]
    else:
        assert got[fails] == "failed", r.stdout[-3000:]
        other = next(c for c in got if c != fails)
        assert got[other] != "failed", r.stdout[-3000:]


@pytest.mark.slow
def test_fault_clauses_start_no_server_where_there_is_no_fault_injection(tmp_path):
    """A server without /debug/fault makes every faults/* clause "not supported" without
    starting a private server first (a slow one could time out and fail the clause instead):
    this command starts once and refuses a second start."""
    marker, report = tmp_path / "started", tmp_path / "report.json"
    once = f"sh -c 'if [ -e {marker} ]; then echo second start; exit 3; fi; touch {marker}; exec {OPENAI_ONLY}'"
    r = subprocess.run([*CLI, "--strict", "--server-cmd", once, "--json", str(report), "faults"],
                       capture_output=True, text=True, timeout=600)
    data = json.loads(report.read_text())
    got = {c["id"]: (c["outcome"], c["why"]) for c in data["clauses"]}
    assert len(got) == 6, r.stdout[-3000:]
    assert all(outcome == "not_supported" for outcome, _ in got.values()), got
    assert all("no fault injection" in why for cid, (_, why) in got.items() if cid.startswith("faults/dead")), got


def test_measuring_a_fact_may_ask_for_others():
    """rows is measured with requests that need positions and ignore_eos, asked for while
    rows is being measured: the asking must not wait on the measuring."""
    facts = Facts()
    facts.known["positions"] = Fact("positions", 512, "given")
    facts.measure_with("ignore_eos", lambda: (True, "probed"))
    facts.measure_with("rows", lambda: (facts.get("positions") // 16 + bool(facts.get("ignore_eos")), "measured"))
    done = threading.Event()
    got = []
    worker = threading.Thread(target=lambda: (got.append(facts.get("rows")), done.set()), daemon=True)
    worker.start()
    assert done.wait(10), "measuring rows waited for itself"
    assert got == [33] and facts.report()["rows"]["value"] == 33
