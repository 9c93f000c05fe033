"""The server's kind, told from one look at its endpoints."""

import httpx
import pytest

from poot.conformance.kind import Look, first_model

SERVERS = {
    "poot": {"/health": (200, {"status": "ok", "plan": {"rows": 4}}), "/metrics": (200, "engine_steps_total 3\n")},
    "llamacpp": {"/health": (200, {"status": "ok"}), "/props": (200, {"total_slots": 4})},
    "vllm": {"/health": (200, ""), "/metrics": (200, 'vllm:num_requests_running{engine="0"} 0\n')},
    "vllm-models": {"/v1/models": (200, {"data": [{"id": "m", "owned_by": "vllm"}]})},
    "openai": {"/v1/models": (200, {"data": [{"id": "gpt", "owned_by": "me"}]})},
}


def client(routes: dict) -> httpx.Client:
    def answer(request: httpx.Request) -> httpx.Response:
        status, body = routes.get(request.url.path, (404, {"error": "no"}))
        return httpx.Response(status, text=body) if isinstance(body, str) else httpx.Response(status, json=body)

    return httpx.Client(base_url="http://server", transport=httpx.MockTransport(answer))


@pytest.mark.parametrize("server", SERVERS)
def test_each_kind_is_told_by_its_own_evidence(server):
    kind, evidence = Look.take(client(SERVERS[server])).kind()
    assert kind == server.split("-")[0]
    assert evidence


def test_broken_metrics_text_leaves_the_kind_to_the_other_endpoints():
    routes = {"/metrics": (200, "not prometheus at all"), "/props": (200, {"total_slots": 2})}
    assert Look.take(client(routes)).kind()[0] == "llamacpp"


def test_the_first_model_is_the_first_listed_or_none():
    assert first_model(client(SERVERS["openai"])) == "gpt"
    assert first_model(client({})) is None
