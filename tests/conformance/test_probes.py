"""What keeps a long request going, found with requests of OpenAI's fields unless the server
takes an extension: the probes against servers that take ignore_eos, refuse it, or take nothing
that helps."""

from __future__ import annotations

import json

import httpx
import pytest

from poot.conformance.client import Client
from poot.conformance.facts import Facts
from poot.conformance.scenarios import BIASED_TOKEN, Probes, refusal_names

OPENAI_FIELDS = {"model", "prompt", "max_tokens", "temperature", "logit_bias", "stream", "seed", "stop"}


def server(takes_ignore_eos: bool, bias_holds: bool, seen: list[dict]) -> Client:
    """A fake completions server: refuses fields outside OpenAI's with 422 unless it takes
    ignore_eos; a logit bias holds a request to max_tokens only where `bias_holds`."""

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "m"}]})
        body = json.loads(request.content)
        seen.append(body)
        unknown = set(body) - OPENAI_FIELDS - ({"ignore_eos"} if takes_ignore_eos else set())
        if unknown:
            return httpx.Response(422, json={"detail": f"Unexpected fields in the request: {unknown}"})
        n = body["max_tokens"] if ("logit_bias" in body and bias_holds) or body.get("ignore_eos") else 3
        return httpx.Response(200, json={"choices": [{"text": "x" * n, "finish_reason": "length" if n > 3 else "stop"}],
                                         "usage": {"prompt_tokens": 2, "completion_tokens": n}})

    client = Client("http://server")
    client.http = httpx.Client(base_url="http://server", transport=httpx.MockTransport(handle))
    client.facts = Facts()
    return client


@pytest.mark.parametrize("takes, holds, extra", [
    (True, True, {"ignore_eos": True}),
    (False, True, {"logit_bias": {str(BIASED_TOKEN): 100}}),
    (False, False, {}),
])
def test_long_requests_carry_an_extension_only_where_the_server_takes_it(takes, holds, extra):
    seen: list[dict] = []
    client = server(takes, holds, seen)
    probes = Probes(client)
    assert probes.long_params(40) == {"max_tokens": 40, "temperature": 0, **extra}
    assert probes.ignore_eos() == ({"ignore_eos": True} if takes else {})
    probes.long_params(40)
    assert sum("ignore_eos" in body for body in seen) == 1  # probed once, never sent after a refusal
    report = client.facts.report()
    assert report["ignore_eos"]["value"] is takes
    assert report["long_requests"]["value"].startswith("ignore_eos" if takes else "logit_bias" if holds else "nothing")


def test_a_refusal_names_the_field_in_a_4xx_other_than_key_path_or_rate():
    assert refusal_names(422, "Unexpected fields in the request: {'ignore_eos'}", "ignore_eos")
    assert refusal_names(400, '{"error": {"param": "stop_token_ids"}}', "stop_token_ids")
    assert not refusal_names(400, '{"error": {"message": "max_tokens too large"}}', "ignore_eos")
    assert not refusal_names(401, "ignore_eos needs a key", "ignore_eos")
    assert not refusal_names(500, "ignore_eos crashed", "ignore_eos")
    assert not refusal_names(200, "ignore_eos", "ignore_eos")
