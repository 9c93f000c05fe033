"""Outcomes of a clause, and the exceptions that end a clause short of a verdict.

Borrowed vocabulary: web-platform-tests ends an unsupported optional feature as
PRECONDITION_FAILED, Autobahn as UNIMPLEMENTED. Here it is `not_supported`, never a pass.
A clause during which the server died or stopped serving is `crashed` (web-platform-tests'
CRASH); one the suite could not send to a serving server is `not_run`.
"""

from __future__ import annotations

from enum import StrEnum

from _pytest.outcomes import Skipped


class Outcome(StrEnum):
    PASSED = "passed"
    FAILED = "failed"
    NOT_SUPPORTED = "not_supported"
    NOT_RUN = "not_run"  # no serving server to judge it on: it never started, or stopped at an earlier clause
    CRASHED = "crashed"  # the server died or stopped serving during the clause

    @property
    def rank(self) -> int:
        return {"passed": 0, "not_supported": 1, "not_run": 2, "failed": 3, "crashed": 4}[self.value]

    @property
    def label(self) -> str:
        return self.value.replace("_", " ")


class NotSupported(Skipped):
    """The server lacks what a clause needs (/metrics 404, /debug/fault 404, no server command).

    Subclasses pytest's skip so plain pytest shows it as skipped; the plugin reports it as
    "not supported" and the summary can then be at best "partial".
    """

    def __init__(self, reason: str):
        super().__init__(msg=reason, allow_module_level=False)
        self.reason = reason


class NotRun(Skipped):
    """The clause was never sent to a serving server: it did not start, or stopped serving at an
    earlier clause and cannot be started again (a URL). Reported "not run", never a failure of
    the clause; the run fails for it all the same."""

    def __init__(self, reason: str):
        super().__init__(msg=reason, allow_module_level=False)
        self.reason = reason


def not_supported(reason: str) -> NotSupported:
    return NotSupported(reason)


def worst(outcomes: list[Outcome]) -> Outcome:
    """A clause's outcome from its tests' outcomes: a crash or any failure fails it."""
    return max(outcomes, key=lambda o: o.rank) if outcomes else Outcome.NOT_SUPPORTED


def summary_result(outcomes: list[Outcome]) -> str:
    """Gateway-API style: success (all passed), partial (some not supported), failure (a
    clause failed or crashed, or was not run: a run that could not judge it cannot pass it)."""
    if any(o in (Outcome.FAILED, Outcome.CRASHED, Outcome.NOT_RUN) for o in outcomes):
        return "failure"
    if any(o is Outcome.NOT_SUPPORTED for o in outcomes) or not outcomes:
        return "partial"
    return "success"
