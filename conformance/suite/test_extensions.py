"""Extensions of the OpenAI API that servers share (vLLM's sampling parameters, which llama.cpp's
server and poot-serve take too): ignore_eos and stop_token_ids.

These clauses are the `extensions` profile: a server that refuses the field with a 4xx naming
it does not offer the extension, and the clause is not supported there; one that takes the
field and does not do what it says fails. No other clause sends an extension unless a probe
showed the server takes it.
"""

from __future__ import annotations

from typing import Any

import pytest

from poot.conformance.client import Client
from poot.conformance.outcomes import NotSupported
from poot.conformance.scenarios import BIASED_TOKEN, Probes, refusal_names

clause = pytest.mark.clause


def with_extension(client: Client, name: str, prompt: str, **body: Any) -> dict:
    """The 200 answer to a completion carrying extension `name`; not supported where the
    server refuses it by name."""
    r = client.post("/v1/completions", client.body(prompt, **body))
    if refusal_names(r.status_code, r.text, name):
        raise NotSupported(f"the server refuses {name} (an extension) with {r.status_code}: {r.text[:200]}")
    assert r.status_code == 200, f"a completion with {name} answered {r.status_code}: {r.text[:300]}"
    return r.json()


@clause("api/ignore-eos/1")
def test_ignore_eos_goes_on_past_end_of_sequence(client: Client, probes: Probes):
    prompt, params = probes.eos_case()  # ends by itself (end-of-sequence) before 48 tokens
    plain = client.complete(prompt, max_tokens=48, **params)
    ended = plain["usage"]["completion_tokens"]
    max_tokens = ended + 24
    answer = with_extension(client, "ignore_eos", prompt, max_tokens=max_tokens, ignore_eos=True, **params)
    choice, got = answer["choices"][0], answer["usage"]["completion_tokens"]
    assert choice["finish_reason"] == "length" and got == max_tokens, \
        (f"with ignore_eos, a prompt that ends by itself after {ended} tokens ended {choice['finish_reason']!r} "
         f"after {got} of max_tokens {max_tokens}; ignore_eos must go on past end-of-sequence to max_tokens")


@clause("api/penalties/3")
def test_stop_token_ids_end_the_completion(client: Client):
    body = with_extension(client, "stop_token_ids", "The quick brown fox jumps over the lazy dog. Then",
                          max_tokens=8, temperature=0, logit_bias={str(BIASED_TOKEN): 100},
                          stop_token_ids=[BIASED_TOKEN])
    choice = body["choices"][0]
    assert choice.get("finish_reason") == "stop", f"finish_reason is {choice.get('finish_reason')!r}, expected 'stop'"
    assert body["usage"]["completion_tokens"] <= 1, f"{body['usage']['completion_tokens']} tokens after the stop token"
