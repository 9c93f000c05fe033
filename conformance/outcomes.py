"""Outcomes of a clause, and the exception a test raises when the server lacks a capability.

Borrowed vocabulary: web-platform-tests ends an unsupported optional feature as
PRECONDITION_FAILED, Autobahn as UNIMPLEMENTED. Here it is `not_supported`, never a pass.
"""

from __future__ import annotations

from enum import StrEnum

from _pytest.outcomes import Skipped


class Outcome(StrEnum):
    PASSED = "passed"
    FAILED = "failed"
    NOT_SUPPORTED = "not_supported"

    @property
    def rank(self) -> int:
        return {"passed": 0, "not_supported": 1, "failed": 2}[self.value]


class NotSupported(Skipped):
    """The server lacks what a clause needs (/metrics 404, /debug/fault 404, no server command).

    Subclasses pytest's skip so plain pytest shows it as skipped; the plugin reports it as
    "not supported" and the summary can then be at best "partial".
    """

    def __init__(self, reason: str):
        super().__init__(msg=reason, allow_module_level=False)
        self.reason = reason


def not_supported(reason: str) -> NotSupported:
    return NotSupported(reason)


def worst(outcomes: list[Outcome]) -> Outcome:
    """A clause's outcome from its tests' outcomes: any failure fails it."""
    return max(outcomes, key=lambda o: o.rank) if outcomes else Outcome.NOT_SUPPORTED


def summary_result(outcomes: list[Outcome]) -> str:
    """Gateway-API style: success (all passed), partial (some not supported), failure."""
    if any(o is Outcome.FAILED for o in outcomes):
        return "failure"
    if any(o is Outcome.NOT_SUPPORTED for o in outcomes) or not outcomes:
        return "partial"
    return "success"
