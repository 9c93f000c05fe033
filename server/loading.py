"""Model loading and chat rendering, behind one function each.

Both prefer the engine's own implementations (`poot.engine.models.load_model` and
`poot.engine.models.chat.render_chat`) and fall back to a local one while those are absent.
"""

from __future__ import annotations

import os

from poot.engine import InvalidRequest
from poot.engine.models.base import ModelLoadError


def parse_synthetic(spec: str | None) -> int | None:
    """The seed of a "synthetic" or "synthetic:SEED" spec, None for any other spec."""
    if spec is None or not (spec == "synthetic" or spec.startswith("synthetic:")):
        return None
    _, _, seed = spec.partition(":")
    if not seed:
        return 0
    try:
        return int(seed)
    except ValueError:
        raise ModelLoadError(f"bad synthetic model spec {spec!r}: the seed must be an integer") from None


def precheck(spec: str | None) -> None:
    """Cheap checks before the server listens: a malformed spec or a missing file."""
    if parse_synthetic(spec) is not None or spec is None:
        return
    if not os.path.exists(spec):
        raise ModelLoadError(f"no such model file or folder: {spec}")


def load_model(spec: str | None):
    """Loads a model: "synthetic", "synthetic:SEED", a path, or None (the SmolLM2 default)."""
    try:
        from poot.engine.models import load_model as engine_load
    except ImportError:
        engine_load = None
    if engine_load is not None:
        return engine_load(spec)
    seed = parse_synthetic(spec)
    if seed is not None:
        from poot.engine.models.synthetic import synthetic_llama

        return synthetic_llama(seed)
    what = "the default model" if spec is None else repr(spec)
    raise ModelLoadError(f"this build cannot load {what} yet (poot.engine.models.load_model is missing); "
                         "use --model synthetic")


def render_chat(model, messages: list[dict]) -> str:
    """Renders chat messages into a prompt with the model's template; InvalidRequest if it cannot."""
    try:
        from poot.engine.models.chat import render_chat as engine_render
    except ImportError:
        engine_render = None
    try:
        if engine_render is not None:
            return engine_render(model, messages)
        return _render_local(model, messages)
    except InvalidRequest:
        raise
    except Exception as e:  # a template that refuses the conversation (raise_exception) or breaks
        raise InvalidRequest(f"the chat template cannot render these messages: {e}", "messages") from e


_ENV = None


def _render_local(model, messages: list[dict]) -> str:
    global _ENV
    template = getattr(model, "chat_template", None)
    if not template:
        raise InvalidRequest("this model has no chat template; use /v1/completions", "messages")
    if _ENV is None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise ValueError(message)

        _ENV = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        _ENV.globals["raise_exception"] = raise_exception
    special = dict(getattr(model, "special_tokens", {}) or {})
    return _ENV.from_string(template).render(messages=messages, add_generation_prompt=True, **special)
