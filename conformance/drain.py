"""What the shutdown scenario (suite/test_drain.py) saw, and the verdicts of its clauses: each
names the fault it found, so that a server that stops at the signal reads as one that does
not drain, and a stream cut short says where it was cut."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_TOKENS = 400  # the fewest tokens the stream in flight asks for


@dataclass
class Drain:
    """What the shutdown scenario saw. Each step is recorded even when a later one goes wrong,
    so every clause is judged on the evidence it needs, and one that has none says why."""

    max_tokens: int = MAX_TOKENS  # of the stream in flight
    health: list[tuple[int | None, dict]] = field(default_factory=list)  # answers while the stream ran
    stopped_at_signal: int | None = None  # the exit status, where the process was gone while /health was asked
    new_request: int | str | None = None  # status of a request sent while draining, or "refused"
    finish_reason: str | None = None
    done: bool = False
    stream_error: str | None = None  # why the in-flight stream was not read to its end
    exit_code: int | None = None
    exit_wait: float = 0.0  # how long the exit was waited for
    stream_ended_before_poll: bool = False


def stopped(d: Drain) -> str:
    """What the process did at the signal, where it was gone while it should have drained."""
    if d.stopped_at_signal is None:
        return ""
    return f"the server stopped at the shutdown signal (exited with status {d.stopped_at_signal}) instead of draining"


def health_verdict(d: Drain) -> str | None:
    """Why drain/health/1 fails, or None when it passes."""
    if not d.health:
        if d.done and d.finish_reason == "length":  # the suite's request was too short for this server
            return f"the request ({d.max_tokens} tokens) ended before /health could be asked"
        return "; ".join(filter(None, [stopped(d), "the stream in flight ended at the shutdown signal "
                                       f"({ending(d)}), before /health could be asked"]))
    for status, body in d.health:
        if status is None:
            return "; ".join(filter(None, [stopped(d), f"/health got no answer after the shutdown signal "
                                           f"({body.get('no answer')}), expected 503 status 'draining'"]))
        if status != 503 or body.get("status") != "draining":
            return f"while draining /health answered {status} {body!r}, expected 503 status 'draining'"
    return None


def inflight_verdict(d: Drain) -> str | None:
    """Why drain/inflight/1 fails, or None when it passes: the stream must end as it would have
    without the shutdown, with finish_reason 'length' and then [DONE]."""
    if d.done and d.finish_reason == "length":
        return None
    how = "; ".join(filter(None, [stopped(d), d.stream_error]))
    how = f" ({how})" if how else ""
    if not d.done:
        return f"the stream in flight at shutdown was cut off {ending(d)}{how}"
    if d.finish_reason is None:
        return f"the stream in flight at shutdown ended with [DONE] but no finish_reason{how}, expected 'length'"
    return f"the stream in flight at shutdown ended with finish_reason {d.finish_reason!r}{how}, expected 'length'"


def ending(d: Drain) -> str:
    """How the stream in flight ended, where it did not end as it should."""
    if d.done:
        return f"[DONE] after finish_reason {d.finish_reason!r}" if d.finish_reason else "[DONE] with no finish_reason"
    if d.finish_reason:
        return f"after its last chunk (finish_reason {d.finish_reason!r}): it ended without [DONE]"
    return "before its last chunk (no finish_reason): it ended without [DONE]"


def exit_verdict(d: Drain) -> str | None:
    """Why drain/exit/1 fails, or None when it passes."""
    if d.exit_code is None:
        return (f"the server was still running {d.exit_wait:.0f} s after its in-flight stream ended, "
                "expected it to exit 0 once drained")
    if d.stopped_at_signal is not None:
        return f"the server exited with status {d.stopped_at_signal} at the shutdown signal, without draining, " \
               "expected 0 once drained"
    if d.exit_code != 0:
        return f"the server exited with {d.exit_code} after draining, expected 0"
    return None
