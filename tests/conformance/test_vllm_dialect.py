"""The vLLM dialect, read off a /metrics scrape of the real server: vLLM 0.32.0's CPU build on
SmolLM2 (--max-num-seqs 8, VLLM_CPU_KVCACHE_SPACE=2), taken while one request decoded (a 600-token
prompt, 300 tokens out) after a dozen earlier ones; only the vllm:* families are kept."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from poot.conformance.facts import Facts
from poot.conformance.metrics import Snapshot
from poot.conformance.prometheus import parse

SCRAPE = (Path(__file__).parent / "fixtures" / "vllm-0.32.0-cpu-decoding.prom").read_text()
MODELS = {"object": "list", "data": [{"id": "SmolLM2-135M-Instruct", "object": "model", "owned_by": "vllm",
                                      "max_model_len": 4096}]}
COMMAND = ("python -m vllm.entrypoints.openai.api_server --model m --port {port} --max-model-len 4096 "
           "--max-num-seqs 8 --max-num-batched-tokens 512")


def serve(routes: dict[str, tuple[int, object]]) -> httpx.Client:
    def handle(request: httpx.Request) -> httpx.Response:
        status, body = routes.get(request.url.path, (404, {"detail": "Not Found"}))
        return httpx.Response(status, text=body) if isinstance(body, str) else httpx.Response(status, json=body)

    return httpx.Client(base_url="http://vllm", transport=httpx.MockTransport(handle))


@pytest.fixture
def snap() -> Snapshot:
    return Snapshot(parse(SCRAPE), "vllm")


def test_the_engine_iteration_histogram_counts_steps(snap):
    assert snap.has("engine_steps_total")
    assert snap.get("engine_steps_total") == 181  # vllm:iteration_tokens_total_count


def test_kv_blocks_come_from_the_usage_fraction_and_the_cache_config(snap):
    # num_gpu_blocks="364", one of them the null block; 7 of the 363 usable are not free.
    assert snap.get("kv_blocks_total") == 363
    assert snap.get("kv_blocks_in_use") == 7
    # Allocated as tokens come: what the running request holds is all that is set aside for it.
    assert snap.get("kv_blocks_reserved") == snap.get("kv_blocks_in_use")
    assert not snap.has("kv_blocks_cached")
    assert snap.get("kv_blocks_in_use", reason="x") is None  # derived names take no labels


def test_gauges_counters_and_prefix_hits_map_to_vllm_names(snap):
    assert snap.get("engine_requests_running") == 1 and snap.get("engine_requests_waiting") == 0
    assert snap.get("requests_finished_total", reason="length") == 11
    # finished_reason="abort" does not count a client's hang-up: no cancelled counter is claimed
    assert snap.get("requests_finished_total", reason="cancelled") is None
    assert snap.has("prefix_cache_hit_tokens_total") and snap.get("prefix_cache_hit_tokens_total") >= 0
    assert not snap.has("prefix_registered_tokens")  # vLLM counts hits, not registrations


def test_a_vllm_server_is_detected_and_its_facts_read():
    http = serve({"/metrics": (200, SCRAPE), "/v1/models": (200, MODELS), "/health": (200, "")})
    facts = Facts.discover(http, command=COMMAND)
    assert facts.dialect == "vllm"
    assert facts.need("kind", "rows", "positions", "block_size", "token_budget", "reservation") == {
        "kind": "vllm", "rows": 8, "positions": 4096, "block_size": 128, "token_budget": 512,
        "reservation": "on_demand"}
    facts.learn_metrics(Snapshot(parse(SCRAPE), facts.dialect))
    for name in ("steps", "running", "waiting", "kv_blocks", "prefix_hits"):
        assert facts.has(name), name
    for name in ("prefix_metrics", "step_tokens", "cancelled_counter"):
        assert not facts.has(name), name


def test_vllm_is_told_by_its_models_listing_where_metrics_are_off():
    http = serve({"/v1/models": (200, MODELS)})
    facts = Facts.discover(http)
    assert facts.known["kind"].value == "vllm" and "owned_by" in facts.known["kind"].source
    # No command, so neither rows nor a step budget: named when a clause needs them.
    assert "token_budget" not in facts.known and "rows" not in facts.known
