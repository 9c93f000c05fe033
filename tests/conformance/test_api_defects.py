"""Proof the api/logprobs, api/echo, api/n and api/penalties clauses can fail: the reference
server wrapped in each defect of api_defects.py fails the defect's clause (and only the
clauses it may also break), with api/completions/1 as a control that still passes; and a
server that refuses logprobs and echo with a 400 is not supported for them, never failed."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from api_defects import DEFECTS, Defect

HERE = Path(__file__).resolve().parent
README = HERE.parents[1] / "conformance" / "README.md"

CLAUSES = ("api/logprobs", "api/echo", "api/n", "api/penalties", "api/completions/1")


def run_suite(defect: str, tmp_path: Path) -> dict[str, dict]:
    out = tmp_path / "report.json"
    cmd = f"{shlex.quote(sys.executable)} {shlex.quote(str(HERE / 'serve_with_defect.py'))} {defect} {{port}}"
    args = [sys.executable, "-m", "poot.conformance.cli", "--strict", "--json", str(out), "--server-cmd", cmd, *CLAUSES]
    r = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert out.exists(), f"no report (exit {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-2000:]}"
    return {c["id"]: c for c in json.loads(out.read_text())["clauses"]}


def test_readme_defect_table_matches_the_list():
    table = README.read_text().split("### The sampling clauses' defects", 1)[1]
    rows = re.findall(r"^\| ([a-z0-9_]+) \| ([a-z0-9/-]+) \|", table, re.M)
    assert rows[1:] == [(d.name, d.breaks) for d in DEFECTS]  # after the header row


@pytest.mark.slow
@pytest.mark.parametrize("defect", DEFECTS, ids=[d.name for d in DEFECTS])
def test_defect_fails_its_clause_and_only_that(defect: Defect, tmp_path):
    clauses = run_suite(defect.name, tmp_path)
    target = clauses[defect.breaks]
    assert target["outcome"] == "failed", f"{defect.name} should break {defect.breaks}: {target['outcome']} {target['why']}"
    assert clauses["api/completions/1"]["outcome"] == "passed"
    bad = {cid: c["why"][:200] for cid, c in clauses.items()
           if c["outcome"] == "failed" and cid != defect.breaks and cid not in defect.also}
    assert not bad, f"{defect.name} also failed clauses outside its list: {bad}"


@pytest.mark.slow
def test_the_unwrapped_server_passes_every_clause(tmp_path):
    clauses = run_suite("none", tmp_path)
    assert {cid: c["outcome"] for cid, c in clauses.items() if c["outcome"] != "passed"} == {}


@pytest.mark.slow
def test_a_server_refusing_logprobs_is_not_supported_for_them(tmp_path):
    clauses = run_suite("refuses_logprobs", tmp_path)
    refused = [cid for cid in clauses if cid.startswith(("api/logprobs", "api/echo"))]
    assert refused and all(clauses[cid]["outcome"] == "not_supported" for cid in refused), \
        {cid: clauses[cid]["outcome"] for cid in refused}
    assert all(c["outcome"] == "passed" for cid, c in clauses.items() if cid not in refused)
