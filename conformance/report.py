"""Reports of a run, per clause: terminal listing (h2spec style), JSON, JUnit XML, Markdown."""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import asdict, dataclass, field
from itertools import groupby
from pathlib import Path
from xml.etree import ElementTree as ET

from .clauses import SOURCES, Clause
from .outcomes import Outcome, summary_result

MARKS = {Outcome.PASSED: "ok", Outcome.FAILED: "FAIL", Outcome.NOT_SUPPORTED: "n/s", Outcome.NOT_RUN: "n/r",
         Outcome.CRASHED: "CRASH"}
FAILING = (Outcome.FAILED, Outcome.CRASHED)  # listed again at the end of the listing


@dataclass(slots=True)
class ClauseResult:
    clause: Clause
    outcome: Outcome
    why: str = ""  # for anything not passed: what was expected and what came back
    tests: list[str] = field(default_factory=list)
    duration: float = 0.0


@dataclass(slots=True)
class RunReport:
    results: list[ClauseResult]
    target: str = ""
    profiles: list[str] = field(default_factory=list)
    strict: bool = False
    started: float = field(default_factory=time.time)
    duration: float = 0.0
    facts: dict[str, dict] = field(default_factory=dict)  # name -> {"value", "source"}: facts tests used
    expectations: object | None = None  # expectations.Verdict when the run was held to a file
    crashes: list[dict] = field(default_factory=list)  # life.Crash.as_dict() of each time the server stopped serving
    not_started: str = ""  # why the server under test never got ready, its log's last lines included

    def count(self, outcome: Outcome) -> int:
        return sum(r.outcome is outcome for r in self.results)

    def life_lines(self) -> list[str]:
        """What the report says first: a server that never started, or each time it stopped serving."""
        if self.not_started:
            return ["The server did not start, so no clause was run:",
                    *(f"  {line}" for line in self.not_started.splitlines()), ""]
        if not self.crashes:
            return []
        times = "once" if len(self.crashes) == 1 else f"{len(self.crashes)} times"
        lines = [f"The server stopped serving {times}:"]
        for c in self.crashes:
            on = f"{c['request']} -> {c['answer']}" if c["request"] else "no request of its own"
            lines += [f"  at {c['clause']}, after {_one_line(on, 600)}", f"    seen:  {c['seen']}"]
            if c["then"]:
                lines.append(f"    then:  {_one_line(c['then'], 600)}")
            if c.get("log"):
                lines += ["    its log ended:", *(f"      {line}" for line in c["log"].splitlines())]
        return [*lines, ""]

    @property
    def result(self) -> str:
        return summary_result([r.outcome for r in self.results])

    def summary(self) -> dict:
        return {"result": self.result, "clauses": len(self.results),
                "passed": self.count(Outcome.PASSED), "failed": self.count(Outcome.FAILED),
                "not_supported": self.count(Outcome.NOT_SUPPORTED), "crashed": self.count(Outcome.CRASHED),
                "not_run": self.count(Outcome.NOT_RUN), "server_crashes": len(self.crashes),
                "server_started": not self.not_started}

    def failures_by_kind(self) -> tuple[list[ClauseResult], list[ClauseResult]]:
        """Failed clauses split in two: those checking one of the reference design's own choices
        (another server may differ there by design), and every other failure (a requirement of
        OpenAI's API, the SSE format, serving practice, an extension, or the design's own that is
        no mere choice)."""
        failed = [r for r in self.results if r.outcome is Outcome.FAILED]
        return [r for r in failed if r.clause.design_choice], [r for r in failed if not r.clause.design_choice]

    def by_source(self) -> dict[str, dict[str, int]]:
        """Outcome counts per source of the requirement (see clauses.SOURCES)."""
        out: dict[str, dict[str, int]] = {}
        for r in self.results:
            counts = out.setdefault(r.clause.source, {})
            counts[r.outcome.value] = counts.get(r.outcome.value, 0) + 1
        return {source: out[source] for source in SOURCES if source in out}

    def departures_line(self) -> str:
        """One line telling departures from the reference design's choices from the other failures."""
        choices, others = self.failures_by_kind()
        if not choices and not others:
            return "No clause failed."
        line = (f"Of {len(choices) + len(others)} failed clauses, {len(choices)} check the reference design's own "
                "choices (a server may differ there by design)")
        if choices:
            line += f": {', '.join(r.clause.id for r in choices)}"
        sources = {}
        for r in others:
            sources[r.clause.source] = sources.get(r.clause.source, 0) + 1
        line += f"; {len(others)} fail other requirements"
        if sources:
            line += " (" + ", ".join(f"{SOURCES[k].split(' (')[0]}: {n}" for k, n in sources.items()) + ")"
        return line + "."

    def summary_line(self) -> str:
        s = self.summary()
        line = f"{s['clauses']} clauses, {s['passed']} passed, {s['not_supported']} not supported, {s['failed']} failed"
        for key in ("crashed", "not_run"):
            if s[key]:
                line += f", {s[key]} {key.replace('_', ' ')}"
        return f"{line}: {s['result']}"


def _one_line(text: str, limit: int = 400) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def to_terminal(report: RunReport) -> str:
    """The spec's tree with an outcome per clause; failures listed again at the end. A server
    that never started, or stopped serving, is said once, first."""
    lines = report.life_lines()
    by_area = groupby(report.results, key=lambda r: r.clause.area)
    for area, results in by_area:
        results = list(results)
        lines.append(f"{area}: {results[0].clause.area_title}")
        for group, members in groupby(results, key=lambda r: r.clause.group):
            lines.append(f"  {group.split('/', 1)[1] if '/' in group else group}")
            for r in members:
                choice = "  (design choice)" if r.clause.design_choice else ""
                lines.append(f"    [{MARKS[r.outcome]:>4}] {r.clause.id}  {r.clause.title}{choice}")
                if r.outcome is not Outcome.PASSED and r.why:
                    lines.append(f"           {_one_line(r.why, 200)}")
    failed = [r for r in report.results if r.outcome in FAILING]
    if failed:
        lines += ["", "Failures:", ""]
        for r in failed:
            lines.append(f"  {r.clause.id}  {r.clause.title}" + ("  (the server crashed)" if r.outcome is Outcome.CRASHED else ""))
            lines.append(f"    requirement: {r.clause.requirement}")
            lines.append(f"    source:      {SOURCES[r.clause.source]}")
            if r.clause.design_choice:
                lines.append(f"    design choice: {r.clause.design_choice}")
            lines.append(f"    observed:    {_one_line(r.why, 1200)}")
            lines.append(f"    tests:       {', '.join(r.tests)}")
            lines.append("")
    if report.facts:
        lines += ["", "Facts used:"]
        lines += [f"  {name} = {f['value']}  ({f['source']})" if f["value"] is not None
                  else f"  {name}: not had ({f['source']})" for name, f in report.facts.items()]
    if report.expectations is not None:
        lines += ["", report.expectations.describe()]
    lines += ["", report.departures_line(), report.summary_line()]
    return "\n".join(lines)


def suite_commit() -> str | None:
    """The git commit of the suite's own checkout (with "+changes" where its files differ from
    it), so a committed report says which code judged the server; None outside a checkout."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=here, capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return None
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "."],
                                 cwd=here.parent, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+changes" if changed.stdout.strip() else "")


def to_json(report: RunReport) -> str:
    return json.dumps({
        "tool": "poot-conformance",
        "commit": suite_commit(),
        "target": report.target,
        "profiles": report.profiles,
        "strict": report.strict,
        "started": report.started,
        "duration_s": round(report.duration, 3),
        "summary": report.summary(),
        "failed_design_choices": [r.clause.id for r in report.failures_by_kind()[0]],
        "failed_other": [r.clause.id for r in report.failures_by_kind()[1]],
        "by_source": report.by_source(),
        "sources": SOURCES,
        "not_started": report.not_started or None,
        "crashes": report.crashes,
        "facts": report.facts,
        "clauses": [{**{k: v for k, v in asdict(r.clause).items() if k != "area_title"},
                     "needs": list(r.clause.needs), "outcome": r.outcome.value, "why": r.why,
                     "tests": r.tests, "duration_s": round(r.duration, 3)} for r in report.results],
    }, indent=2)


def to_junit(report: RunReport) -> str:
    """One testsuite per area, one testcase per clause (as h2spec's JUnit report). A crash is a
    JUnit error (the case did not end by its own check), a clause not run a skip that says so."""
    def counts(results: list[ClauseResult]) -> dict[str, str]:
        return {"failures": str(sum(r.outcome is Outcome.FAILED for r in results)),
                "errors": str(sum(r.outcome is Outcome.CRASHED for r in results)),
                "skipped": str(sum(r.outcome in (Outcome.NOT_SUPPORTED, Outcome.NOT_RUN) for r in results))}

    root = ET.Element("testsuites", name="poot-conformance", tests=str(len(report.results)),
                      **counts(report.results), time=f"{report.duration:.3f}")
    for area, results in groupby(report.results, key=lambda r: r.clause.area):
        results = list(results)
        suite = ET.SubElement(root, "testsuite", name=area, tests=str(len(results)), **counts(results),
                              time=f"{sum(r.duration for r in results):.3f}")
        for r in results:
            case = ET.SubElement(suite, "testcase", classname=area, name=f"{r.clause.id} {r.clause.title}",
                                 time=f"{r.duration:.3f}")
            if r.outcome in FAILING:
                kind = "failure" if r.outcome is Outcome.FAILED else "error"
                failure = ET.SubElement(case, kind, message=_one_line(r.why, 300))
                failure.text = f"{r.clause.requirement}\n\n{r.why}"
            elif r.outcome is Outcome.NOT_SUPPORTED:
                ET.SubElement(case, "skipped", message=f"not supported: {_one_line(r.why, 300)}")
            elif r.outcome is Outcome.NOT_RUN:
                ET.SubElement(case, "skipped", message=_one_line(r.why, 300))
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True)


def _md(text: str) -> str:
    return _one_line(text, 300).replace("|", "\\|")


def to_markdown(report: RunReport) -> str:
    """A matrix for a pull request or a README: areas by outcome, then every clause. The crashed
    and not-run columns appear in a run that has them."""
    outcomes = [Outcome.PASSED, Outcome.NOT_SUPPORTED, Outcome.FAILED]
    outcomes += [o for o in (Outcome.CRASHED, Outcome.NOT_RUN) if report.count(o)]
    lines = [f"# Conformance: {report.result}", "",
             f"Target: `{report.target}`; profiles: {', '.join(report.profiles) or 'all'}; "
             f"strict: {'yes' if report.strict else 'no'}.", ""]
    if life := report.life_lines():
        lines += ["```", *life[:-1], "```", ""]
    lines += ["| area | " + " | ".join(o.label for o in outcomes) + " |", "|---|" + "---|" * len(outcomes)]
    for area, results in groupby(report.results, key=lambda r: r.clause.area):
        results = list(results)
        counts = [sum(r.outcome is o for r in results) for o in outcomes]
        lines.append(f"| {area} | " + " | ".join(map(str, counts)) + " |")
    lines += ["", report.departures_line(), "",
              "| clause | title | level | profile | source | outcome | why |", "|---|---|---|---|---|---|---|"]
    for r in report.results:
        source = "design choice" if r.clause.design_choice else r.clause.source
        lines.append(f"| `{r.clause.id}` | {_md(r.clause.title)} | {r.clause.level} | {r.clause.profile} | {source} "
                     f"| {r.outcome.label} | {_md(r.why)} |")
    if report.facts:
        lines += ["", "| fact | value | source |", "|---|---|---|"]
        lines += [f"| {name} | {'-' if f['value'] is None else f['value']} | {_md(f['source'])} |"
                  for name, f in report.facts.items()]
    lines += ["", report.summary_line(), ""]
    return "\n".join(lines)
