"""The conformance suite against the reference server on each GPU backend (the NumPy one is
tests/conformance/test_reference_passes.py): every clause passes whichever driver steps,
the recurrent family's on a Mamba model served by the same backend."""

import json
import os
import secrets
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
    serve = f"{Path(sys.executable).with_name('poot-serve')} --backend {backend} --port {{port}} --fault-injection"
    report = tmp_path / "report.json"
    # Keyed, as the bundled run is, so api/auth/1 is judged here too.
    key = secrets.token_urlsafe(16)
    env = {**os.environ, "POOT_API_KEY": key, "OPENAI_API_KEY": key}
    run = subprocess.run(
        [sys.executable, "-m", "poot.conformance.cli", "--json", str(report),
         "--server-cmd", f"{serve} --model synthetic",
         "--speculative-server-cmd", f"{serve} --model synthetic --draft ngram",
         "--recurrent-server-cmd", f"{serve} --model synthetic-mamba"],
        capture_output=True, text=True, timeout=1200, env=env)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    data = json.loads(report.read_text())
    outcomes = {c["id"]: c["outcome"] for c in data["clauses"]}
    assert outcomes and all(v == "passed" for v in outcomes.values()), \
        {k: v for k, v in outcomes.items() if v != "passed"}
