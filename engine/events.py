"""What the engine tells a request's owner, from the engine thread.

A handle receives, in order: exactly one of Accepted or Rejected; then, if accepted, any
number of Tokens (after one PromptLogprobs when the prompt's logprobs were asked for); then
exactly one Finished. `sink` is called on the engine thread, so it
must be quick and thread-safe (the server hands events to its event loop).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "cancelled", "error"]


@dataclass(slots=True, frozen=True)
class Accepted:
    prompt_tokens: int


@dataclass(slots=True, frozen=True)
class Rejected:
    message: str
    param: str | None = None


@dataclass(slots=True, frozen=True)
class Tokens:
    """Tokens committed in one step, and the text they released (may be empty: held back)."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[float, ...] = ()  # one per token, when the request asked for logprobs
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()  # per token: (id, logprob), most likely first


@dataclass(slots=True, frozen=True)
class PromptLogprobs:
    """The prompt's tokens scored by the model (echo), sent once its prefill is done, before
    any Tokens. The first token has no logprob (None): nothing comes before it."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float | None, ...]
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...]


@dataclass(slots=True, frozen=True)
class Finished:
    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    error: str | None = None  # why, when reason == "error"
    text: str = ""  # held-back text released at the end (never part of a stop string)
    # Seconds from submission to taking a row, and from taking a row to the first output
    # token (None where the request never got that far). Timings, not outcomes: two runs of
    # the same requests finish equal whatever they took.
    queued_s: float | None = field(default=None, compare=False)
    prefill_s: float | None = field(default=None, compare=False)


Event = Accepted | Rejected | Tokens | PromptLogprobs | Finished


@dataclass(slots=True, eq=False)
class RequestHandle:
    """The owner's side of one request. `cancel()` is safe from any thread."""

    request_id: int
    sink: Callable[[Event], None]
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)  # when the owner submitted it

    def cancel(self) -> None:
        self.cancelled.set()
