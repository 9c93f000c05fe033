"""Defects of structured outputs (response_format) and of the refusal of unknown fields: request
and answer rewrites around the unchanged app (api_parts.Rewrite), a ServerState whose failure to
compile a schema escapes as a server error, and constrained decoding scheduled badly (grammars
compiled on the engine thread, a driver that builds for masked rows, constrained requests
opened one at a time). Each factory takes (app, state), as the registry's middleware parts do."""

from __future__ import annotations

import functools
import queue
from collections import deque
from collections.abc import Callable

from poot.engine import Engine, InvalidRequest
from poot.engine.drivers.cpu import CpuDriver
from poot.engine.engine import _Job
from poot.engine.scheduler import Scheduler
from poot.server import openai
from poot.server.state import ServerState

from .api_parts import Json, _rewrite, _without, each_choice

FIELD = "response_format"


def _format_type(body: Json) -> str | None:
    rf = body.get(FIELD)
    return rf.get("type") if isinstance(rf, dict) else None


def _constrained(body: Json) -> bool:
    return body.get(FIELD) is not None


def _drop_format_when(holds: Callable[[Json], bool]) -> Callable[[Json], Json]:
    def request(body: Json) -> Json:
        if holds(body):
            body.pop(FIELD, None)
        return body
    return request


def _length_as_stop(choice: dict) -> None:
    if choice.get("finish_reason") == "length":
        choice["finish_reason"] = "stop"


def _only_implemented_fields(body: Json) -> Json:
    """Drops, before the server reads them, the fields it would refuse as not implemented."""
    known = openai.COMPLETION_FIELDS | openai.CHAT_FIELDS | openai.IGNORED_FIELDS
    return {k: v for k, v in body.items() if k in known}


response_format_dropped = _rewrite(request=_without(FIELD))
stream_unconstrained = _rewrite(request=_drop_format_when(lambda body: bool(body.get("stream"))))
completion_format_dropped = _rewrite(request=_drop_format_when(lambda body: "prompt" in body))  # chat keeps it
json_object_dropped = _rewrite(request=_drop_format_when(lambda body: _format_type(body) == "json_object"))
truncated_reported_stop = _rewrite(answer=each_choice(_length_as_stop), when=_constrained)
unknown_fields_dropped = _rewrite(request=_only_implemented_fields)
# Not a defect: a server without structured outputs that says so, naming the field.
refuses_response_format = _rewrite(refuse=lambda body: FIELD if _constrained(body) else None)


class SchemaError500(ServerState):
    """A schema that cannot be compiled is not caught as the client's error: 500."""

    def matchers(self, response_format, count: int) -> list:
        try:
            return super().matchers(response_format, count)
        except InvalidRequest as e:
            raise RuntimeError(f"grammar compile failed: {e}") from None


# ---- scheduling: where grammars are compiled, what a masked row costs, who is opened ----------


class CompiledByTheEngine(ServerState):
    """Hands the engine, for each choice, what makes its matcher instead of the matcher: the
    worker thread compiles nothing (see CompileOnEngineThread)."""

    def matchers(self, constraint, count: int) -> list:
        one = functools.partial(ServerState.matchers, self, constraint, 1)
        return [lambda: one()[0] for _ in range(count)]


class _StartedAsTaken:
    """The engine's job queue, whose jobs get their grammars compiled and their matchers started
    as the engine takes them: in phase 1, on the engine thread. A schema that cannot be
    compiled is still refused with the engine's own rejection (a 400)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()

    def put(self, job) -> None:
        self.jobs.put(job)

    def qsize(self) -> int:
        return self.jobs.qsize()

    def get_nowait(self):
        while True:
            job = self.jobs.get_nowait()  # queue.Empty ends phase 1
            try:
                job.grammars = tuple(make() for make in job.grammars)
                return job
            except InvalidRequest as e:
                for handle in (job.handle, *job.more):
                    self.engine._reject(_Job(handle, job.prompt, job.params), str(e), e.param)


class CompileOnEngineThread(Engine):
    """Compiles each request's grammar, and starts its matchers, when the loop takes the
    request: every running stream waits for the compile."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._jobs = _StartedAsTaken(self)


class RecompileOnPickChange(CpuDriver):
    """Builds a new entry whenever a step's rows change between all picked on the device and
    some whose logits go back to the host (a grammar's mask), as a driver with one prepared
    entry per pick mode, built when the mode changes, would."""

    host_rows: bool | None = None

    def run_step(self, step, batch):
        host = any(w.num_logits and w.pick is None for w in batch)
        if self.host_rows is not None and host != self.host_rows:
            self._built()
        self.host_rows = host
        return super().run_step(step, batch)


def _opens_with(seq, first) -> bool:
    """Whether `seq` is `first` or one of its request's other choices (which open together)."""
    return first is not None and (seq is first or (seq.group is not None and seq.group is first.group))


class OneConstrainedAtATime(Scheduler):
    """Opens a request with a grammar only while no other one runs: the others wait in the
    queue, while plain requests are opened as ever."""

    def open_waiting(self):
        constrained = [q for q in self.waiting if q.grammar is not None]
        busy = any(s.grammar is not None for s in self.running)
        first = constrained[0] if constrained and not busy else None
        held = [q for q in constrained if not _opens_with(q, first)]
        for q in held:
            self.waiting.remove(q)
        try:
            return super().open_waiting()
        finally:
            self.waiting = deque(sorted([*self.waiting, *held], key=lambda q: q.arrival))
