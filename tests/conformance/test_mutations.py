"""Proof the suite can fail: each deliberately broken reference server fails its clause.

For every variant in tests/poot_mutants/registry.py, start it (`python -m poot_mutants.serve
--mutation NAME`) and run the suite on the variant's scope plus its control clause. The proof
holds when the clause it breaks fails with a reason containing the variant's expected
substring, the control clause passes (so a variant that cannot start, whose every clause
"fails", proves nothing and fails here), and no clause outside `also` fails.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from poot_mutants.registry import (
    CRASH_AT_START,
    MUTANTS,
    NO_RESPONSES_ENDPOINT,
    REFUSES_LOGPROBS,
    REFUSES_RESPONSE_FORMAT,
    REFUSES_TOOLS,
    REFUSES_UNKNOWN_FIELDS,
    ROWS_200_UNPUBLISHED,
    SAMPLING,
    Mutant,
)

from poot.conformance.target import BUNDLED_MODEL, BUNDLED_RECURRENT_MODEL

TESTS = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def command(model: str, names: list[str], *extra: str) -> str:
    args = [sys.executable, "-m", "poot_mutants.serve", *(a for n in names for a in ("--mutation", n)),
            "--model", model, "--port", "{port}", "--fault-injection", *extra]
    return " ".join(a if a == "{port}" else shlex.quote(a) for a in args)


def run_suite(mutant: Mutant, tmp_path: Path, names: list[str] | None = None) -> tuple[dict, int, str]:
    """Runs the suite against the variant; returns (clauses by id, exit status, output tail)."""
    names = names if names is not None else [mutant.name]
    out = tmp_path / "report.json"
    args = [sys.executable, "-m", "poot.conformance.cli", "--strict", "--json", str(out), "--examples", "10",
            "--server-cmd", command(BUNDLED_MODEL, names), *mutant.prefixes]
    if mutant.recurrent:
        args += ["--recurrent-server-cmd", command(BUNDLED_RECURRENT_MODEL, names)]
    if mutant.speculative:
        args += ["--speculative-server-cmd", command(BUNDLED_MODEL, names, "--draft", "ngram")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(TESTS), os.environ.get("PYTHONPATH"))))}
    env.pop("OPENAI_API_KEY", None)
    env.pop("POOT_API_KEY", None)
    if mutant.keyed:  # the server requires the key (from its environment) and the suite sends it
        env["OPENAI_API_KEY"] = env["POOT_API_KEY"] = secrets.token_urlsafe(24)
    r = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env)
    tail = f"{r.stdout[-3000:]}\n{r.stderr[-2000:]}"
    assert out.exists(), f"no report (exit {r.returncode}):\n{tail}"
    return {c["id"]: c for c in json.loads(out.read_text())["clauses"]}, r.returncode, tail


FAILING = ("failed", "crashed")  # a clause during which the server stopped serving fails too


def check(mutant: Mutant, clauses: dict, returncode: int) -> None:
    """The proof for one variant; raises AssertionError saying what is missing."""
    control = clauses.get(mutant.control)
    assert control is not None and control["outcome"] == "passed", \
        (f"{mutant.name}: the control clause {mutant.control} did not pass "
         f"({control and control['outcome']}: {control and control['why'][:300]}), so the variant proves nothing")
    target = clauses.get(mutant.breaks)
    assert target is not None, f"{mutant.name}: {mutant.breaks} did not run"
    assert target["outcome"] in FAILING, \
        f"{mutant.name} should break {mutant.breaks}, which came out {target['outcome']}: {target['why']}"
    assert mutant.reason in target["why"], \
        f"{mutant.name} broke {mutant.breaks}, but not with the expected reason {mutant.reason!r}: {target['why']}"
    bad = {cid: f"{c['outcome']}: {c['why'][:200]}" for cid, c in clauses.items()
           if cid != mutant.breaks and cid not in mutant.also and c["outcome"] in FAILING}
    assert not bad, f"{mutant.name} also failed clauses outside its list: {bad}"
    assert returncode == 1, f"exit status {returncode} with a failed clause"


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_mutation_fails_its_clause_and_only_that(mutant: Mutant, tmp_path):
    clauses, code, tail = run_suite(mutant, tmp_path)
    check(mutant, clauses, code)


def test_a_variant_that_crashes_at_start_fails_the_proof(tmp_path):
    """A server that never starts gets no clause run, its target included: the control clause
    is what turns that into a failed proof rather than a proved clause."""
    clauses, code, _ = run_suite(CRASH_AT_START, tmp_path)
    assert clauses[CRASH_AT_START.breaks]["outcome"] == "not_run"
    with pytest.raises(AssertionError, match="control clause"):
        check(CRASH_AT_START, clauses, code)


def test_a_server_that_refuses_logprobs_is_not_supported_for_them(tmp_path):
    """A 400 for a parameter the server does not offer is an honest refusal: the clauses that
    need it come out not supported, and every other sampling clause still passes."""
    clauses, code, tail = run_suite(REFUSES_LOGPROBS, tmp_path)
    refused = [cid for cid in clauses if cid.startswith(("api/logprobs", "api/echo"))]
    assert refused and {clauses[cid]["outcome"] for cid in refused} == {"not_supported"}, \
        {cid: clauses[cid]["outcome"] for cid in refused}
    others = {cid: c["outcome"] for cid, c in clauses.items() if cid not in refused}
    assert set(others.values()) == {"passed"} and any(cid.startswith(SAMPLING) for cid in others), others
    assert code == 0, tail


def test_a_server_that_refuses_response_format_is_not_supported_for_it(tmp_path):
    """A server without structured outputs that refuses response_format with a 400 naming it:
    every structured clause is not supported, never failed, and the refusal of an unknown field
    is judged as on any server."""
    clauses, code, tail = run_suite(REFUSES_RESPONSE_FORMAT, tmp_path)
    structured = {cid for cid in clauses if cid.startswith("structured/")}
    assert len(structured) >= 6 and all(clauses[cid]["outcome"] == "not_supported" and "response_format" in
                                        clauses[cid]["why"] for cid in structured), \
        {cid: f"{clauses[cid]['outcome']}: {clauses[cid]['why'][:200]}" for cid in structured}
    others = {cid: f"{c['outcome']}: {c['why'][:200]}" for cid, c in clauses.items() if cid not in structured}
    assert all(v.startswith("passed") for v in others.values()) and "api/fields/1" in others, others
    assert code == 0, tail


def test_a_server_that_refuses_tools_is_not_supported_for_them(tmp_path):
    """A server without function tools that refuses tools with a 400 naming the field: every
    tools clause is not supported, never failed, and the plain chat beside them still passes."""
    clauses, code, tail = run_suite(REFUSES_TOOLS, tmp_path)
    tools = {cid for cid in clauses if cid.startswith("tools/")}
    assert len(tools) >= 7 and all(clauses[cid]["outcome"] == "not_supported" and "tools" in clauses[cid]["why"]
                                   for cid in tools), \
        {cid: f"{clauses[cid]['outcome']}: {clauses[cid]['why'][:200]}" for cid in tools}
    others = {cid: f"{c['outcome']}: {c['why'][:200]}" for cid, c in clauses.items() if cid not in tools}
    assert all(v.startswith("passed") for v in others.values()) and REFUSES_TOOLS.control in others, others
    assert code == 0, tail


def test_a_server_without_the_responses_api_is_not_supported_for_it(tmp_path):
    """A server whose POST /v1/responses answers 404 has no Responses API: every responses
    clause is not supported, never failed, and the plain chat beside them still passes."""
    clauses, code, tail = run_suite(NO_RESPONSES_ENDPOINT, tmp_path)
    responses = {cid for cid in clauses if cid.startswith("responses/")}
    assert len(responses) >= 12 and all(clauses[cid]["outcome"] == "not_supported" and
                                        "/v1/responses answered 404" in clauses[cid]["why"] for cid in responses), \
        {cid: f"{clauses[cid]['outcome']}: {clauses[cid]['why'][:200]}" for cid in responses}
    others = {cid: f"{c['outcome']}: {c['why'][:200]}" for cid, c in clauses.items() if cid not in responses}
    assert all(v.startswith("passed") for v in others.values()) and NO_RESPONSES_ENDPOINT.control in others, others
    assert code == 0, tail


def test_a_server_that_refuses_unknown_fields_is_not_supported_for_extensions_only(tmp_path):
    """A server that refuses every field outside OpenAI's API with a 422 naming it: the
    clauses about an extension (response_format on /v1/completions among them) are not
    supported, and the clauses whose requests must run to their max_tokens (kept going with
    ignore_eos on the reference server) still pass, sent with OpenAI's own fields: no other
    clause depends on an extension. Structured outputs on chat, an OpenAI field, still pass."""
    clauses, code, tail = run_suite(REFUSES_UNKNOWN_FIELDS, tmp_path)
    extensions = {cid for cid, c in clauses.items() if c["source"] == "extension"}
    assert extensions == {"api/penalties/3", "api/ignore-eos/1", "structured/completions/1"}, extensions
    assert all(clauses[cid]["outcome"] == "not_supported" and "422" in clauses[cid]["why"] for cid in extensions), \
        {cid: clauses[cid]["why"] for cid in extensions}
    others = {cid: f"{c['outcome']}: {c['why'][:200]}" for cid, c in clauses.items() if cid not in extensions}
    assert all(v.startswith("passed") for v in others.values()), others
    assert {"drain/inflight/1", "api/fields/1", "structured/json-schema/1"} <= set(others), others
    facts = json.loads((tmp_path / "report.json").read_text())["facts"]
    assert facts["ignore_eos"]["value"] is False and facts["long_requests"]["value"].startswith("logit_bias"), facts
    assert code == 0, tail


def test_a_server_with_more_rows_than_first_opened_has_them_measured(tmp_path):
    """200 rows and no plan published: the rows are measured (more streams opened while every
    one runs), and the clauses that need them get their verdicts on the measured count."""
    clauses, code, tail = run_suite(ROWS_200_UNPUBLISHED, tmp_path)
    rows = json.loads((tmp_path / "report.json").read_text())["facts"]["rows"]
    assert rows["value"] == 200 and rows["source"].startswith("measured"), rows
    outcomes = {cid: f"{c['outcome']}: {c['why'][:200]}" for cid, c in clauses.items()}
    assert all(v.startswith("passed") for v in outcomes.values()) and "loop/admission/1" in outcomes, outcomes
    assert code == 0, tail


def test_a_variant_of_a_renamed_seam_stops_the_registry():
    """A variant overriding a hook the reference no longer has would run as the reference does."""
    from poot_mutants.registry import check_overrides, overrides_nothing_missing

    from poot.engine import Engine

    class Stale(Engine):
        def _check_fits(self, prompt, params, n=1):  # the seam's old name
            raise AssertionError("never called")

    class Added(Engine):
        adds = ("cancel_everything",)

        def cancel_everything(self):
            pass

    assert overrides_nothing_missing(Stale) == ["Stale._check_fits"]
    assert overrides_nothing_missing(Added) == []
    check_overrides()  # every registered variant overrides what the reference has
