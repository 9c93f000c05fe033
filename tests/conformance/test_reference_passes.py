"""The main job: `poot-conformance` with no arguments passes every clause against the
bundled reference server, reports success, and writes its reports."""

import json
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

pytestmark = pytest.mark.slow


def test_the_bundled_reference_server_passes_every_clause(tmp_path):
    report, junit, md = tmp_path / "report.json", tmp_path / "junit.xml", tmp_path / "matrix.md"
    run = subprocess.run(
        [sys.executable, "-m", "poot.conformance.cli", "--json", str(report), "--junit", str(junit),
         "--markdown", str(md)],
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    data = json.loads(report.read_text())
    outcomes = {c["id"]: c["outcome"] for c in data["clauses"]}
    assert outcomes and set(outcomes.values()) == {"passed"}, {k: v for k, v in outcomes.items() if v != "passed"}
    assert data["summary"]["result"] == "success"
    assert len(list(ET.parse(junit).getroot().iter("testcase"))) == len(outcomes)
    assert "passed" in md.read_text()
