"""`poot-conformance compare A.json B.json ...`: JSON reports side by side, clauses x servers.

As Gateway API publishes its implementations' conformance: one column per server, one row
per clause, the outcome in each cell and, for what did not pass, its reason in a footnote.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

MARKS = {"passed": "pass", "failed": "**fail**", "not_supported": "n/s", "crashed": "**crashed**",
         "not_run": "not run"}


def _short(text: str, limit: int = 160) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _minutes(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{int(seconds // 60)} min {int(seconds % 60)} s" if seconds >= 60 else f"{seconds:.0f} s"


def _stops(report: dict) -> str:
    """How often the server stopped serving in a run, and at which clauses."""
    if report.get("not_started"):
        return "never started"
    crashes = report.get("crashes") or []
    if not crashes:
        return "-"
    return f"{len(crashes)}x: " + ", ".join(f"`{c['clause']}`" for c in crashes)


def matrix(reports: list[dict], names: list[str], reasons: list[dict[str, str]] | None = None) -> str:
    """The Markdown matrix of several JSON reports. `reasons`, one mapping per report, gives a
    clause's reason where an expectations file holds one, in place of the run's own words."""
    reasons = reasons or [{} for _ in reports]
    order: list[str] = []
    titles: dict[str, str] = {}
    sources: dict[str, str] = {}  # where each requirement comes from; "design choice" for the design's own
    cells: list[dict[str, dict]] = []
    for report in reports:
        by_id = {}
        for c in report.get("clauses", []):
            by_id[c["id"]] = c
            titles.setdefault(c["id"], c.get("title", ""))
            sources.setdefault(c["id"], "design choice" if c.get("design_choice") else c.get("source", "-"))
            if c["id"] not in order:
                order.append(c["id"])
        cells.append(by_id)
    lines = ["| clause | title | source | " + " | ".join(names) + " |", "|---|---|---|" + "---|" * len(names)]
    notes: dict[tuple[str, str], list[str]] = {}  # (server, reason) -> its clauses: one note per reason
    for cid in order:
        row = []
        for name, by_id, reason in zip(names, cells, reasons, strict=True):
            c = by_id.get(cid)
            if c is None:
                row.append("-")
                continue
            mark = MARKS.get(c["outcome"], c["outcome"])
            why = reason.get(cid) or c.get("why")
            if c["outcome"] != "passed" and why:
                clauses = notes.setdefault((name, _short(why, 300)), [])
                clauses.append(cid)
                mark += f" [{list(notes).index((name, _short(why, 300))) + 1}]"
            row.append(mark)
        lines.append(f"| `{cid}` | {_short(titles[cid], 80)} | {sources[cid]} | " + " | ".join(row) + " |")
    totals = []
    for report in reports:
        s = report.get("summary", {})
        choices = len(report.get("failed_design_choices", []))
        total = f"{s.get('passed', 0)} passed, {s.get('failed', 0)} failed" + (
            f" ({choices} of them design choices)" if choices else "") + f", {s.get('not_supported', 0)} n/s"
        for key in ("crashed", "not_run"):  # older reports have neither
            if s.get(key):
                total += f", {s[key]} {key.replace('_', ' ')}"
        totals.append(total)
    lines.append("| | **total** | | " + " | ".join(totals) + " |")
    if any(r.get("crashes") or r.get("not_started") for r in reports):
        lines.append("| | server stopped serving | | " + " | ".join(_stops(r) for r in reports) + " |")
    if any("duration_s" in r for r in reports):
        lines.append("| | run took | | " + " | ".join(_minutes(r.get("duration_s")) for r in reports) + " |")
    out = "\n".join(lines)
    if notes:
        out += "\n\n" + "\n".join(
            f"{i}. `{clauses[0]}` on {name}: {why}" if len(clauses) == 1 else f"{i}. on {name}, {len(clauses)} clauses: {why}"
            for i, ((name, why), clauses) in enumerate(notes.items(), 1))
    return out + "\n"


# The servers a results page shows first, in this order; any other committed one follows by name.
SERVER_ORDER = ("poot-serve", "llamacpp", "vllm")
PAGE_COMMAND = "poot-conformance compare --page docs/results/conformance.md"


def committed_reports(folder: Path) -> list[tuple[str, Path]]:
    """(server, FOLDER/server/report.json) for every server with a report, in page order."""
    found = {p.parent.name: p for p in folder.glob("*/report.json")}
    order = [s for s in SERVER_ORDER if s in found] + sorted(set(found) - set(SERVER_ORDER))
    return [(s, found[s]) for s in order]


def expected_reasons(path: Path, report: dict) -> dict[str, str]:
    """Clause -> the expectations file's reason, where the run's outcome is the one it expects."""
    from .expectations import load

    if not path.exists():
        return {}
    outcomes = {c["id"]: c["outcome"] for c in report.get("clauses", [])}
    return {cid: e.reason for cid, e in load(path).items() if e.reason and outcomes.get(cid) == e.outcome.value}


def _fact(report: dict, name: str) -> str:
    value = (report.get("facts") or {}).get(name, {}).get("value")
    return "-" if value in (None, "") else str(value)


def _command(target: str) -> str:
    """The server's command with each path cut to its last part: the page names no machine's folders."""
    return _short(" ".join(word.rsplit("/", 1)[-1] if "/" in word and not word.startswith("http") else word
                           for word in str(target).split()), 200).replace("`", "'")


def page(folder: Path, expectations: Path) -> str:
    """docs/results/conformance.md: the committed reports side by side, each run named."""
    runs = committed_reports(folder)
    reports = [json.loads(p.read_text()) for _, p in runs]
    names = [s for s, _ in runs]
    lines = ["# Conformance results", "",
             f"Written by `{PAGE_COMMAND}` from the reports committed under `{folder.name}/<server>/report.json`; "
             "a test fails when this page differs from what the command writes, so rewrite it rather than edit it "
             "(`bash ci/results_pages.sh`). A departure's reason is the one its server's expectations file "
             "(`ci/expectations/<server>.yaml`) holds, where it holds one, else the run's own.", "",
             "| server | run (UTC) | server version | poot commit | took | clauses | command |",
             "|---|---|---|---|---|---:|---|"]
    for name, report in zip(names, reports, strict=True):
        started = report.get("started")
        when = time.strftime("%Y-%m-%d %H:%M", time.gmtime(started)) if started else "-"
        options = ("--strict" if report.get("strict") else "") + (
            f" profiles {','.join(report['profiles'])}" if report.get("profiles") else "")
        lines.append(f"| {name} | {when} | {_fact(report, 'server_version')} | {report.get('commit') or '-'} | "
                     f"{_minutes(report.get('duration_s'))} | {len(report.get('clauses', []))}"
                     f"{' (' + options.strip() + ')' if options.strip() else ''} | `{_command(report.get('target', ''))}` |")
    reasons = [expected_reasons(expectations / f"{name}.yaml", report) for name, report in zip(names, reports, strict=True)]
    body = matrix(reports, names, reasons) if reports else "No report is committed yet.\n"
    return "\n".join(lines) + "\n\n" + body


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="poot-conformance compare",
                                description="JSON reports of several servers side by side, as a Markdown matrix.")
    p.add_argument("reports", nargs="*", metavar="REPORT.json")
    p.add_argument("--page", metavar="PATH",
                   help="instead: write the results page from every FOLDER/<server>/report.json (--reports-dir)")
    p.add_argument("--reports-dir", default="conformance-report", metavar="FOLDER",
                   help="with --page: the committed reports, one folder per server (default conformance-report)")
    p.add_argument("--expectations-dir", default="ci/expectations", metavar="FOLDER",
                   help="with --page: <server>.yaml per server, whose reasons the page shows (default ci/expectations)")
    p.add_argument("--name", action="append", default=[],
                   help="column name per report, in order (default: the file's stem)")
    p.add_argument("--markdown", "-o", metavar="PATH", default="conformance-compare.md",
                   help="where to write the matrix (default conformance-compare.md)")
    args = p.parse_args(argv)
    if args.page:
        try:
            text = page(Path(args.reports_dir), Path(args.expectations_dir))
        except (OSError, ValueError) as e:
            print(f"poot-conformance compare: {e}", file=sys.stderr)
            return 4
        Path(args.page).parent.mkdir(parents=True, exist_ok=True)
        Path(args.page).write_text(text)
        print(f"wrote {args.page} from {len(committed_reports(Path(args.reports_dir)))} report(s)")
        return 0
    if not args.reports:
        p.error("give REPORT.json files, or --page PATH")
    reports = []
    for path in args.reports:
        try:
            reports.append(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as e:
            print(f"poot-conformance compare: {path}: {e}", file=sys.stderr)
            return 4
    names = args.name + [Path(p).stem for p in args.reports[len(args.name):]]
    text = matrix(reports, names[: len(reports)])
    print(text, end="")
    Path(args.markdown).write_text(text)
    return 0
