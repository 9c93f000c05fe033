"""Report folder and comparison built from recorded synthetic data (no server)."""

import json
import random

from poot.loadtests import report, stats
from poot.loadtests.cli import main


def synthetic_run(seed=0, n=30, step=0.02, stall=0.0):
    rng = random.Random(seed)
    records, samples = [], []
    t = 1000.0
    for i in range(n):
        t += rng.expovariate(5.0)
        ttft = rng.uniform(0.05, 0.2)
        chunks = [ttft + k * step * rng.uniform(0.9, 1.1) for k in range(rng.randint(5, 60))]
        if stall and i % 7 == 0:
            chunks = chunks[:3] + [c + stall for c in chunks[3:]]
        status = "ok" if i % 11 else "disconnected"
        records.append({"id": i, "kind": "main", "status": status, "t_sent": t, "t_scheduled": t - 0.001,
                        "chunks": chunks, "end": chunks[-1] + 0.001, "completion_tokens": len(chunks),
                        "prompt_tokens": 50, "cached_tokens": 16})
    for k in range(40):
        samples.append({"t": 1000.0 + 0.25 * k, "engine_requests_running": k % 5, "engine_requests_waiting": k % 2,
                        "kv_blocks_in_use": 2 * (k % 5), "kv_blocks_reserved": 3 * (k % 5), "kv_blocks_total": 64.0,
                        "prefix_cache_hit_rate": min(1.0, k / 40), "generation_tokens_total": 10.0 * k})
    return records, samples


def test_write_report_folder(tmp_path):
    records, samples = synthetic_run()
    meta = {"scenario": "poisson", "url": "http://127.0.0.1:1", "config": {"seed": 0}, "planned_requests": 30}
    checks = {"server idle afterwards": {"ok": True, "text": "idle"}}
    summary = report.write_report(str(tmp_path), records, samples, meta, stats.Slo(0.15, 0.05), checks)
    for name in ("summary.json", "report.md", "latency_cdf.png", "timeline.png", "server_metrics.csv"):
        assert (tmp_path / name).stat().st_size > 0, name
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["stats"]["requests"] == 30 and on_disk["stats"]["disconnected"] == 3
    assert summary["server"]["peak_running"] == 4 and summary["server"]["kv_blocks_total"] == 64
    assert summary["server"]["generation_tokens"] == 390
    assert summary["usage"]["cached_tokens"] == 16 * 30
    md = (tmp_path / "report.md").read_text()
    assert "| TTFT |" in md and "PASS" in md and "![timeline.png](timeline.png)" in md
    assert 0 < summary["stats"]["goodput"] < 1


def test_report_without_server_metrics(tmp_path):
    records, _ = synthetic_run(n=5)
    report.write_report(str(tmp_path), records, [], {"scenario": "x"}, stats.Slo())
    assert "No /metrics endpoint" in (tmp_path / "report.md").read_text()
    assert (tmp_path / "timeline.png").exists()


def test_compare_two_reports(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    for folder, stall in ((a, 0.0), (b, 0.5)):
        records, samples = synthetic_run(stall=stall)
        report.write_report(str(folder), records, samples, {"scenario": "poisson"}, stats.Slo())
    assert main(["compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "| metric | a | b | change |" in out
    gap_row = next(line for line in out.splitlines() if line.startswith("| gap max ms"))
    assert "+" in gap_row.split("|")[4]  # b has the stalls


def test_load_records_merges_worker_files(tmp_path):
    (tmp_path / "requests-a-1.jsonl").write_text(json.dumps({"id": 1, "t_sent": 2.0}) + "\n")
    (tmp_path / "requests-b-2.jsonl").write_text(json.dumps({"id": 0, "t_sent": 1.0}) + "\n\n")
    assert [r["id"] for r in report.load_records(str(tmp_path))] == [0, 1]


def test_convoy_table_and_plot(tmp_path):
    from poot.loadtests import convoy
    results = []
    for policy, wait in (("static", 0.5), ("dynamic", 0.1), ("continuous", 0.0)):
        recs = []
        for i in range(8):
            arrival = 0.1 * i
            chunks = [0.05 + 0.01 * k for k in range(10 + i)]
            recs.append({"id": i, "status": "ok", "t_arrival": arrival, "t_sent": arrival + wait, "chunks": chunks,
                         "end": chunks[-1], "completion_tokens": len(chunks)})
        results.append({"policy": policy, "t0": 0.0, "t_end": 2.0, "wall_start": 0.0, "records": recs})
    rows = [convoy.policy_row(r) for r in results]
    assert rows[0]["ttft_p50"] > rows[2]["ttft_p50"]
    assert rows[2]["tpot_p50"] == rows[0]["tpot_p50"]
    text = convoy.table(rows)
    assert text.count("\n") == 4 and "| continuous |" in text
    assert (tmp_path / "c.png").exists() is False
    report.plot_convoy(results, [], str(tmp_path / "c.png"))
    assert (tmp_path / "c.png").stat().st_size > 0


def test_rebuild_report_from_worker_files(tmp_path):
    records, _ = synthetic_run(n=12)
    for i, part in enumerate((records[:6], records[6:])):
        with open(tmp_path / f"requests-w{i}-{i}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)
    assert main(["report", str(tmp_path), "--quiet"]) == 0
    assert json.loads((tmp_path / "summary.json").read_text())["stats"]["requests"] == 12
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["report", str(empty), "--quiet"]) == 1
