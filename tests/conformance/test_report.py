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
    assert data["summary"] == {"result": "failure", "clauses": 3, "passed": 1, "failed": 1, "not_supported": 1,
                               "crashed": 0, "not_run": 0, "server_crashes": 0, "server_started": True}
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


CRASH = {"clause": "api/errors/2", "seen": "/health answered 503 {\"status\": \"dead\"}",
         "request": 'POST /v1/completions {"model": "m", "max_tokens": 4}', "answer": "500 {\"error\": {}}",
         "last_requests": [], "then": "the clauses after it were not run", "log": "Traceback ...\nRuntimeError: boom"}


def crashed_run() -> RunReport:
    spec = load_spec()
    return RunReport([ClauseResult(spec["api/health/1"], Outcome.PASSED),
                      ClauseResult(spec["api/errors/2"], Outcome.CRASHED, "the server stopped serving during this clause"),
                      ClauseResult(spec["api/errors/3"], Outcome.NOT_RUN, "not run: the server stopped serving at api/errors/2")],
                     target="http://x", crashes=[CRASH])


def test_a_crash_is_said_first_and_counted_apart():
    report = crashed_run()
    assert report.result == "failure"
    text = to_terminal(report)
    top = text.split("\n\n", 1)[0]
    assert top.startswith("The server stopped serving once:")
    assert 'at api/errors/2, after POST /v1/completions {"model": "m", "max_tokens": 4} -> 500' in top
    assert "RuntimeError: boom" in top
    assert "[CRASH] api/errors/2" in text and "[ n/r] api/errors/3" in text
    assert "api/errors/2  Invalid or missing parameters get 400  (the server crashed)" in text.split("Failures:")[1]
    assert "api/errors/3" not in text.split("Failures:")[1]
    assert text.rstrip().endswith("3 clauses, 1 passed, 0 not supported, 0 failed, 1 crashed, 1 not run: failure")
    data = json.loads(to_json(report))
    assert data["summary"]["crashed"] == 1 and data["summary"]["not_run"] == 1 and data["summary"]["server_crashes"] == 1
    assert data["crashes"] == [CRASH] and data["not_started"] is None
    assert {c["id"]: c["outcome"] for c in data["clauses"]}["api/errors/3"] == "not_run"


def test_junit_reports_a_crash_as_an_error_and_not_run_as_a_skip():
    root = ET.fromstring(to_junit(crashed_run()))
    assert root.get("errors") == "1" and root.get("failures") == "0" and root.get("skipped") == "1"
    cases = {c.get("name").split()[0]: c for c in root.iter("testcase")}
    assert cases["api/errors/2"].find("error") is not None
    assert cases["api/errors/3"].find("skipped").get("message").startswith("not run: the server stopped serving")


def test_markdown_has_crashed_and_not_run_columns_only_when_a_run_has_them():
    md = to_markdown(crashed_run())
    assert "| area | passed | not supported | failed | crashed | not run |" in md
    assert "| api | 1 | 0 | 0 | 1 | 1 |" in md
    assert "The server stopped serving once:" in md.split("| area |")[0]
    assert "| crashed |" not in to_markdown(sample())


def test_a_server_that_never_started_is_reported_once_with_its_log():
    spec = load_spec()
    results = [ClauseResult(c, Outcome.NOT_RUN, "not run: the server did not start") for c in spec][:5]
    report = RunReport(results, not_started="the server was not ready for 3 s\nlast log line")
    text = to_terminal(report)
    assert text.startswith("The server did not start, so no clause was run:")
    assert text.count("last log line") == 1
    assert report.result == "failure" and json.loads(to_json(report))["summary"]["server_started"] is False


def test_expectations_and_compare_know_the_new_outcomes(tmp_path):
    from poot.conformance import compare, expectations

    path = tmp_path / "expected.yaml"
    path.write_text(expectations.dump(crashed_run()))
    expected = expectations.load(path)
    assert expected["api/errors/2"].outcome is Outcome.CRASHED and expected["api/errors/3"].outcome is Outcome.NOT_RUN
    assert expectations.judge(crashed_run(), expected).ok
    regression = expectations.judge(crashed_run(), {})
    assert [c.clause for c in regression.regressions] == ["api/errors/2"]  # expected to pass, crashed
    assert [c.clause for c in regression.other] == ["api/errors/3"]
    table = compare.matrix([json.loads(to_json(crashed_run())), json.loads(to_json(sample()))], ["a", "b"])
    assert "| `api/errors/2` | Invalid or missing parameters get 400 | openai | **crashed** [1] | - |" in table
    assert "not run [2]" in table and "1 crashed, 1 not run" in table
    assert "| | server stopped serving | | 1x: `api/errors/2` | - |" in table


def test_compare_gives_one_note_per_reason_of_a_server():
    from poot.conformance import compare

    spec = load_spec()
    report = RunReport([ClauseResult(spec[c], Outcome.NOT_RUN, "not run: the server stopped serving at api/errors/2")
                        for c in ("api/errors/3", "api/errors/4", "api/errors/5")], crashes=[CRASH])
    table = compare.matrix([json.loads(to_json(report))], ["x"])
    assert table.count("not run [1]") == 3
    assert "1. on x, 3 clauses: not run: the server stopped serving at api/errors/2" in table
