"""The shared server's life through a run: whether it still serves, the clause during which it
stopped and the request that did it, and a fresh server where the suite can start one.

As web-platform-tests restarts a browser that crashed and Autobahn isolates each case: after
every clause the suite looks at the server under test (its process, where the suite started
it; /health, or /v1/models where /health does not answer; and, after a clause whose own
requests got a 5xx or no answer, one small completion), each sign used only where it was good
when the run began: a crash is a change, not a server that never answered /health. A clause
during which it died or stopped serving is `crashed`, and names its last requests and what
came back. The clauses after it run
on a fresh server (from the command, or the bundled one, started again on the same port) or,
for a URL, are `not run`.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx
import pytest

from .client import JOURNAL, Journal, Sent, api_key_from_env, auth_headers
from .outcomes import NotRun
from .target import ServerCommand, ServerProcess, ServerStartError

LAST_REQUESTS = 5  # of a crashed clause's requests, the ones its report names
LOOKS = 3  # a server is taken as stopped only when this many looks, LOOK_GAP_S apart, agree
LOOK_GAP_S = 1.0
LOOK_TIMEOUT_S = 10.0  # a look that gets no answer this soon decides nothing (a busy server is not a dead one)
MOST_RESTARTS = 10  # a server that crashes on every clause is not started again without end

NOT_STARTED = "not run: the server did not start"


@dataclass(slots=True)
class Crash:
    """A clause during which the server stopped serving."""

    clause: str
    seen: str  # how the suite saw it: the process's exit status, what /health or a completion answered
    trigger: Sent | None  # the request after which nothing was served (None: the clause sent none)
    last: list[Sent] = field(default_factory=list)  # the clause's last requests, oldest first
    then: str = ""  # what became of the clauses after it
    log: str = ""  # the server's last log lines, where the suite started it

    def reason(self) -> str:
        """The crashed clause's reason."""
        text = f"the server stopped serving during this clause ({self.seen})"
        if self.trigger is not None:
            text += f", after {self.trigger.describe()}"
        if self.last:
            text += "; its last requests: " + " | ".join(s.describe() for s in self.last)
        return text

    def as_dict(self) -> dict:
        return {"clause": self.clause, "seen": self.seen,
                "request": self.trigger.request_line() if self.trigger else None,
                "answer": self.trigger.outcome() if self.trigger else None,
                "last_requests": [{"request": s.request_line(), "answer": s.outcome()} for s in self.last],
                "then": self.then, "log": self.log}


ACCESS_LINE = re.compile(r'"(?:GET|POST|PUT|PATCH|DELETE|HEAD|OPTIONS) \S+ HTTP/[\d.]+" \d{3}')
LOG_LINES = 12


def what_it_logged(process: ServerProcess) -> str:
    """The last lines of the server's log that say something: access-log lines (one per request,
    most of a dying server's log) left out."""
    lines = [line for line in process.log_tail(400).splitlines() if not ACCESS_LINE.search(line)]
    return "\n".join(lines[-LOG_LINES:])


def trigger_of(sent: list[Sent]) -> Sent | None:
    """The request after which the server served nothing: the first of the run of 5xx answers
    and failed connections that ends the clause, else its last request."""
    if not sent:
        return None
    first = len(sent)
    while first > 0 and sent[first - 1].failed:
        first -= 1
    return sent[first] if first < len(sent) else sent[-1]


class Life:
    """The server under test, watched clause by clause (see the module docstring)."""

    def __init__(self, url: str, *, command: ServerCommand | None = None, process: ServerProcess | None = None,
                 model: Callable[[], str] = lambda: "default", journal: Journal = JOURNAL,
                 on_progress: Callable[[dict], None] | None = None):
        self.url = url.rstrip("/")
        self.command = command
        self.process = process
        self.model = model
        self.journal = journal
        self.on_progress = on_progress
        self.crashes: list[Crash] = []
        self.down: str | None = None  # while set, every clause is not run, for this reason
        self._pending: Crash | None = None  # a crash whose fresh server is started before the next clause
        self._mark = journal.mark()
        self.watch = self._watched_path()
        self.completes = self._completion_status() is not None  # a completion is served now: a 5xx later is news

    # ---- around each clause ---------------------------------------------------------------------

    def begin(self) -> None:
        """Before a clause: a fresh server after a crash where the suite can start one; NotRun
        while there is no serving server."""
        if self._pending is not None:
            self._recover(self._pending)
            self._pending = None
        if self.down is not None:
            raise NotRun(self.down)
        self._mark = self.journal.mark()

    def end(self, clause: str) -> Crash | None:
        """After a clause: the crash, when the server stopped serving during it."""
        if self.down is not None:
            return None
        sent = self.journal.since(self._mark, self.url)
        seen = self.stopped_serving(probe=any(s.failed for s in sent))
        if seen is None:
            return None
        crash = Crash(clause, seen, trigger_of(sent), sent[-LAST_REQUESTS:])
        if self.process is not None:
            crash.log = what_it_logged(self.process)
        self.crashes.append(crash)
        self._pending = crash
        return crash

    # ---- looking at the server ------------------------------------------------------------------

    def stopped_serving(self, probe: bool = False) -> str | None:
        """How the server is seen to have stopped serving, or None while it serves. `probe`
        adds a one-token completion to each look (for a server whose /health may say ok while
        every request fails)."""
        seen = None
        for attempt in range(LOOKS):
            if attempt:
                time.sleep(LOOK_GAP_S)
            seen = self._look(probe)
            if seen is None:
                return None
            if seen.startswith("its process exited"):
                return seen
        return seen

    def _watched_path(self) -> str | None:
        """What tells, for this server, that it serves: /health where it answers (not 404, not
        5xx) at the start, else /v1/models where that does; a server that answers neither is
        watched through its process and refused connections only. A crash is a change."""
        headers = auth_headers(api_key_from_env())
        for path in ("/health", "/v1/models"):
            try:
                status = httpx.get(self.url + path, timeout=LOOK_TIMEOUT_S, headers=headers).status_code
            except httpx.HTTPError:
                continue
            if status != 404 and status < 500:
                return path
        return None

    def _completion_status(self) -> int | None:
        """A one-token completion's status, None when it got no answer or a 5xx."""
        try:
            r = httpx.post(self.url + "/v1/completions", timeout=LOOK_TIMEOUT_S * 3,
                           headers=auth_headers(api_key_from_env()),
                           json={"model": self.model(), "prompt": "Hello", "max_tokens": 1})
        except httpx.HTTPError:
            return None
        return r.status_code if r.status_code < 500 else None

    def _look(self, probe: bool) -> str | None:
        code = self.process.proc.poll() if self.process is not None else None
        if code is not None:
            return f"its process exited with status {code}"
        headers = auth_headers(api_key_from_env())
        path = self.watch or "/v1/models"
        try:
            r = httpx.get(self.url + path, timeout=LOOK_TIMEOUT_S, headers=headers)
            if r.status_code >= 500 and self.watch is not None:
                return f"{path} answered {r.status_code} {' '.join(r.text.split())[:200]}"
            if probe and self.completes:
                path = "a one-token completion"
                r = httpx.post(self.url + "/v1/completions", timeout=LOOK_TIMEOUT_S * 3, headers=headers,
                               json={"model": self.model(), "prompt": "Hello", "max_tokens": 1})
                if r.status_code >= 500:
                    return f"{path} answered {r.status_code} {' '.join(r.text.split())[:200]}"
        except httpx.TimeoutException:
            return None
        except httpx.TransportError as e:
            return f"{path} got no answer ({type(e).__name__}: {e})"
        return None

    # ---- after a crash --------------------------------------------------------------------------

    def _recover(self, crash: Crash) -> None:
        if self.command is None:
            self.down = f"not run: the server stopped serving at {crash.clause}"
            crash.then = "the clauses after it were not run (a URL: the suite cannot start the server again)"
            return
        if len(self.crashes) > MOST_RESTARTS:
            self.down = f"not run: the server stopped serving {len(self.crashes)} times; the last at {crash.clause}"
            crash.then = "the suite started no more fresh servers, so the clauses after it were not run"
            return
        if self.process is not None:
            self.process.stop(grace=5)
        began = time.monotonic()
        port = urlsplit(self.url).port
        try:
            # On the same port, so every client of the run keeps its URL.
            self.process = self.command.start(port=port, url=self.url, on_progress=self.on_progress)
        except ServerStartError as e:
            self.process = None
            self.down = f"not run: the server did not start again after it stopped serving at {crash.clause}"
            crash.then = "it did not start again, so the clauses after it were not run: " + str(e)
            return
        crash.then = f"a fresh server judged the clauses after it (ready in {time.monotonic() - began:.0f} s)"

    def close(self) -> None:
        if self.process is not None:
            self.process.stop()


LIFE = pytest.StashKey[Life]()
START_FAILURE = pytest.StashKey[str]()  # why the server under test did not start, log included
