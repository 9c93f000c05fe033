"""`poot-conformance compare A.json B.json ...`: JSON reports side by side, clauses x servers.

As Gateway API publishes its implementations' conformance: one column per server, one row
per clause, the outcome in each cell and, for what did not pass, its reason in a footnote.
"""

from __future__ import annotations

import argparse
import json
import sys
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


def matrix(reports: list[dict], names: list[str]) -> str:
    """The Markdown matrix of several JSON reports."""
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
        for name, by_id in zip(names, cells, strict=True):
            c = by_id.get(cid)
            if c is None:
                row.append("-")
                continue
            mark = MARKS.get(c["outcome"], c["outcome"])
            if c["outcome"] != "passed" and c.get("why"):
                clauses = notes.setdefault((name, _short(c["why"], 300)), [])
                clauses.append(cid)
                mark += f" [{list(notes).index((name, _short(c['why'], 300))) + 1}]"
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="poot-conformance compare",
                                description="JSON reports of several servers side by side, as a Markdown matrix.")
    p.add_argument("reports", nargs="+", metavar="REPORT.json")
    p.add_argument("--name", action="append", default=[],
                   help="column name per report, in order (default: the file's stem)")
    p.add_argument("--markdown", "-o", metavar="PATH", default="conformance-compare.md",
                   help="where to write the matrix (default conformance-compare.md)")
    args = p.parse_args(argv)
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
