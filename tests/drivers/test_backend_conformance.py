"""The conformance suite against the reference server on each GPU backend (the NumPy one is
tests/conformance/test_reference_passes.py): every clause passes whichever driver steps,
the recurrent family's on a Mamba model served by the same backend.

`wgpu` and `vulkan` are one driver; they differ only in the adapter each takes. Where `wgpu`
takes the very adapter `vulkan` does (a machine whose one adapter is lavapipe: every CI run),
the whole suite on it would run the same code on the same device a second time, about 85 s
of CI, so `wgpu` there runs what the backend's name changes: the start, the plan it
publishes, serving, and the compile count. Anywhere else (a hardware GPU, a Metal or DX12
adapter) it runs every clause too."""

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from tests.backends import missing, selected

pytestmark = pytest.mark.slow


# vulkan first: the wgpu run leans on it where the two take the same adapter.
ORDER = ("vulkan", "wgpu", "ptx", "rocm")
ON_THE_SAME_ADAPTER = ("api", "compile", "loop/commit", "cancel/stream")


def same_adapter_as_vulkan(backend: str) -> bool:
    if backend != "wgpu" or "vulkan" not in selected() or missing("vulkan"):
        return False
    from poot.engine.drivers.wgpu_driver import pick_adapter

    return pick_adapter("wgpu").info == pick_adapter("vulkan").info


@pytest.mark.parametrize("backend", sorted((b for b in selected() if b != "numpy"), key=ORDER.index))
def test_every_clause_passes_on_the_backend(backend, tmp_path):
    reason = missing(backend)
    if reason:
        pytest.skip(reason)
    scope = list(ON_THE_SAME_ADAPTER) if same_adapter_as_vulkan(backend) else []
    serve = f"{Path(sys.executable).with_name('poot-serve')} --backend {backend} --port {{port}} --fault-injection"
    report = tmp_path / "report.json"
    # Keyed, as the bundled run is, so api/auth/1 is judged here too.
    key = secrets.token_urlsafe(16)
    env = {**os.environ, "POOT_API_KEY": key, "OPENAI_API_KEY": key}
    run = subprocess.run(
        [sys.executable, "-m", "poot.conformance.cli", "--json", str(report),
         "--server-cmd", f"{serve} --model synthetic",
         "--speculative-server-cmd", f"{serve} --model synthetic --draft ngram",
         "--recurrent-server-cmd", f"{serve} --model synthetic-mamba", *scope],
        capture_output=True, text=True, timeout=1200, env=env)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    data = json.loads(report.read_text())
    outcomes = {c["id"]: c["outcome"] for c in data["clauses"]}
    assert outcomes and all(v == "passed" for v in outcomes.values()), \
        {k: v for k, v in outcomes.items() if v != "passed"}
    assert data["facts"]["kind"]["value"] == "poot"
    if scope:
        assert len(outcomes) >= 15 and any(k.startswith("compile/") for k in outcomes), outcomes
