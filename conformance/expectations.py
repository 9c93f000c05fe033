"""Expectations: the outcome a server is known to get per clause, so CI fails on a change.

A file maps clause ids to an expected outcome (passed, failed, not_supported, crashed, not_run)
and a one-line reason, as web-platform-tests keeps expectation files beside its tests. A clause the file does
not name is expected to pass. A run held to a file succeeds when every result matches; a
regression (expected to pass, now failed or crashed) is listed first, unexpected passes are
listed too.

    # poot-conformance expectations
    target: llama-server ...
    clauses:
      cancel/nonstream/1: {expected: failed, reason: a client that hangs up is not noticed,
                           confirmed: by hand, the request ran on 191 s to its 2000th token}

`confirmed` says, in one line, how an outcome was reproduced by hand (an entry without it is
only what a run saw); a rewrite keeps it, with the reason, while the outcome stays the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .outcomes import Outcome
from .report import RunReport


class ExpectationsError(ValueError):
    pass


@dataclass(slots=True, frozen=True)
class Expected:
    outcome: Outcome
    reason: str = ""
    confirmed: str = ""  # how the outcome was reproduced by hand, in one line; "" for as seen in a run


def load(path: str | Path) -> dict[str, Expected]:
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ExpectationsError(f"{path}: {e}") from e
    clauses = data.get("clauses") if isinstance(data, dict) else None
    if not isinstance(clauses, dict):
        raise ExpectationsError(f"{path}: expected a mapping with 'clauses: {{id: {{expected, reason}}}}'")
    out = {}
    for cid, entry in clauses.items():
        raw = entry.get("expected") if isinstance(entry, dict) else entry
        try:
            outcome = Outcome(str(raw).replace(" ", "_"))
        except ValueError as e:
            raise ExpectationsError(f"{path}: {cid}: expected must be one of "
                                    f"{', '.join(o.value for o in Outcome)}, got {raw!r}") from e
        fields = entry if isinstance(entry, dict) else {}
        out[str(cid)] = Expected(outcome, str(fields.get("reason") or ""), str(fields.get("confirmed") or ""))
    return out


def _one_line(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def dump(report: RunReport, keep: dict[str, Expected] | None = None) -> str:
    """The run's results as a baseline; the reason and confirmation already written for an
    unchanged outcome are kept."""
    keep = keep or {}
    clauses = {}
    for r in report.results:
        old = keep.get(r.clause.id)
        same = old is not None and old.outcome is r.outcome
        reason = old.reason if same and old.reason else _one_line(r.why)
        entry = {"expected": r.outcome.value}
        if r.outcome is not Outcome.PASSED:
            entry["reason"] = reason
        if same and old.confirmed:
            entry["confirmed"] = old.confirmed
        clauses[r.clause.id] = entry
    head = ("# poot-conformance expectations: the outcome each clause is known to get on this server.\n"
            "# A clause not named here is expected to pass. Rewrite with --write-expectations.\n")
    return head + yaml.safe_dump({"target": report.target, "clauses": clauses}, sort_keys=False, width=120)


@dataclass(slots=True)
class Change:
    clause: str
    expected: Outcome
    got: Outcome
    why: str
    reason: str


@dataclass(slots=True)
class Verdict:
    path: str
    regressions: list[Change] = field(default_factory=list)  # expected passed, now failed or crashed
    unexpected_passes: list[Change] = field(default_factory=list)
    other: list[Change] = field(default_factory=list)  # any other difference
    matched: int = 0

    @property
    def ok(self) -> bool:
        return not (self.regressions or self.unexpected_passes or self.other)

    def describe(self) -> str:
        total = self.matched + len(self.regressions) + len(self.unexpected_passes) + len(self.other)
        lines = [f"Expectations ({self.path}): {self.matched} of {total} clauses as expected"]
        for title, changes in (("Regressions (expected to pass, now failed or crashed)", self.regressions),
                               ("Other differences", self.other),
                               ("Unexpected passes (update the expectations)", self.unexpected_passes)):
            if changes:
                lines.append(f"  {title}:")
                for c in changes:
                    line = f"    {c.clause}: expected {c.expected.value}, got {c.got.value}"
                    if c.why:
                        line += f": {_one_line(c.why)}"
                    lines.append(line)
        return "\n".join(lines)


def judge(report: RunReport, expected: dict[str, Expected], path: str = "") -> Verdict:
    verdict = Verdict(path)
    for r in report.results:
        want = expected.get(r.clause.id, Expected(Outcome.PASSED))
        if want.outcome is r.outcome:
            verdict.matched += 1
            continue
        change = Change(r.clause.id, want.outcome, r.outcome, r.why, want.reason)
        if want.outcome is Outcome.PASSED and r.outcome in (Outcome.FAILED, Outcome.CRASHED):
            verdict.regressions.append(change)
        elif r.outcome is Outcome.PASSED:
            verdict.unexpected_passes.append(change)
        else:
            verdict.other.append(change)
    return verdict
