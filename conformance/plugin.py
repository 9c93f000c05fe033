"""The pytest plugin behind poot-conformance.

It registers the `clause` marker and the `--poot-*` options, checks traceability (every test
names known clauses, every clause has a test), keeps the selected clauses (id prefixes,
profiles, --poot-strict for SHOULD), folds test outcomes into clause outcomes, and writes the
reports. Load it with `pytest -p poot.conformance.plugin conformance/suite`, or run
`poot-conformance`, which does that for you.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from . import expectations
from .clauses import PROFILES, SUITE_DIR, Spec, load_spec
from .client import api_key_from_env
from .facts import FACTS_KEY
from .life import LIFE, START_FAILURE, Crash
from .outcomes import NotRun, NotSupported, Outcome, worst
from .report import ClauseResult, RunReport, to_json, to_junit, to_markdown, to_terminal

STATE = pytest.StashKey["RunState"]()
CRASH = pytest.StashKey[Crash]()  # on a test during which the server stopped serving


@dataclass(slots=True)
class TestResult:
    outcome: Outcome = Outcome.PASSED
    why: str = ""
    duration: float = 0.0


@dataclass(slots=True)
class RunState:
    spec: Spec
    selected: list = field(default_factory=list)  # clauses, in spec order
    clauses_of: dict[str, tuple[str, ...]] = field(default_factory=dict)  # nodeid -> clause ids
    results: dict[str, TestResult] = field(default_factory=dict)  # nodeid -> result
    report: RunReport | None = None
    started: float = field(default_factory=time.monotonic)


class TraceabilityError(pytest.UsageError):
    pass


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("poot", "poot conformance suite")
    g.addoption("--poot-base-url", help="URL of a running server to test")
    g.addoption("--poot-server-cmd", help="shell command that starts the server; {port} is replaced by a free port")
    g.addoption("--poot-model", help="model id to send (default: the first of GET /v1/models)")
    g.addoption("--poot-clause", action="append", default=[], help="run clauses with this id prefix (repeatable)")
    g.addoption("--poot-profile", action="append", default=[],
                help=f"run clauses of these profiles (repeatable or comma-separated): {', '.join(PROFILES)}")
    g.addoption("--poot-strict", action="store_true", help="also run SHOULD clauses")
    g.addoption("--poot-json", help="write the JSON report here")
    g.addoption("--poot-junit", help="write the JUnit XML report here")
    g.addoption("--poot-markdown", help="write the Markdown matrix here")
    g.addoption("--poot-metrics-dialect", default="auto", choices=("auto", "poot", "vllm", "llamacpp"),
                help="metric names the server uses (default auto: from the server's kind)")
    g.addoption("--poot-facts", help="a facts file (JSON or YAML: fact name -> value) for what the server does not publish")
    g.addoption("--poot-fact", action="append", default=[], metavar="NAME=VALUE", help="one fact (repeatable)")
    g.addoption("--poot-step-slack", type=int, default=4,
                help="engine steps allowed between a hang-up being noticeable and its release (default 4: the step in flight and the next, plus two for the polls that see it)")
    g.addoption("--poot-recurrent-server-cmd", help="command that starts the server with a recurrent-state model")
    g.addoption("--poot-speculative-server-cmd", help="command that starts the server with speculative decoding")
    g.addoption("--poot-examples", type=int, default=25, help="examples per property test")
    g.addoption("--poot-startup-timeout", type=float, default=60.0,
                help="seconds a starting server may go without being ready or reporting new progress")
    g.addoption("--poot-expectations", help="expectations file: the run succeeds when every result matches it")
    g.addoption("--poot-write-expectations", help="write the run's results here as an expectations baseline")
    g.addoption("--poot-report", action="store_true", help="print the per-clause listing (on by default in poot-conformance)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "clause(*ids): the spec clauses a conformance test checks")
    config.addinivalue_line("markers", "disruptive: may leave the shared server unusable; runs last")
    config.stash[STATE] = RunState(load_spec())
    command = config.getoption("poot_server_cmd", None)
    if command and "{port}" not in command and not config.getoption("poot_base_url", None):
        raise pytest.UsageError("--server-cmd needs a {port} placeholder, or --base-url to say where it listens")
    if path := config.getoption("poot_expectations", None):
        try:  # read now, not after a run that may last half an hour
            expectations.load(path)
        except (OSError, expectations.ExpectationsError) as e:
            raise pytest.UsageError(str(e)) from e


def profiles_of(config: pytest.Config) -> list[str]:
    names = [p.strip() for value in config.getoption("poot_profile") for p in value.split(",") if p.strip()]
    if unknown := [p for p in names if p not in PROFILES]:
        raise pytest.UsageError(f"unknown profile(s) {unknown}; known: {', '.join(PROFILES)}")
    return names


def clause_ids(item: pytest.Item) -> tuple[str, ...]:
    return tuple(cid for mark in item.iter_markers("clause") for cid in mark.args)


def check_traceability(spec: Spec, clauses_of: dict[str, tuple[str, ...]], complete: bool) -> list[str]:
    """Problems that must fail the build: untagged tests, unknown clauses, clauses nobody tests."""
    problems = []
    for nodeid, ids in clauses_of.items():
        if not ids:
            problems.append(f"{nodeid} names no clause (add @pytest.mark.clause(...))")
        problems += [f"{nodeid} names unknown clause {cid!r}" for cid in ids if cid not in spec]
    if complete:
        tested = {cid for ids in clauses_of.values() for cid in ids}
        problems += [f"clause {c.id} has no test" for c in spec if c.id not in tested]
    return problems


def _is_complete(items: list[pytest.Item]) -> bool:
    """Whether every test file of the installed suite was collected."""
    collected = {Path(item.path).resolve() for item in items}
    files = {p.resolve() for p in SUITE_DIR.glob("test_*.py")}
    return bool(files) and files <= collected


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    state = config.stash[STATE]
    ours = [i for i in items if Path(i.path).resolve().is_relative_to(SUITE_DIR.resolve())]
    if not ours:
        return
    state.clauses_of = {i.nodeid: clause_ids(i) for i in ours}
    if problems := check_traceability(state.spec, state.clauses_of, _is_complete(ours)):
        raise TraceabilityError("traceability check failed:\n  " + "\n  ".join(problems))
    strict = config.getoption("poot_strict")
    state.selected = state.spec.select(config.getoption("poot_clause"), profiles_of(config), strict)
    chosen = {c.id for c in state.selected}
    keep = [i for i in items if i not in ours or set(state.clauses_of[i.nodeid]) & chosen]
    dropped = [i for i in items if i not in keep]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    # Tests that may break the shared server go last.
    keep.sort(key=lambda i: i.get_closest_marker("disruptive") is not None)
    items[:] = keep


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before any fixture of a clause: a fresh server if the last one stopped serving, or the
    clause is not run."""
    life = item.config.stash.get(LIFE, None)
    if life is not None and item.nodeid in item.config.stash[STATE].clauses_of:
        life.begin()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """After a clause, before its fixtures end (and the session's with the last one): did the
    server stop serving during it?"""
    life = item.config.stash.get(LIFE, None)
    if life is not None and item.nodeid in item.config.stash[STATE].clauses_of:
        crash = life.end(", ".join(clause_ids(item)))
        if crash is not None:
            item.stash[CRASH] = crash
    return (yield)


def _why(excinfo: pytest.ExceptionInfo) -> str:
    exc = excinfo.value
    if isinstance(exc, NotSupported | NotRun):
        return exc.reason
    text = str(exc).strip() or excinfo.typename
    if isinstance(exc, AssertionError):
        # keep the test's own message, not pytest's rewritten "assert ..." explanation
        kept = []
        for line in text.splitlines():
            if line.startswith(("assert ", " +", "  +")) and kept:
                break
            kept.append(line)
        text = "\n".join(kept)
    else:
        text = f"{excinfo.typename}: {text}"
    notes = getattr(exc, "__notes__", None)
    if notes:
        text += " | " + " ".join(str(n) for n in notes)
    return text


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    state = item.config.stash[STATE]
    if item.nodeid not in state.clauses_of:
        return report
    result = state.results.setdefault(item.nodeid, TestResult())
    result.duration += call.duration
    crash = item.stash.get(CRASH, None) if call.when == "teardown" else None
    if crash is not None:  # whatever the clause itself saw, the server stopped serving under it
        saw = f"; the clause saw: {result.why}" if result.why and result.outcome is not Outcome.PASSED else ""
        result.outcome, result.why = Outcome.CRASHED, crash.reason() + saw
        return report
    if call.excinfo is None:
        return report
    if call.excinfo.errisinstance(NotRun):
        outcome, why = Outcome.NOT_RUN, _why(call.excinfo)
    elif call.excinfo.errisinstance(NotSupported) or report.skipped:
        outcome = Outcome.NOT_SUPPORTED
        why = _why(call.excinfo) if call.excinfo.errisinstance(NotSupported) else f"skipped: {call.excinfo.value}"
    else:
        outcome = Outcome.FAILED
        why = _why(call.excinfo)
        if call.when != "call":
            why = f"{call.when} failed: {why}"
    if outcome.rank > result.outcome.rank or not result.why:
        result.outcome, result.why = worst([result.outcome, outcome]), why
    return report


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    state = config.stash[STATE]
    if not state.selected:
        return
    results = []
    for clause in state.selected:
        tests = [nid for nid, ids in state.clauses_of.items() if clause.id in ids and nid in state.results]
        if not tests:
            results.append(ClauseResult(clause, Outcome.NOT_SUPPORTED, "no test ran for this clause"))
            continue
        runs = [state.results[n] for n in tests]
        outcome = worst([r.outcome for r in runs])
        why = "; ".join(dict.fromkeys(r.why for r in runs if r.outcome is outcome and r.why))
        results.append(ClauseResult(clause, outcome, redact(why), tests, sum(r.duration for r in runs)))
    target = (config.getoption("poot_base_url") or config.getoption("poot_server_cmd")
              or "bundled reference server")
    facts = config.stash.get(FACTS_KEY, None)
    life = config.stash.get(LIFE, None)
    crashes = [redact_all(c.as_dict()) for c in (life.crashes if life is not None else [])]
    state.report = RunReport(results, target=redact(target), profiles=profiles_of(config),
                             strict=config.getoption("poot_strict"),
                             duration=time.monotonic() - state.started,
                             facts=facts.report() if facts is not None else {},
                             crashes=crashes, not_started=redact(config.stash.get(START_FAILURE, "")))
    if path := config.getoption("poot_expectations"):
        try:
            expected = expectations.load(path)
        except expectations.ExpectationsError as e:
            raise pytest.UsageError(str(e)) from e
        state.report.expectations = expectations.judge(state.report, expected, path)
    if path := config.getoption("poot_write_expectations"):
        keep = expectations.load(path) if Path(path).exists() else {}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(expectations.dump(state.report, keep))
    for option, render in (("poot_json", to_json), ("poot_junit", to_junit), ("poot_markdown", to_markdown)):
        if path := config.getoption(option):
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(render(state.report))
    verdict = state.report.expectations
    if verdict is not None:  # held to expectations: known failures are fine, any change is not
        if session.exitstatus in (0, 1):
            session.exitstatus = 0 if verdict.ok else 1
    elif state.report.result == "failure" and session.exitstatus == 0:
        session.exitstatus = 1


def redact(text: str) -> str:
    """The API key never reaches a report or the terminal."""
    key = api_key_from_env()
    return text.replace(key, "***") if key and text else text


def redact_all(data):
    if isinstance(data, str):
        return redact(data)
    if isinstance(data, dict):
        return {k: redact_all(v) for k, v in data.items()}
    if isinstance(data, list):
        return [redact_all(v) for v in data]
    return data


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    report = config.stash[STATE].report
    if report is None or not config.getoption("poot_report"):
        return
    terminalreporter.section("conformance")
    terminalreporter.write_line(to_terminal(report))
