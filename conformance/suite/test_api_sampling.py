"""api/logprobs, api/echo, api/n, api/penalties: what OpenAI clients send beyond one plain choice.

A server that refuses the parameter a clause is about with a 400 (or another 4xx naming it) is
not supported for that clause (an honest refusal); one that accepts it and answers wrongly
fails. Every field sent here is OpenAI's; the extensions are test_extensions.py's.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from poot.conformance.client import Client
from poot.conformance.outcomes import NotSupported
from poot.conformance.scenarios import Probes, refusal_names

clause = pytest.mark.clause

PROMPT = "The quick brown fox jumps over the lazy dog. Then"
CHAT = [{"role": "user", "content": "Name three colours."}]
BIASED = (65, 66)  # token ids present in every vocabulary the suite meets (byte-level ones included)


def post(client: Client, path: str, feature: str, body: dict[str, Any]) -> dict:
    """The 200 answer to `body`; a 400, or another 4xx naming `feature`, makes the clause not
    supported for it."""
    r = client.post(path, {"model": client.model, **body})
    if r.status_code == 400 or refusal_names(r.status_code, r.text, feature.split()[0]):
        raise NotSupported(f"the server refuses {feature} with {r.status_code}: {r.text[:200]}")
    assert r.status_code == 200, f"POST {path} with {feature} answered {r.status_code}: {r.text[:300]}"
    return r.json()


def complete(client: Client, feature: str, **body: Any) -> dict:
    return post(client, "/v1/completions", feature, {"prompt": PROMPT, "temperature": 0, **body})


def chat(client: Client, feature: str, **body: Any) -> dict:
    return post(client, "/v1/chat/completions", feature, {"messages": CHAT, "temperature": 0, **body})


def choice_logprobs(body: dict, index: int = 0) -> dict:
    lp = (body.get("choices") or [{}])[index].get("logprobs")
    assert isinstance(lp, dict), f"choice {index} has no logprobs object: {lp!r}"
    return lp


def check_completion_lists(lp: dict, count: int, k: int) -> None:
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    for key in keys:
        assert isinstance(lp.get(key), list), f"logprobs.{key} is {lp.get(key)!r}, expected a list"
    lengths = {key: len(lp[key]) for key in keys}
    assert set(lengths.values()) == {count}, f"logprobs lists have lengths {lengths}, expected {count} each"
    for i, (token, p, top) in enumerate(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True)):
        assert isinstance(token, str), f"tokens[{i}] is {token!r}"
        if p is None:
            continue
        assert isinstance(p, int | float) and p <= 1e-6, f"token_logprobs[{i}] is {p!r}, expected a number <= 0"
        assert isinstance(top, dict) and len(top) <= k + 1, f"top_logprobs[{i}] is {top!r}, expected <= {k + 1} tokens"
    offsets = lp["text_offset"]
    assert all(isinstance(o, int) for o in offsets), f"text_offset holds non-integers: {offsets!r}"
    assert offsets == sorted(offsets), f"text_offset is not non-decreasing: {offsets!r}"


def stream(client: Client, feature: str, path: str, body: dict) -> list[dict]:
    s = client.stream(path=path, body={"model": client.model, "stream": True, **body})
    if s.status == 400 or refusal_names(s.status, s.body, feature.split()[0]):
        raise NotSupported(f"the server refuses streamed {feature} with {s.status}: {s.body[:200]}")
    assert s.status == 200, f"streamed {feature} answered {s.status}: {s.body[:300]}"
    assert s.done, "the stream did not end with data: [DONE]"
    return s.chunks


@clause("api/logprobs/1")
def test_completion_logprobs_shape(client: Client):
    body = complete(client, "logprobs", max_tokens=8, logprobs=3)
    lp = choice_logprobs(body)
    check_completion_lists(lp, body["usage"]["completion_tokens"], 3)
    assert not lp["text_offset"] or lp["text_offset"][0] == 0, f"text_offset starts at {lp['text_offset'][0]}"
    assert all(p is not None for p in lp["token_logprobs"]), "a completion token has a null logprob"


@clause("api/logprobs/2")
def test_greedy_logprob_is_the_largest_alternative(client: Client):
    lp = choice_logprobs(complete(client, "logprobs", max_tokens=8, logprobs=5))
    for i, (token, p, top) in enumerate(zip(lp.get("tokens", []), lp.get("token_logprobs", []),
                                            lp.get("top_logprobs", []), strict=True)):
        assert isinstance(top, dict) and top, f"top_logprobs[{i}] is {top!r}"
        assert token in top, f"greedy token {token!r} is not among its alternatives {top!r}"
        assert math.isclose(p, max(top.values()), abs_tol=1e-4), \
            f"token {i} ({token!r}) has logprob {p}, but its best alternative has {max(top.values())}"


@clause("api/logprobs/3")
def test_chat_logprobs_shape(client: Client):
    body = chat(client, "logprobs", max_tokens=8, logprobs=True, top_logprobs=4)
    content = choice_logprobs(body).get("content")
    assert isinstance(content, list), f"logprobs.content is {content!r}, expected a list"
    assert len(content) == body["usage"]["completion_tokens"], \
        f"{len(content)} logprobs entries for {body['usage']['completion_tokens']} completion tokens"

    def check(entry: dict, where: str) -> None:
        assert isinstance(entry.get("token"), str), f"{where}.token is {entry.get('token')!r}"
        assert isinstance(entry.get("logprob"), int | float) and entry["logprob"] <= 1e-6, \
            f"{where}.logprob is {entry.get('logprob')!r}"
        b = entry.get("bytes")
        assert isinstance(b, list) and all(isinstance(x, int) and 0 <= x < 256 for x in b), f"{where}.bytes is {b!r}"

    for i, entry in enumerate(content):
        check(entry, f"content[{i}]")
        top = entry.get("top_logprobs")
        assert isinstance(top, list) and len(top) == 4, f"content[{i}].top_logprobs is {top!r}, expected 4 entries"
        for j, alt in enumerate(top):
            check(alt, f"content[{i}].top_logprobs[{j}]")
        ps = [alt["logprob"] for alt in top]
        assert ps == sorted(ps, reverse=True), f"content[{i}].top_logprobs are not most likely first: {ps}"
        assert math.isclose(entry["logprob"], ps[0], abs_tol=1e-4), \
            f"greedy token {entry['token']!r} has logprob {entry['logprob']}, its best alternative {ps[0]}"


@clause("api/logprobs/4")
def test_chat_logprobs_stream_with_their_tokens(client: Client):
    whole = choice_logprobs(chat(client, "logprobs", max_tokens=8, logprobs=True, top_logprobs=2)).get("content")
    chunks = stream(client, "logprobs", "/v1/chat/completions",
                    {"messages": CHAT, "temperature": 0, "max_tokens": 8, "logprobs": True, "top_logprobs": 2})
    streamed = [e for ch in chunks for c in ch.get("choices") or [] if isinstance(c.get("logprobs"), dict)
                for e in c["logprobs"].get("content") or []]
    assert [e.get("token") for e in streamed] == [e.get("token") for e in whole or []], \
        f"streamed logprobs tokens {[e.get('token') for e in streamed]} differ from the whole answer's"


@clause("api/echo/1")
def test_echo_puts_the_prompt_first(client: Client):
    plain = complete(client, "echo", max_tokens=6)["choices"][0]["text"]
    echoed = complete(client, "echo", max_tokens=6, echo=True)["choices"][0]["text"]
    assert echoed == PROMPT + plain, f"echo answered {echoed!r}, expected the prompt then {plain!r}"
    body = complete(client, "echo with logprobs", max_tokens=6, echo=True, logprobs=1)
    lp = choice_logprobs(body)
    use = body["usage"]
    check_completion_lists(lp, use["prompt_tokens"] + use["completion_tokens"], 1)
    assert lp["token_logprobs"][0] is None, f"the first prompt token's logprob is {lp['token_logprobs'][0]!r}, expected null"


@clause("api/echo/2")
def test_echo_with_no_tokens_scores_the_prompt(client: Client):
    body = complete(client, "echo with max_tokens 0", max_tokens=0, echo=True, logprobs=1)
    choice, use = body["choices"][0], body["usage"]
    assert choice.get("text") == PROMPT, f"text is {choice.get('text')!r}, expected the prompt alone"
    assert use.get("completion_tokens") == 0, f"usage.completion_tokens is {use.get('completion_tokens')!r}"
    lp = choice_logprobs(body)
    ps = lp.get("token_logprobs") or []
    assert len(ps) == use["prompt_tokens"], f"{len(ps)} logprobs for {use['prompt_tokens']} prompt tokens"
    assert ps[0] is None, f"the first prompt token's logprob is {ps[0]!r}, expected null"
    assert all(isinstance(p, int | float) and p <= 1e-6 for p in ps[1:]), f"prompt logprobs {ps[1:]!r}"


# What users send n with: sampling, seeded so that the answer can be compared. (Greedy choices
# are one choice repeated, and some servers refuse n with greedy sampling altogether.)
N_SAMPLED = {"temperature": 1.0, "seed": 4321, "max_tokens": 12}


def texts_by_index(choices: list[dict]) -> dict:
    return {c.get("index"): c.get("text") for c in choices}


@clause("api/n/1")
def test_n_answers_n_choices(client: Client):
    choices = complete(client, "n", n=4, **N_SAMPLED).get("choices") or []
    assert sorted(c.get("index") for c in choices) == [0, 1, 2, 3], \
        f"choice indices {[c.get('index') for c in choices]}, expected [0, 1, 2, 3]"
    for c in choices:
        assert isinstance(c.get("text"), str), f"choice {c.get('index')} text is {c.get('text')!r}"
        assert c.get("finish_reason") in ("stop", "length"), \
            f"choice {c.get('index')} finish_reason {c.get('finish_reason')!r}"
    first = texts_by_index(choices)
    again = texts_by_index(complete(client, "n", n=4, **N_SAMPLED).get("choices") or [])
    assert again == first, f"the same seeded request with n 4 answered {again!r}, then {first!r}"
    assert len(set(first.values())) > 1, \
        f"4 sampled choices are one text repeated ({first[0]!r}): the choices are not separate draws"


@clause("api/n/2")
def test_n_choices_stream_under_their_own_index(client: Client):
    whole = complete(client, "n", n=2, **N_SAMPLED)["choices"]
    chunks = stream(client, "n", "/v1/completions", {"prompt": PROMPT, "n": 2, **N_SAMPLED})
    texts: dict[int, str] = {}
    ends: dict[int, int] = {}
    for ch in chunks:
        for c in ch.get("choices") or []:
            i = c.get("index")
            texts[i] = texts.get(i, "") + (c.get("text") or "")
            if c.get("finish_reason"):
                ends[i] = ends.get(i, 0) + 1
    assert sorted(texts) == [0, 1], f"streamed choice indices {sorted(texts)}, expected [0, 1]"
    assert ends == {0: 1, 1: 1}, f"finish_reason chunks per index: {ends}"
    for c in whole:
        assert texts[c["index"]] == c["text"], \
            f"seeded choice {c['index']} streamed {texts[c['index']]!r}, answered whole {c['text']!r}"


@clause("api/n/3")
def test_n_choices_prefill_their_prompt_once(client: Client):
    client.need_metrics("prefix_cache_hit_tokens_total")
    before = client.metric("prefix_cache_hit_tokens_total")
    prompt = " ".join(f"w{i}" for i in range(60)) + f" {before}"  # new to the cache
    body = post(client, "/v1/completions", "n", {"prompt": prompt, "n": 4, **N_SAMPLED, "max_tokens": 2})
    hits = client.metric("prefix_cache_hit_tokens_total") - before
    # Each choice but the first may miss the prompt's last, partial block (at most 64 tokens,
    # or one block where blocks are larger).
    tail = max(64, (client.facts.get("block_size") if client.facts else None) or 0)
    need = 3 * (body["usage"]["prompt_tokens"] - tail)
    assert hits >= need, f"4 choices of a {body['usage']['prompt_tokens']}-token prompt hit {hits} cached tokens, " \
                         f"expected at least {need}: the prompt was prefilled more than once"


@clause("api/penalties/1")
def test_frequency_penalty_lowers_repeated_tokens(client: Client):
    bias = {str(t): 100 for t in BIASED}
    plain = complete(client, "logit_bias", max_tokens=16, logit_bias=bias)["choices"][0]["text"]
    penalized = complete(client, "frequency_penalty", max_tokens=16, logit_bias=bias,
                         frequency_penalty=2.0)["choices"][0]["text"]
    assert penalized != plain, f"frequency_penalty 2 left the forced repetition {plain!r} unchanged"


@clause("api/penalties/2")
def test_logit_bias_moves_the_named_tokens(client: Client, probes: Probes):
    texts = []
    for token in BIASED:
        # ignore_eos only where the server takes it: +100 on a token outweighs end-of-sequence anyway
        body = complete(client, "logit_bias", max_tokens=8, logit_bias={str(token): 100}, **probes.ignore_eos())
        text = body["choices"][0]["text"]
        n = body["usage"]["completion_tokens"]
        assert n == 8 and text and len(text) % 8 == 0 and text == text[: len(text) // 8] * 8, \
            f"with +100 on token {token} the completion is {text!r} ({n} tokens), not one token repeated 8 times"
        texts.append(text)
    assert texts[0] != texts[1], f"+100 on tokens {BIASED[0]} and {BIASED[1]} both gave {texts[0]!r}"
