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
    # Logits processors (engine/logits_processors.py), applied alike to greedy and sampled rows.
    presence_penalty: float = 0.0  # subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # divides positive, multiplies negative logits of prompt and output tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    min_tokens: int = 0  # end-of-sequence and stop_token_ids are masked until this many outputs
    stop_token_ids: tuple[int, ...] = ()  # more tokens that end the request (reason stop)
    # Log-probabilities (engine/logprobs.py): None asks for none; k >= 0 asks for the picked
    # token's and the k most likely alternatives'.
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for each prompt token after the first (echo)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self) -> None:
        """Checks what can be checked without the plan; the plan's limits are checked at open."""
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise InvalidRequest("max_tokens must be an integer", "max_tokens")
        if self.max_tokens < (0 if self.prompt_logprobs is not None else 1):  # 0: score the prompt only
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
        for name, low, high in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0),
                                ("repetition_penalty", 0.0, 10.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InvalidRequest(f"{name} must be a number", name)
            if not low <= value <= high or (name == "repetition_penalty" and value == 0.0):
                raise InvalidRequest(f"{name} must be in {'(' if low == 0 else '['}{low:g}, {high:g}]; got {value}", name)
        for item in self.logit_bias:
            if (not isinstance(item, tuple) or len(item) != 2 or not _is_int(item[0]) or item[0] < 0
                    or isinstance(item[1], bool) or not isinstance(item[1], int | float) or not -100 <= item[1] <= 100):
                raise InvalidRequest("logit_bias maps token ids to numbers in [-100, 100]", "logit_bias")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequest(f"min_tokens must be an integer in [0, max_tokens]; got {self.min_tokens!r}",
                                 "min_tokens")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise InvalidRequest("stop_token_ids must be a list of token ids", "stop_token_ids")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_TOP_LOGPROBS):
                raise InvalidRequest(f"{name} must be an integer in [0, {MAX_TOP_LOGPROBS}]; got {value!r}", name)


MAX_TOP_LOGPROBS = 20


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
