"""Model loading and chat rendering, each the engine's own behind one function.

`load_model` is `poot.engine.models.load_model`; `render_chat` is
`poot.engine.models.chat.render_chat` (a sandboxed jinja2 environment that turns anything
wrong with the messages or the template into InvalidRequest, param "messages"). `precheck`
catches a malformed spec or a missing file before the server listens.
"""

from __future__ import annotations

import os

from poot.engine import InvalidRequest
from poot.engine.models import load_model as _engine_load
from poot.engine.models.base import ModelLoadError
from poot.engine.models.chat import render_chat as _engine_render
from poot.engine.models.chat import renders_tools as _renders_tools


def precheck(spec: str | None) -> None:
    """Cheap checks before the server listens: a malformed synthetic seed or a missing file.
    Other names of the synthetic family ("synthetic-...") are left to the engine's loader."""
    if spec is None or spec in ("default", "synthetic") or spec.startswith("synthetic-"):
        return
    if spec.startswith("synthetic:"):
        seed = spec.partition(":")[2]
        try:
            int(seed)
        except ValueError:
            raise ModelLoadError(f"bad synthetic model spec {spec!r}: the seed must be an integer") from None
        return
    if not os.path.exists(os.path.expanduser(spec)):
        raise ModelLoadError(f"no such model file or folder: {spec}")


def load_model(spec: str | None, progress=None):
    """Loads a model: "synthetic", "synthetic:SEED", a path, or None (the SmolLM2 default);
    `progress` (engine/progress.py) hears what it is doing."""
    return _engine_load(spec, progress=progress)


def render_chat(model, messages: list[dict], tools: list[dict] | None = None) -> str:
    """Renders chat messages into a prompt with the model's template (given `tools`, where it
    renders them); InvalidRequest if it cannot."""
    try:
        return _engine_render(model, messages, tools=tools)
    except InvalidRequest:
        raise
    except Exception as e:  # the engine's renderer promises InvalidRequest; never let a 500 through
        raise InvalidRequest(f"the chat template cannot render these messages: {e}", "messages") from e


def template_renders_tools(model) -> bool:
    """The model's chat template renders the tools it is given (else server/tools.py offers them)."""
    return _renders_tools(model)
