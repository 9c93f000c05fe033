"""What a client asks for: the sampling and stopping rules of one request."""

from __future__ import annotations

from dataclasses import dataclass, field


class InvalidRequest(ValueError):
    """A request that can never be served as asked. The server turns it into a 4xx."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(slots=True, frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self) -> None:
        """Checks what can be checked without the plan; the plan's limits are checked at open."""
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise InvalidRequest("max_tokens must be an integer", "max_tokens")
        if self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be at least 1; got {self.max_tokens}", "max_tokens")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InvalidRequest(f"{name} must be a number", name)
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequest(f"temperature must be between 0 and 100; got {self.temperature}", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1]; got {self.top_p}", "top_p")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequest(f"top_k must be a non-negative integer; got {self.top_k!r}", "top_k")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise InvalidRequest("seed must be an integer", "seed")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequest("stop must be a non-empty string or a list of them", "stop")
        if len(self.stop) > 16:
            raise InvalidRequest("at most 16 stop strings are allowed", "stop")
