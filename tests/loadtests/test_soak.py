"""The soak: resident-memory figures on made-up samples, and a short soak against the bundled
server (`poot-load soak --serve`, synthetic model).

The short run checks what a minute can show: zero errors (clients that hang up on purpose are
not errors), the server idle and holding nothing at the end, and RSS figures present. The RSS
slope is reported, not asserted: its bound (1 MB/min after warm-up) is judged over at least
ten minutes, and a minute cannot tell a leak of that size from the allocator settling. The
hour-scale run is documented in loadtests/README.md.
"""

import json
import os
import subprocess
import sys

import pytest

from poot.loadtests import memory
from poot.loadtests.cli import main

pytest.importorskip("poot.server.cli", reason="the bundled server is not in this build")


def test_slope_is_least_squares_in_mb_per_minute():
    line = [(t, 100e6 + 0.5e6 * t / 60) for t in range(0, 600, 5)]
    assert memory.slope_per_minute(line) == pytest.approx(0.5)
    assert memory.slope_per_minute(line[:2]) is None
    assert memory.slope_per_minute([(1.0, 1.0)] * 5) is None


def test_summary_judges_only_a_long_enough_window():
    flat = [(1000.0 + t, 200e6 + (3e6 if t < 60 else 0)) for t in range(0, 1200, 5)]
    s = memory.summarize(flat, warmup_end=1060.0, limit_mb_per_min=1.0, min_window_s=600.0, source="proc")
    assert s["ok"] is True and s["slope_mb_per_min"] == pytest.approx(0.0, abs=1e-9)
    assert s["start_mb"] == pytest.approx(203.0) and s["end_mb"] == pytest.approx(200.0)
    leak = [(t, 200e6 + 2e6 * t / 60) for t in range(0, 1200, 5)]
    s = memory.summarize(leak, warmup_end=60.0, limit_mb_per_min=1.0, min_window_s=600.0)
    assert s["ok"] is False and s["slope_mb_per_min"] == pytest.approx(2.0)
    short = memory.summarize(leak[:20], warmup_end=20.0, min_window_s=600.0)
    assert short["ok"] is None and short["slope_mb_per_min"] == pytest.approx(2.0)
    assert "not judged" in short["text"]
    assert memory.summarize([], 0.0)["available"] is False


def test_rss_of_a_live_process_from_proc():
    if not os.path.exists("/proc/self/status"):
        pytest.skip("no /proc here")
    assert memory.proc_rss_bytes(os.getpid()) > 1e6
    assert memory.proc_rss_bytes(2**22 + 12345) is None


@pytest.mark.slow
def test_short_soak_against_bundled_server(tmp_path):
    out = tmp_path / "soak"
    code = main(["soak", "--serve", "--out", str(out), "--run-time", "50", "--soak-warmup", "15",
                 "--quiet"])
    summary = json.loads((out / "summary.json").read_text())
    st, checks = summary["stats"], summary["checks"]
    assert st["errors"] == 0, st["error_kinds"]
    assert st["ok"] >= 64 and st["disconnected"] >= 1  # more than one lap of the 64 users; some hung up
    assert checks["no errors"]["ok"] is True
    assert checks["server idle afterwards"]["ok"] is True, checks["server idle afterwards"]
    mem = summary["memory"]
    assert mem["available"] and mem["source"] == "proc" and mem["samples"] >= 10
    assert 0 < mem["start_mb"] and 0 < mem["warmup_mb"] and 0 < mem["end_mb"] <= mem["peak_mb"]
    assert mem["slope_mb_per_min"] is not None and mem["window_s"] > 0
    assert checks["RSS flat after warm-up"]["ok"] is None  # reported, not judged, in a short run
    assert code == 0
    for name in ("report.md", "rss.png", "timeline.png", "server_metrics.csv"):
        assert (out / name).stat().st_size > 0, name
    assert "## Server resident memory" in (out / "report.md").read_text()
    # The scrape carries the server's own RSS too (its process collector).
    assert "process_resident_memory_bytes" in (out / "server_metrics.csv").read_text().splitlines()[0]


def test_a_servers_memory_counts_the_processes_it_started():
    """vLLM runs its engine in a child process: the server's memory is the tree's. A child that
    holds 200 MB shows in its parent's tree and not in the parent alone."""
    if not os.path.exists("/proc/self/stat"):
        pytest.skip("no /proc here")
    script = ("import subprocess, sys, time\n"
              "child = subprocess.Popen([sys.executable, '-c', "
              "'import time; b = b\\'x\\' * 200_000_000; print(1, flush=True); time.sleep(60)'], "
              "stdout=subprocess.PIPE)\n"
              "child.stdout.readline(); print(child.pid, flush=True); time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert memory.descendants(parent.pid) == [child]
        alone, tree = memory.proc_rss_bytes(parent.pid), memory.tree_rss_bytes(parent.pid)
        # Sleeping processes: their RSS holds still between the reads, to within a few pages.
        assert tree - alone == pytest.approx(memory.proc_rss_bytes(child), abs=2e6) and tree - alone > 200e6
        sampler = memory.RssSampler(pid=parent.pid, interval=60)
        assert sampler.sample() > alone + 200e6 and sampler.source == "proc"
    finally:
        for pid in memory.descendants(parent.pid):
            os.kill(pid, 9)
        parent.kill()
        parent.wait()
    assert memory.tree_rss_bytes(parent.pid) is None
