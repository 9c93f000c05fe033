"""The results pages under docs/results/ are written by a command from committed reports, never
typed: each test here fails when a page and what its command writes part."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import httpx

from poot.conformance import compare
from poot.conformance.facts import server_version
from poot.conformance.report import suite_commit
from poot.loadtests import serving_report

ROOT = Path(__file__).resolve().parents[1]
REPORTS = ROOT / "conformance-report"
EXPECTATIONS = ROOT / "ci" / "expectations"
PAGE = ROOT / "docs" / "results" / "conformance.md"
# How the README's results line names each server whose report is committed.
README_NAMES = {"poot-serve": "poot-serve", "llamacpp": "llama-server", "vllm": "vLLM"}


def test_the_conformance_page_is_what_compare_writes():
    written = compare.page(REPORTS, EXPECTATIONS)
    assert PAGE.read_text() == written, (
        "docs/results/conformance.md differs from what the committed reports give: rewrite it with "
        "`bash ci/results_pages.sh` (poot-conformance compare --page docs/results/conformance.md)")


def test_the_serving_page_is_what_poot_load_writes():
    """docs/results/serving.md from serving-report/<run>/serving.json (`poot-load serving --page`)."""
    written = serving_report.page(ROOT / "serving-report")
    assert (ROOT / "docs" / "results" / "serving.md").read_text() == written, (
        "docs/results/serving.md differs from what the committed serving runs give: rewrite it with "
        "`bash ci/results_pages.sh` (poot-load serving --page docs/results/serving.md)")


def test_the_readme_states_each_committed_reports_counts():
    text = (ROOT / "README.md").read_text()
    for server, path in compare.committed_reports(REPORTS):
        s = json.loads(path.read_text())["summary"]
        said = f"{README_NAMES.get(server, server)} {s['passed']} passed, {s['failed']} failed, {s['not_supported']} n/s"
        assert said in text, f"README.md's conformance line should say '{said}', as {path.relative_to(ROOT)} does"


def copy_reports(tmp: Path, servers: list[str]) -> Path:
    folder = tmp / "conformance-report"
    source = REPORTS / "llamacpp" / "report.json"  # a run with failures and not-supported clauses
    for server in servers:
        (folder / server).mkdir(parents=True)
        shutil.copy(source, folder / server / "report.json")
    return folder


def test_a_changed_report_changes_the_page(tmp_path):
    folder = copy_reports(tmp_path, ["llamacpp"])
    before = compare.page(folder, EXPECTATIONS)
    path = folder / "llamacpp" / "report.json"
    report = json.loads(path.read_text())
    report["clauses"][0]["outcome"], report["clauses"][0]["why"] = "failed", "answered 500"
    report["summary"]["passed"] -= 1
    report["summary"]["failed"] += 1
    path.write_text(json.dumps(report))
    after = compare.page(folder, EXPECTATIONS)
    assert after != before
    assert f"`{report['clauses'][0]['id']}` on llamacpp: answered 500" in after


def test_servers_come_in_a_fixed_order_whatever_is_committed(tmp_path):
    folder = copy_reports(tmp_path, ["zeta", "vllm", "llamacpp", "poot-serve"])
    text = compare.page(folder, EXPECTATIONS)
    rows = re.findall(r"^\| ([\w-]+) \| \d{4}-", text, re.M)
    assert rows == ["poot-serve", "llamacpp", "vllm", "zeta"]
    assert "| clause | title | source | poot-serve | llamacpp | vllm | zeta |" in text


def test_reasons_come_from_the_expectations_where_the_outcome_is_the_expected_one(tmp_path):
    folder = copy_reports(tmp_path, ["llamacpp"])
    report = json.loads((folder / "llamacpp" / "report.json").read_text())
    failed = next(c for c in report["clauses"] if c["outcome"] == "failed")
    (tmp_path / "exp").mkdir()
    (tmp_path / "exp" / "llamacpp.yaml").write_text(
        f"clauses:\n  {failed['id']}:\n    expected: failed\n    reason: the reason kept by hand\n")
    text = compare.page(folder, tmp_path / "exp")
    assert f"`{failed['id']}` on llamacpp: the reason kept by hand" in text
    (tmp_path / "exp" / "llamacpp.yaml").write_text(
        f"clauses:\n  {failed['id']}:\n    expected: not_supported\n    reason: the reason kept by hand\n")
    assert "the reason kept by hand" not in compare.page(folder, tmp_path / "exp")  # expected otherwise: the run's words


def test_each_run_is_named_by_date_version_commit_and_duration(tmp_path):
    folder = copy_reports(tmp_path, ["vllm"])
    path = folder / "vllm" / "report.json"
    report = json.loads(path.read_text())
    report.update(started=1796372199.5, duration_s=1257.0, commit="0123456789ab",
                  facts={**report["facts"], "server_version": {"value": "0.32.0", "source": "/version"}})
    path.write_text(json.dumps(report))
    clauses = len(report["clauses"])
    assert f"| vllm | 2026-12-04 08:16 | 0.32.0 | 0123456789ab | 20 min 57 s | {clauses} |" in compare.page(folder, EXPECTATIONS)
    del report["commit"], report["facts"]["server_version"]
    path.write_text(json.dumps(report))
    assert f"| vllm | 2026-12-04 08:16 | - | - | 20 min 57 s | {clauses} |" in compare.page(folder, EXPECTATIONS)


def test_reports_carry_the_suites_commit_and_the_servers_version():
    assert re.fullmatch(r"[0-9a-f]{12}(\+changes)?", suite_commit() or ""), suite_commit()

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/version":
            return httpx.Response(200, json={"version": "0.32.0"})
        return httpx.Response(404)

    http = httpx.Client(transport=httpx.MockTransport(answer), base_url="http://server")
    assert server_version(http, "vllm", None) == ("0.32.0", "/version")
    assert server_version(http, "llamacpp", {"build_info": "b6000-0c1e570"}) == ("b6000-0c1e570", "/props build_info")
    assert server_version(http, "poot", None, {"status": "ok", "version": "0.1.0", "plan": {}}) == ("0.1.0", "/health version")
    assert server_version(http, "openai", None) is None


def test_the_page_command_rewrites_the_page(tmp_path):
    folder = copy_reports(tmp_path, ["llamacpp"])
    out = tmp_path / "docs" / "results" / "conformance.md"
    code = compare.main(["--page", str(out), "--reports-dir", str(folder), "--expectations-dir", str(EXPECTATIONS)])
    assert code == 0
    assert out.read_text() == compare.page(folder, EXPECTATIONS)
