"""Smoke run against the real bundled server: `poot-load smoke --serve`, end to end.

Tens of seconds: starts `poot-serve --model synthetic` on a free port, runs a short open-loop
workload with a shared system prompt and clients that leave mid-stream, writes the report
folder, and checks the server ends idle (nothing running or waiting, no KV block reserved).
Long runs are documented in loadtests/README.md and not run here.
"""

import csv
import json

import pytest

from poot.loadtests import scrape
from poot.loadtests.cli import main
from poot.loadtests.server_proc import BundledServer

pytest.importorskip("poot.server.cli", reason="the bundled server is not in this build")

pytestmark = pytest.mark.slow


def test_smoke_against_bundled_server(tmp_path):
    out = tmp_path / "smoke"
    code = main(["smoke", "--serve", "--out", str(out), "--run-time", "60", "--slo-ttft-ms", "2000",
                 "--quiet"])
    summary = json.loads((out / "summary.json").read_text())
    st = summary["stats"]
    assert st["requests"] == summary["planned_requests"] == 16
    assert st["errors"] == 0, st["error_kinds"]
    assert st["disconnected"] >= 1 and st["ok"] >= 1
    assert st["ttft"]["count"] == st["ok"] and st["itl"]["count"] > 0
    # The server's own counts: usage came back and /metrics was scraped during the run.
    assert summary["usage"]["requests_with_usage"] == st["ok"]
    sv = summary["server"]
    assert sv["available"] and sv["peak_kv_reserved"] is not None and sv["generation_tokens"] > 0
    idle = summary["checks"]["server idle afterwards"]
    assert idle["ok"] is True, idle
    assert code == 0
    with open(out / "locust_stats.csv") as f:
        names = {(r["Type"], r["Name"]) for r in csv.DictReader(f)}
    assert {("POST", "/v1/completions"), ("SSE", "ttft"), ("SSE", "tpot"), ("SSE", "gap_p99")} <= names
    for name in ("report.md", "latency_cdf.png", "timeline.png", "server_metrics.csv", "server.log"):
        assert (out / name).stat().st_size > 0, name


def test_disconnect_storm_leaves_server_idle(tmp_path):
    out = tmp_path / "storm"
    with BundledServer(log_path=str(tmp_path / "server.log")) as url:
        code = main(["disconnect", "--url", url, "--out", str(out), "--requests", "24", "--rate", "40",
                     "--run-time", "60", "--quiet"])
        after = scrape.fetch(url)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stats"]["disconnected"] >= 12 and summary["stats"]["errors"] == 0
    assert summary["checks"]["server idle afterwards"]["ok"] is True
    assert after["engine_requests_running"] == 0 and after["kv_blocks_reserved"] == 0
    assert code == 0
