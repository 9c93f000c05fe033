"""Scale-out for real: `poot-load --workers 2` runs locust's master and two forked worker
processes against the bundled server; the merged report counts every request once, each
worker sent its own share, and the master stopped when the workers were done, not at -t."""

import json
from collections import Counter

import pytest

from poot.loadtests.cli import main
from poot.loadtests.report import load_records

pytest.importorskip("poot.server.cli", reason="the bundled server is not in this build")

pytestmark = pytest.mark.slow

RUN_TIME_S = 180  # locust's -t: the bound a master that never heard from its workers would hit


def test_master_and_two_workers_count_every_request_once(tmp_path):
    out = tmp_path / "scaled"
    code = main(["smoke", "--serve", "--workers", "2", "--requests", "24", "--out", str(out),
                 "--run-time", str(RUN_TIME_S), "--quiet"])
    summary = json.loads((out / "summary.json").read_text())
    records = load_records(str(out))
    ids = Counter(r["id"] for r in records)
    assert sorted(ids) == list(range(24)), f"request ids {sorted(ids)}"
    assert all(n == 1 for n in ids.values()), f"requests counted twice: {[i for i, n in ids.items() if n > 1]}"
    by_worker = Counter(r["worker"] for r in records)
    assert len(by_worker) == 2 and set(by_worker.values()) == {12}, f"requests per worker process: {by_worker}"
    # Worker i of 2 takes requests i, i+2, ...: a worker's ids are all even or all odd.
    for pid in by_worker:
        assert len({r["id"] % 2 for r in records if r["worker"] == pid}) == 1
    st = summary["stats"]
    assert st["requests"] == summary["planned_requests"] == 24 and st["errors"] == 0, st.get("error_kinds")
    assert summary["locust_workers"] == 2 and summary["locust_exit_code"] == 0
    assert summary["load_s"] < RUN_TIME_S / 2, \
        f"locust ran {summary['load_s']} s of its {RUN_TIME_S} s bound: the master did not stop with its workers"
    with open(out / "locust_stats.csv") as f:
        http_row = next(line for line in f if "/v1/completions" in line)
    assert int(http_row.split(",")[2]) == 24, f"locust's master merged {http_row.split(',')[2]} requests"
    assert code == 0
