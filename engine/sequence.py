"""One request's state as it moves through the loop."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from .events import RequestHandle
from .params import SamplingParams
from .random_stream import RandomStream
from .stops import StopChecker


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_arrivals = itertools.count()


@dataclass(slots=True, eq=False)
class Sequence:
    handle: RequestHandle
    prompt: list[int]
    params: SamplingParams
    stops: StopChecker
    stream: RandomStream  # the uniforms its sampled tokens draw, one per output position
    arrival: int = field(default_factory=lambda: next(_arrivals))
    status: Status = Status.WAITING
    row: int = -1
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is written (prompt first, then outputs)
    num_cached: int = 0  # prompt tokens served from the prefix cache
    output: list[int] = field(default_factory=list)
    group: Any = None  # choices.ChoiceGroup of a request with n > 1 choices
    prompt_scores: list = field(default_factory=list)  # echo: the prompt's TokenLogprobs so far
    grammar: Any = None  # grammar.Matcher: what its output must match (response_format), or None
    opened_at: float | None = None  # time.perf_counter() when it took a row
    first_token_at: float | None = None  # ... and when its first output token was committed

    @property
    def request_id(self) -> int:
        return self.handle.request_id

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def prefilling(self) -> bool:
        return self.num_computed < len(self.prompt)

    @property
    def num_reserved_tokens(self) -> int:
        # KV for the prompt and every output but the last, plus one spare position.
        return len(self.prompt) + self.params.max_tokens
