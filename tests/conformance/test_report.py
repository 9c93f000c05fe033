"""Reporters and the outcome rules: success, partial, failure."""

from __future__ import annotations

import json
from xml.etree import ElementTree as ET

from poot.conformance.clauses import load_spec
from poot.conformance.outcomes import NotSupported, Outcome, summary_result, worst
from poot.conformance.report import ClauseResult, RunReport, to_json, to_junit, to_markdown, to_terminal


def sample() -> RunReport:
    spec = load_spec()
    return RunReport([ClauseResult(spec["api/health/1"], Outcome.PASSED, tests=["t1"]),
                      ClauseResult(spec["api/sse/1"], Outcome.FAILED, "no [DONE] | at the end", ["t2"], 0.5),
                      ClauseResult(spec["cancel/stream/1"], Outcome.NOT_SUPPORTED, "GET /metrics answered 404")],
                     target="http://x", profiles=["core"])


def test_summary_is_success_only_when_everything_passed():
    assert summary_result([Outcome.PASSED, Outcome.PASSED]) == "success"
    assert summary_result([Outcome.PASSED, Outcome.NOT_SUPPORTED]) == "partial"
    assert summary_result([Outcome.NOT_SUPPORTED, Outcome.FAILED]) == "failure"
    assert worst([Outcome.PASSED, Outcome.NOT_SUPPORTED]) is Outcome.NOT_SUPPORTED
    assert worst([Outcome.FAILED, Outcome.NOT_SUPPORTED]) is Outcome.FAILED


def test_not_supported_is_a_skip_with_a_reason():
    import _pytest.outcomes

    e = NotSupported("no /metrics")
    assert isinstance(e, _pytest.outcomes.Skipped) and e.reason == "no /metrics"


def test_json_report_lists_each_clause_with_its_outcome():
    data = json.loads(to_json(sample()))
    assert data["summary"] == {"result": "failure", "clauses": 3, "passed": 1, "failed": 1, "not_supported": 1}
    by_id = {c["id"]: c for c in data["clauses"]}
    assert by_id["api/sse/1"]["outcome"] == "failed" and "[DONE]" in by_id["api/sse/1"]["why"]
    assert by_id["cancel/stream/1"]["outcome"] == "not_supported"


def test_junit_has_a_suite_per_area_and_marks_failures_and_skips():
    root = ET.fromstring(to_junit(sample()))
    suites = {s.get("name"): s for s in root.findall("testsuite")}
    assert set(suites) == {"api", "cancel"}
    assert suites["api"].get("failures") == "1"
    assert suites["cancel"].find("testcase/skipped").get("message").startswith("not supported")


def test_markdown_escapes_pipes_and_counts_per_area():
    md = to_markdown(sample())
    assert "| api | 1 | 0 | 1 |" in md
    assert "no [DONE] \\| at the end" in md


def test_terminal_listing_repeats_failures_and_ends_with_the_summary():
    text = to_terminal(sample())
    assert "[FAIL] api/sse/1" in text and "[ n/s] cancel/stream/1" in text
    assert text.index("Failures:") > text.index("cancel/stream/1")
    assert text.rstrip().endswith("3 clauses, 1 passed, 1 not supported, 1 failed: failure")


def test_failures_of_the_reference_designs_choices_are_counted_apart():
    spec = load_spec()
    report = RunReport([ClauseResult(spec["loop/reserve/1"], Outcome.FAILED, "kv_blocks_reserved fell to 1"),
                        ClauseResult(spec["startup/plan/1"], Outcome.FAILED, "--max-num-seqs 3: started"),
                        ClauseResult(spec["api/sse/1"], Outcome.FAILED, "no [DONE]"),
                        ClauseResult(spec["api/errors/2"], Outcome.FAILED, "-> 500"),
                        ClauseResult(spec["loop/admission/1"], Outcome.PASSED)], target="http://x")
    line = report.departures_line()
    assert line.startswith("Of 4 failed clauses, 2 check the reference design's own choices")
    assert "loop/reserve/1, startup/plan/1" in line and "2 fail other requirements" in line
    assert "OpenAI's API reference: 1" in line and "the server-sent events format: 1" in line
    data = json.loads(to_json(report))
    assert data["failed_design_choices"] == ["loop/reserve/1", "startup/plan/1"]
    assert data["failed_other"] == ["api/sse/1", "api/errors/2"]
    assert data["by_source"]["design"] == {"failed": 2, "passed": 1}
    by_id = {c["id"]: c for c in data["clauses"]}
    assert by_id["loop/reserve/1"]["source"] == "design" and "preempt" in by_id["loop/reserve/1"]["design_choice"]
    assert by_id["api/sse/1"]["source"] == "sse" and by_id["api/sse/1"]["design_choice"] == ""
    text = to_terminal(report)
    assert "[FAIL] loop/reserve/1  Opening reserves room for the whole max_tokens  (design choice)" in text
    assert "design choice: reserving the whole max_tokens" in text and line in text
    md = to_markdown(report)
    assert "| `loop/reserve/1` |" in md and "| design choice | failed |" in md and line in md
    assert "| sse | failed |" in md
