"""Proof the suite can fail: each deliberately broken reference server fails its clause.

For every mutation in poot.conformance.mutations, start the bundled server with the hidden
`--mutation NAME` and run the suite on the mutation's scope: the clause it breaks must fail,
the clauses in `also` may fail, every other clause must pass (or be not supported, as against
the healthy server). A mutation the server does not implement yet is skipped with a reason.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest

from poot.conformance.mutations import MUTATIONS, Mutation
from poot.conformance.target import BUNDLED_MODEL, BUNDLED_RECURRENT_MODEL, poot_serve

pytestmark = pytest.mark.slow


def implemented() -> set[str]:
    try:
        from poot.server.mutations import ALL
    except ImportError:
        return set()
    return set(ALL)


def command(model: str, mutation: str, *extra: str) -> str:
    return (f"{shlex.quote(poot_serve())} --model {model} --port {{port}} --fault-injection "
            f"--mutation {mutation}" + "".join(f" {shlex.quote(a)}" for a in extra))


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_mutation_fails_its_clause_and_only_that(mutation: Mutation, tmp_path):
    if mutation.name not in implemented():
        pytest.skip(f"the reference server does not implement --mutation {mutation.name} yet")
    out = tmp_path / "report.json"
    args = [sys.executable, "-m", "poot.conformance.cli", "--strict", "--json", str(out), "--examples", "10",
            "--server-cmd", command(BUNDLED_MODEL, mutation.name), *mutation.prefixes]
    if mutation.recurrent:
        args += ["--recurrent-server-cmd", command(BUNDLED_RECURRENT_MODEL, mutation.name)]
    if mutation.speculative:
        args += ["--speculative-server-cmd", command(BUNDLED_MODEL, mutation.name, "--draft", "ngram")]
    r = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert out.exists(), f"no report (exit {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-2000:]}"
    clauses = {c["id"]: c for c in json.loads(out.read_text())["clauses"]}
    target = clauses[mutation.breaks]
    assert target["outcome"] == "failed", \
        f"{mutation.name} should break {mutation.breaks}, which came out {target['outcome']}: {target['why']}"
    others = {cid: c for cid, c in clauses.items() if cid != mutation.breaks and cid not in mutation.also}
    bad = {cid: f"{c['outcome']}: {c['why'][:200]}" for cid, c in others.items()
           if c["outcome"] == "failed"}
    assert not bad, f"{mutation.name} also failed clauses outside its list: {bad}"
    assert r.returncode == 1, f"exit status {r.returncode} with a failed clause"
