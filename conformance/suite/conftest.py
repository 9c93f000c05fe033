"""Fixtures of the conformance suite: the server under test, private servers, probes."""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from poot.conformance.client import Client, api_key_from_env, auth_headers
from poot.conformance.facts import FACTS_KEY, Facts, FactsError, read_given
from poot.conformance.life import LIFE, NOT_STARTED, START_FAILURE, Life
from poot.conformance.outcomes import NotRun, NotSupported
from poot.conformance.scenarios import Probes, unique_text
from poot.conformance.target import (
    BUNDLED_MODEL,
    BUNDLED_RECURRENT_MODEL,
    ServerCommand,
    ServerProcess,
    ServerStartError,
    bundled_command,
    describe_loading,
    loading_body,
    wait_ready,
)


@dataclass
class Target:
    """The server under test, and how to start more of it when the suite may."""

    client: Client
    facts: Facts
    command: ServerCommand | None  # None: only a URL was given
    bundled: bool
    options: pytest.Config
    life: Life
    _extra: dict[str, tuple[ServerProcess, Client] | Exception] = field(default_factory=dict)

    @property
    def process(self) -> ServerProcess | None:
        """The shared server's process, where the suite started it (a fresh one after a crash)."""
        return self.life.process

    @property
    def step_slack(self) -> int:
        return self.options.getoption("poot_step_slack")

    def can_spawn(self) -> ServerCommand:
        if self.command is None:
            raise NotSupported("needs a server the suite can start (--server-cmd or the bundled one); "
                               "only --base-url was given")
        if not self.command.has_port:
            raise NotSupported("the server command has no {port} placeholder, so the suite cannot start "
                               "a private server beside the main one")
        return self.command

    def variant(self, name: str) -> Client:
        """A second server started once per session: "recurrent" or "speculative"."""
        if name not in self._extra:
            self._extra[name] = self._start_variant(name)
        got = self._extra[name]
        if isinstance(got, BaseException):
            raise got
        return got[1]

    def _start_variant(self, name: str) -> tuple[ServerProcess, Client] | Exception:
        given = self.options.getoption(f"poot_{name}_server_cmd")
        timeout = self.options.getoption("poot_startup_timeout")
        if given:
            command = ServerCommand(given, timeout)
        elif self.bundled:
            command = ServerCommand(bundled_command(BUNDLED_RECURRENT_MODEL) if name == "recurrent"
                                    else bundled_command(BUNDLED_MODEL, "--draft", "ngram"), timeout)
        else:
            return NotSupported(f"needs a {name} server: pass --{name}-server-cmd")
        try:
            process = command.start(on_progress=starting(self.options, f"{name} server"))
        except ServerStartError as e:
            if given:
                return AssertionError(f"the {name} server did not start: {e}")
            return NotSupported(f"the bundled server has no {name} variant: {str(e).splitlines()[0]}")
        return process, Client(process.url, dialect=self.client.dialect, api_key=self.client.api_key)

    def close(self) -> None:
        for got in self._extra.values():
            if isinstance(got, tuple):
                got[1].close()
                got[0].stop()
        self.client.close()
        self.life.close()


PROGRESS_EVERY_S = 10.0


def starting(config: pytest.Config, what: str) -> Callable[[dict], None]:
    """Says on the console (past pytest's capture) how a starting server is getting on: at each
    new phase, and at most every PROGRESS_EVERY_S seconds otherwise."""
    said = {"phase": None, "at": 0.0}
    capture = config.pluginmanager.getplugin("capturemanager")

    def show(body: dict) -> None:
        now = time.monotonic()
        if body.get("phase") == said["phase"] and now - said["at"] < PROGRESS_EVERY_S:
            return
        said.update(phase=body.get("phase"), at=now)
        with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
            print(f"poot-conformance: the {what} is starting: {describe_loading(body)}", file=sys.stderr, flush=True)

    return show


def reachable_or_starting(url: str) -> bool:
    """Whether a server given by URL answers, other than to say it is still starting."""
    try:
        r = httpx.get(url.rstrip("/") + "/health", timeout=5.0, headers=auth_headers(api_key_from_env()))
    except httpx.TimeoutException:
        return True  # it answers, slowly: the clauses judge that
    except httpx.HTTPError:
        return False
    return loading_body(r.status_code, r.text) is None


def start_target(pytestconfig: pytest.Config, command: ServerCommand | None, url: str | None,
                 timeout: float) -> ServerProcess | None:
    """Starts the server under test (or, for a URL, waits while it says it is starting). One
    that never gets ready is reported once, at the top of the report (START_FAILURE), and every
    clause is then not run."""
    try:
        if command is not None:
            return command.start(url=url, on_progress=starting(pytestconfig, "server"))
        if not reachable_or_starting(url):
            wait_ready(url, timeout, on_progress=starting(pytestconfig, "server"))
    except ServerStartError as e:
        pytestconfig.stash[START_FAILURE] = str(e)
        raise NotRun(NOT_STARTED) from None
    return None


@pytest.fixture(scope="session")
def target(pytestconfig: pytest.Config) -> Iterator[Target]:
    url = pytestconfig.getoption("poot_base_url")
    cmd = pytestconfig.getoption("poot_server_cmd")
    timeout = pytestconfig.getoption("poot_startup_timeout")
    dialect = pytestconfig.getoption("poot_metrics_dialect")
    model = pytestconfig.getoption("poot_model")
    try:
        given = read_given(pytestconfig.getoption("poot_facts"), pytestconfig.getoption("poot_fact"))
    except (OSError, FactsError) as e:
        raise pytest.UsageError(f"facts: {e}") from e
    bundled = not url and not cmd
    if bundled and not os.environ.get("OPENAI_API_KEY"):
        # The bundled servers (and the private ones started from them) require a fresh key, so
        # that api/auth/1 is judged too; the suite's clients send it.
        os.environ["OPENAI_API_KEY"] = os.environ["POOT_API_KEY"] = secrets.token_urlsafe(24)
    command = ServerCommand(bundled_command() if bundled else cmd, timeout) if (cmd or bundled) else None
    process = start_target(pytestconfig, command, url, timeout)
    if url is None:
        url = process.url
    client = Client(url, model=model)
    facts = Facts.discover(client.http, given=given, dialect=dialect, command=command.template if command else None)
    pytestconfig.stash[FACTS_KEY] = facts
    client.dialect, client.facts = facts.dialect, facts
    try:
        facts.learn_metrics(client.metrics())
    except (NotSupported, AssertionError):
        pass  # no /metrics: clauses that need one of its facts say so
    try:
        facts.learn_answer(client.complete(unique_text(12), max_tokens=1))
    except (AssertionError, httpx.HTTPError, ValueError, KeyError, TypeError):
        pass  # the api/* clauses say what is wrong with the answers
    life = Life(url, command=command, process=process, model=lambda: client.model,
                on_progress=starting(pytestconfig, "server"))
    pytestconfig.stash[LIFE] = life
    t = Target(client, facts, command, bundled, pytestconfig, life)
    yield t
    t.close()


@pytest.fixture(scope="session")
def facts(target: Target) -> Facts:
    return target.facts


@pytest.fixture(scope="session")
def client(target: Target) -> Client:
    return target.client


@pytest.fixture(scope="session")
def probes(client: Client, facts: Facts) -> Probes:
    probes = Probes(client)
    if "rows" not in facts.known:
        from poot.conformance.timing import measure_rows

        facts.measure_with("rows", lambda: measure_rows(client, probes))
    return probes


@pytest.fixture
def spawn(target: Target) -> Iterator[Callable[..., ServerProcess]]:
    """Starts private servers from the target's command (not waiting for health); stops them after."""
    started: list[ServerProcess] = []

    def start(extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> ServerProcess:
        command = target.can_spawn()
        process = command.spawn(extra_args, env)
        started.append(process)
        return process

    yield start
    for process in started:
        process.stop(grace=5)


@pytest.fixture
def idle(client: Client):
    """The shared server idle (no request in flight), as a metrics snapshot. The wait lasts as
    long as the engine keeps stepping, so a request an earlier clause left running is waited
    out however slow the server; one that holds something while no step moves is reported not
    idle."""
    return client.wait_idle(timeout=30)


@pytest.fixture(autouse=True)
def settled(request: pytest.FixtureRequest, target: Target) -> Iterator[None]:
    """After each clause, the shared server is waited on until idle (as long as it steps), so
    what one clause leaves running (a hang-up the server did not notice, a request the suite
    gave up on) is charged to that clause's time and cannot fail the next one. A server still
    busy then is reported by the next clause that needs it idle."""
    yield
    if request.node.get_closest_marker("disruptive") is not None:
        return  # these run last and may leave the server unusable
    try:
        target.client.wait_idle(timeout=30)
    except (AssertionError, NotSupported, httpx.HTTPError):
        pass
