"""startup/*: unknown options fail; nothing but the plan sets rows and positions."""

from __future__ import annotations

import time

import httpx
import pytest

from poot.conformance.client import Client
from poot.conformance.facts import Facts
from poot.conformance.outcomes import NotSupported

clause = pytest.mark.clause

ROW_AND_POSITION_OPTIONS = [("--rows", "3"), ("--max-num-seqs", "3"), ("--positions", "64"),
                            ("--max-model-len", "64"), ("--ctx-size", "64")]
ROW_AND_POSITION_ENV = {name: "3" for name in ("POOT_ROWS", "POOT_NUM_ROWS", "POOT_MAX_ROWS", "ROWS",
                                                 "MAX_NUM_SEQS", "POOT_MAX_NUM_SEQS", "N_PARALLEL",
                                                 "LLAMA_ARG_N_PARALLEL")}
ROW_AND_POSITION_ENV |= {name: "64" for name in ("POOT_POSITIONS", "POOT_MAX_POSITIONS", "POSITIONS",
                                                   "MAX_MODEL_LEN", "POOT_CTX_SIZE", "N_CTX", "LLAMA_ARG_CTX_SIZE")}


def refuses(processes, timeout: float) -> list[str]:
    """Which of the started processes served /health 200 or kept running instead of exiting non-zero."""
    deadline, wrong, pending = time.monotonic() + timeout, [], dict(processes)
    while pending and time.monotonic() < deadline:
        for name, p in list(pending.items()):
            code = p.proc.poll()
            if code is not None:
                if code == 0:
                    wrong.append(f"{name}: exited 0")
                del pending[name]
                continue
            try:
                if httpx.get(p.url + "/health", timeout=0.5).status_code == 200:
                    wrong.append(f"{name}: started and served /health 200")
                    del pending[name]
            except httpx.HTTPError:
                pass
        time.sleep(0.05)
    return wrong + [f"{name}: still running after {timeout:.0f}s" for name in pending]


@clause("startup/options/1")
def test_unknown_option_fails_startup(spawn, target):
    p = spawn(("--no-such-option-poot", "1"))
    wrong = refuses({"--no-such-option-poot": p}, target.options.getoption("poot_startup_timeout"))
    assert not wrong, "an unknown option did not fail startup: " + "; ".join(wrong)


@clause("startup/plan/1")
def test_no_option_sets_rows_or_positions(spawn, target):
    started = {f"{o} {v}": spawn((o, v)) for o, v in ROW_AND_POSITION_OPTIONS}
    wrong = refuses(started, target.options.getoption("poot_startup_timeout"))
    assert not wrong, "options for rows or positions were accepted: " + "; ".join(wrong)


@clause("startup/plan/2")
def test_environment_does_not_change_the_plan(spawn, target, client: Client):
    base = client.need_plan("rows", "positions")
    told = [f"{k} ({target.facts.known[k].source})" for k in ("rows", "positions")
            if k in target.facts.known and "command" in target.facts.known[k].source]
    if told:
        raise NotSupported(f"{', '.join(told)} is read off the command line, not from the server, so an "
                           "environment variable's effect on it cannot be seen")
    p = spawn(env=ROW_AND_POSITION_ENV)
    p.wait_healthy(target.options.getoption("poot_startup_timeout"))
    probe = Client(p.url)
    try:
        # The second server's facts are read as the first one's were: its /health plan, or what
        # its kind publishes (llama.cpp's /props).
        probe.facts = Facts.discover(probe.http, dialect=target.facts.dialect)
        other = probe.need_plan("rows", "positions")
    finally:
        probe.close()
    for key in ("rows", "positions"):
        assert other[key] == base[key], \
            f"with row/position environment variables set, plan.{key} is {other[key]}, without {base[key]}"
