"""The conformance suite against the reference server on each GPU backend (the NumPy one is
tests/conformance/test_reference_passes.py): every clause passes whichever driver steps."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.backends import missing, selected

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("backend", [b for b in selected() if b != "numpy"])
def test_every_clause_passes_on_the_backend(backend, tmp_path):
    reason = missing(backend)
    if reason:
        pytest.skip(reason)
    serve = Path(sys.executable).with_name("poot-serve")
    report = tmp_path / "report.json"
    run = subprocess.run(
        [sys.executable, "-m", "poot.conformance.cli", "--json", str(report), "--server-cmd",
         f"{serve} --backend {backend} --model synthetic --port {{port}} --fault-injection"],
        capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    data = json.loads(report.read_text())
    outcomes = {c["id"]: c["outcome"] for c in data["clauses"]}
    assert outcomes and set(outcomes.values()) == {"passed"}, {k: v for k, v in outcomes.items() if v != "passed"}
