"""startup/*: unknown options fail; nothing but the plan sets rows and positions."""

from __future__ import annotations

import time

import httpx
import pytest

from poot.conformance.client import Client
from poot.conformance.facts import Facts
from poot.conformance.outcomes import NotSupported
from poot.conformance.scenarios import Probes, RawStream, unique_text

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


def rows_running_at_once(client: Client, probes: Probes, more_than: int) -> int:
    """How many of `more_than` + 4 long streams opened at once run together, by the server's
    running gauge, once every one of them is running or queued."""
    count = more_than + 4
    streams = [RawStream.open(client, unique_text(16), **probes.long_params(400)) for _ in range(count)]
    try:
        client.wait_until(lambda s: s.get("engine_requests_running", 0) + s.get("engine_requests_waiting", 0)
                          >= count, 60, f"{count} requests running or queued")
        deadline, most = time.monotonic() + 1.0, 0.0
        while time.monotonic() < deadline:
            most = max(most, client.metrics().get("engine_requests_running", 0))
            time.sleep(0.02)
        return int(most)
    finally:
        for s in streams:
            s.close()


@clause("startup/plan/2")
def test_environment_does_not_change_the_plan(spawn, target, client: Client):
    base = client.need_plan("rows", "positions")
    p = spawn(env=ROW_AND_POSITION_ENV)
    p.wait_healthy(target.options.getoption("poot_startup_timeout"))
    probe = Client(p.url)
    try:
        # The second server's plan is read as the first one's was, from what it publishes (its
        # /health plan, llama.cpp's /props, vLLM's /v1/models), never from its command line,
        # which is the first one's too; rows it does not publish are counted on its running gauge.
        probe.facts = Facts.discover(probe.http, dialect=target.facts.dialect)
        probe.dialect = probe.facts.dialect
        other, how = {}, {}
        for key in ("rows", "positions"):
            if key in probe.facts.known and probe.facts.known[key].value:
                other[key], how[key] = probe.facts.known[key].value, probe.facts.known[key].source
        if "rows" not in other:
            probe.facts.learn_metrics(probe.metrics())
            if not (probe.facts.has("running") and probe.facts.has("waiting")):
                raise NotSupported("the second server publishes no rows and no running and waiting gauges to count "
                                   "them on, so an environment variable's effect on them cannot be seen")
            other["rows"] = rows_running_at_once(probe, Probes(probe), base["rows"])
            how["rows"] = f"counted on its running gauge with {base['rows'] + 4} streams open"
        if "positions" not in other:
            raise NotSupported("the second server does not publish its positions, so an environment variable's "
                               "effect on them cannot be seen")
    finally:
        probe.close()
    for key in ("rows", "positions"):
        assert other[key] == base[key], \
            (f"with row/position environment variables set, plan.{key} is {other[key]} ({how[key]}), "
             f"without {base[key]}")
