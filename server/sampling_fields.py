"""The OpenAI request fields beyond the basic sampling ones: logprobs, echo, n, best_of,
penalties, logit_bias, and the vLLM extensions repetition_penalty, min_tokens and
stop_token_ids. Parsing only: ranges are checked by SamplingParams.validate, vocabulary
bounds by the engine when it takes the job, each as a 400 naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass

from poot.engine.params import InvalidRequest

MAX_CHOICES = 16
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API's limit
MAX_CHAT_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300



@dataclass(slots=True, frozen=True)
class Choices:
    """What shapes the answer beyond one plain choice."""

    n: int = 1
    best_of: int = 1
    echo: bool = False
    logprobs: int | None = None  # alternatives per token when logprobs are asked for

    @property
    def plain(self) -> bool:
        return self.n == 1 and self.best_of == 1 and not self.echo and self.logprobs is None

    @property
    def count(self) -> int:
        """Sequences to run: best_of when it asks for more than n."""
        return max(self.n, self.best_of)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(body: dict, name: str, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise InvalidRequest(f"{name} must be a number", name)
    return v


def _count(body: dict, name: str, default: int, high: int) -> int:
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v) or not 1 <= v <= high:
        raise InvalidRequest(f"{name} must be an integer in [1, {high}]; got {v!r}", name)
    return v


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    v = body.get("logit_bias")
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise InvalidRequest("logit_bias must be an object mapping token ids to biases", "logit_bias")
    if len(v) > MAX_LOGIT_BIAS:
        raise InvalidRequest(f"logit_bias holds at most {MAX_LOGIT_BIAS} tokens", "logit_bias")
    out = []
    for key, bias in v.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise InvalidRequest(f"logit_bias key {key!r} is not a token id", "logit_bias") from None
        if isinstance(bias, bool) or not isinstance(bias, int | float):
            raise InvalidRequest(f"logit_bias[{key!r}] must be a number", "logit_bias")
        out.append((token, float(bias)))
    return tuple(out)


def _token_ids(body: dict, name: str) -> tuple[int, ...]:
    v = body.get(name)
    if v is None:
        return ()
    if not isinstance(v, list) or not all(_is_int(t) for t in v):
        raise InvalidRequest(f"{name} must be a list of token ids", name)
    return tuple(v)


def parse(body: dict, *, chat: bool, stream: bool, max_tokens) -> tuple[dict, Choices]:
    """(SamplingParams keyword arguments, the answer's shape) from a request body."""
    n = _count(body, "n", 1, MAX_CHOICES)
    best_of = 1
    if chat:
        if body.get("best_of") not in (None, 1):
            raise InvalidRequest("best_of is a completions parameter; chat answers n choices", "best_of")
        logprobs = body.get("logprobs")
        if logprobs is not None and not isinstance(logprobs, bool):
            raise InvalidRequest("logprobs must be a boolean in chat completions", "logprobs")
        top = body.get("top_logprobs")
        if top is not None and (not _is_int(top) or not 0 <= top <= MAX_CHAT_TOP_LOGPROBS):
            raise InvalidRequest(f"top_logprobs must be an integer in [0, {MAX_CHAT_TOP_LOGPROBS}]; got {top!r}",
                             "top_logprobs")
        if top and not logprobs:
            raise InvalidRequest("top_logprobs needs logprobs set to true", "top_logprobs")
        k = (top or 0) if logprobs else None
        echo = False
    else:
        best_of = _count(body, "best_of", n, MAX_CHOICES)
        if best_of < n:
            raise InvalidRequest(f"best_of ({best_of}) must be at least n ({n})", "best_of")
        if best_of > n and stream:
            raise InvalidRequest("best_of above n cannot be streamed: the best are known only at the end", "best_of")
        k = body.get("logprobs")
        if k is not None and (not _is_int(k) or not 0 <= k <= MAX_COMPLETION_LOGPROBS):
            raise InvalidRequest(f"logprobs must be an integer in [0, {MAX_COMPLETION_LOGPROBS}]; got {k!r}", "logprobs")
        echo = body.get("echo")
        if echo is not None and not isinstance(echo, bool):
            raise InvalidRequest("echo must be a boolean", "echo")
        echo = bool(echo)
        if body.get("suffix"):
            raise InvalidRequest("suffix is not supported: the served model has no fill-in-the-middle tokens", "suffix")
    min_tokens = body.get("min_tokens", 0)
    if min_tokens is None:
        min_tokens = 0
    prompt_logprobs = None
    if echo and (k is not None or max_tokens == 0):
        prompt_logprobs = k or 0  # max_tokens 0 with echo scores the prompt alone
    params = {
        "presence_penalty": _number(body, "presence_penalty", 0.0),
        "frequency_penalty": _number(body, "frequency_penalty", 0.0),
        "repetition_penalty": _number(body, "repetition_penalty", 1.0),
        "logit_bias": _logit_bias(body),
        "min_tokens": min_tokens,
        "stop_token_ids": _token_ids(body, "stop_token_ids"),
        "logprobs": k,
        "prompt_logprobs": prompt_logprobs,
    }
    return params, Choices(n, best_of, echo, k)
