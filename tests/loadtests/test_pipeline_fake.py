"""The whole pipeline (locust child process, scraper, report, convoy) against a throwaway
fake SSE server. The real bundled server is exercised by test_smoke.py."""

import csv
import json

import pytest

from poot.loadtests import scrape
from poot.loadtests.cli import main

from .fakeserver import FakeServer


@pytest.fixture
def fake():
    with FakeServer(step_s=0.004) as s:
        yield s


def test_smoke_scenario_end_to_end(fake, tmp_path):
    out = tmp_path / "run"
    code = main(["smoke", "--url", fake.url, "--out", str(out), "--requests", "10", "--rate", "20",
                 "--run-time", "30", "--slo-ttft-ms", "500", "--quiet"])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    st = summary["stats"]
    assert st["requests"] == 10 and st["errors"] == 0
    assert st["ok"] + st["disconnected"] == 10 and st["ok"] >= 1
    assert summary["checks"]["server idle afterwards"]["ok"] is True
    assert summary["server"]["available"] is True
    assert fake.state.running == 0
    assert fake.state.finished["cancelled"] == st["disconnected"]
    # Locust's CSV carries the SSE timings next to the HTTP row, one TTFT per finished request.
    with open(out / "locust_stats.csv") as f:
        rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}
    assert int(rows[("SSE", "ttft")]["Request Count"]) == st["ok"]
    assert int(rows[("POST", "/v1/completions")]["Request Count"]) == 10
    for name in ("report.md", "latency_cdf.png", "timeline.png", "locust_stats_history.csv"):
        assert (out / name).exists(), name


def test_closed_loop_chat(fake, tmp_path):
    out = tmp_path / "closed"
    code = main(["closed", "--url", fake.url, "--out", str(out), "--requests", "6", "--concurrency", "2",
                 "--endpoint", "chat", "--output-lengths", "fixed:5", "--run-time", "30", "--quiet"])
    assert code == 0
    st = json.loads((out / "summary.json").read_text())["stats"]
    assert st["ok"] == 6 and st["output_tokens"] == 30


def test_errors_are_counted_not_fatal(fake, tmp_path):
    # max_tokens above the fake server's cap -> HTTP 400 for every request.
    out = tmp_path / "err"
    code = main(["poisson", "--url", fake.url, "--out", str(out), "--requests", "3", "--rate", "50",
                 "--output-lengths", "fixed:450", "--max-context", "2000", "--run-time", "20", "--quiet"])
    assert code == 1
    st = json.loads((out / "summary.json").read_text())["stats"]
    assert st["errors"] == 3 and "HTTP 400" in next(iter(st["error_kinds"]))


def test_convoy_against_fake(fake, tmp_path):
    out = tmp_path / "convoy"
    code = main(["convoy", "--url", fake.url, "--out", str(out), "--requests", "12", "--rate", "40",
                 "--batch", "4", "--output-lengths", "uniform:4:40", "--run-time", "60", "--quiet"])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    rows = {r["policy"]: r for r in summary["rows"]}
    assert set(rows) == {"static", "dynamic", "continuous"}
    assert all(r["errors"] == 0 and r["requests"] == 12 for r in rows.values())
    assert rows["continuous"]["ttft_p50"] < rows["static"]["ttft_p50"]
    assert (out / "convoy.png").exists() and "| static |" in (out / "report.md").read_text()


def test_wait_idle_without_metrics():
    assert scrape.wait_idle("http://127.0.0.1:9", timeout=0.5)["ok"] is None


def test_open_loop_waits_for_users_sleeping_until_their_arrival(fake, tmp_path):
    # Short requests and sparse arrivals: most users sleep while no request is in flight; the
    # run must still send every request before it stops.
    out = tmp_path / "sparse"
    code = main(["poisson", "--url", fake.url, "--out", str(out), "--requests", "8", "--rate", "6",
                 "--output-lengths", "fixed:2", "--run-time", "30", "--quiet"])
    assert code == 0
    st = json.loads((out / "summary.json").read_text())["stats"]
    assert st["requests"] == 8 and st["ok"] == 8
    assert st["schedule_lag"]["max"] < 0.5


KEY = "load-" + "k" * 20


def _all_text(folder) -> str:
    return "".join(p.read_text(errors="replace") for p in folder.rglob("*") if p.is_file() and p.suffix != ".png")


@pytest.mark.parametrize("how", ["option", "environment"])
def test_the_api_key_is_sent_on_every_request_and_never_shown(how, tmp_path, capsys, monkeypatch):
    out = tmp_path / "keyed"
    args = ["smoke", "--url", "URL", "--out", str(out), "--requests", "6", "--rate", "20", "--run-time", "30"]
    if how == "option":
        monkeypatch.delenv("OPENAI_API_KEY", raising=False)
        args += ["--api-key", KEY]
    else:
        monkeypatch.setenv("OPENAI_API_KEY", KEY)
    with FakeServer(step_s=0.004, key=KEY) as fake:
        code = main([fake.url if a == "URL" else a for a in args])
        refused = dict(fake.state.refused)
    assert code == 0, capsys.readouterr().out[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stats"]["errors"] == 0 and summary["stats"]["requests"] == 6
    assert summary["server"]["available"] is True  # the /metrics scrapes carried the key
    assert summary["checks"]["server idle afterwards"]["ok"] is True
    assert refused == {}, f"requests without the key: {refused}"
    shown = capsys.readouterr()
    assert KEY not in shown.out + shown.err and KEY not in _all_text(out)


def test_without_the_key_a_keyed_server_refuses_the_load(tmp_path, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    out = tmp_path / "unkeyed"
    with FakeServer(step_s=0.004, key=KEY) as fake:
        code = main(["smoke", "--url", fake.url, "--out", str(out), "--requests", "3", "--rate", "20",
                     "--run-time", "20", "--quiet"])
        refused = dict(fake.state.refused)
    assert code == 1 and refused.get("/v1/completions") == 3


def test_convoy_sends_the_key(tmp_path, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    out = tmp_path / "convoy"
    with FakeServer(step_s=0.004, key=KEY) as fake:
        code = main(["convoy", "--url", fake.url, "--out", str(out), "--requests", "6", "--rate", "40", "--batch", "2",
                     "--output-lengths", "fixed:4", "--run-time", "60", "--quiet", "--api-key", KEY])
        refused = dict(fake.state.refused)
    assert code == 0 and refused == {}
    assert KEY not in _all_text(out)
