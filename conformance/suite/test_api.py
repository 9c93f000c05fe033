"""api/*: the OpenAI-compatible surface, fixed cases (the property tests add random ones)."""

from __future__ import annotations

import json
import secrets

import httpx
import pytest

from poot.conformance.client import Client
from poot.conformance.outcomes import NotSupported
from poot.conformance.scenarios import refusal_names

clause = pytest.mark.clause


def error_object(r: httpx.Response) -> dict:
    try:
        body = r.json()
    except ValueError:
        raise AssertionError(f"error answer {r.status_code} is not JSON: {r.text[:200]!r}") from None
    err = body.get("error") if isinstance(body, dict) else None
    assert isinstance(err, dict), f"error answer {r.status_code} has no error object: {body!r}"
    missing = {"message", "type", "param", "code"} - err.keys()
    assert not missing, f"error object lacks {sorted(missing)}: {err!r}"
    assert isinstance(err["message"], str) and err["message"], f"error.message is empty: {err!r}"
    return err


@clause("api/health/1")
def test_health_answers_ok_with_plan(client: Client):
    status, body = client.health()
    assert status == 200, f"GET /health answered {status}: {body!r}"
    assert body.get("status") == "ok", f"GET /health status is {body.get('status')!r}, expected 'ok'"
    plan = body.get("plan")
    if plan is not None:
        for key in ("rows", "positions"):
            assert isinstance(plan.get(key), int) and plan[key] > 0, f"plan.{key} is {plan.get(key)!r}"


@clause("api/models/1")
def test_models_lists_the_served_model(client: Client):
    r = client.get("/v1/models")
    assert r.status_code == 200, f"GET /v1/models answered {r.status_code}"
    body = r.json()
    assert body.get("object") == "list", f"object is {body.get('object')!r}, expected 'list'"
    data = body.get("data")
    assert isinstance(data, list) and data, f"data is {data!r}, expected a non-empty list"
    assert all(isinstance(m.get("id"), str) and m["id"] for m in data), f"a model lacks an id: {data!r}"


@clause("api/completions/1")
def test_completion_has_openai_shape(client: Client):
    body = client.complete("The quick brown fox", max_tokens=8, temperature=0)
    assert body.get("object") == "text_completion", f"object is {body.get('object')!r}"
    assert isinstance(body.get("id"), str) and body["id"], "id missing"
    assert isinstance(body.get("created"), int), f"created is {body.get('created')!r}"
    assert isinstance(body.get("model"), str), f"model is {body.get('model')!r}"
    choices = body.get("choices")
    assert isinstance(choices, list) and len(choices) == 1, f"choices is {choices!r}"
    choice = choices[0]
    assert choice.get("index") == 0, f"choice index is {choice.get('index')!r}"
    assert isinstance(choice.get("text"), str), f"choice text is {choice.get('text')!r}"
    assert choice.get("finish_reason") in ("stop", "length"), f"finish_reason is {choice.get('finish_reason')!r}"
    usage = body.get("usage") or {}
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert isinstance(usage.get(key), int), f"usage.{key} is {usage.get(key)!r}"


@clause("api/chat/1")
def test_chat_completion_has_openai_shape(client: Client):
    body = client.chat([{"role": "user", "content": "Say something."}], max_tokens=8, temperature=0)
    assert body.get("object") == "chat.completion", f"object is {body.get('object')!r}"
    assert isinstance(body.get("id"), str) and body["id"], "id missing"
    choice = (body.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    assert message.get("role") == "assistant", f"message role is {message.get('role')!r}"
    assert isinstance(message.get("content"), str), f"message content is {message.get('content')!r}"
    assert choice.get("finish_reason") in ("stop", "length"), f"finish_reason is {choice.get('finish_reason')!r}"
    usage = body.get("usage") or {}
    assert all(isinstance(usage.get(k), int) for k in ("prompt_tokens", "completion_tokens", "total_tokens")), \
        f"usage is {usage!r}"


def chat_body(client: Client, **params) -> dict:
    return {"model": client.model, "messages": [{"role": "user", "content": "Tell a story."}], **params}


@clause("api/sse/1")
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_stream_is_well_framed_sse(client: Client, endpoint: str):
    if endpoint == "chat":
        s = client.stream(path="/v1/chat/completions", body=chat_body(client, stream=True, max_tokens=12, temperature=0))
    else:
        s = client.stream("Once upon a time", max_tokens=12, temperature=0)
    assert s.status == 200, f"streamed {endpoint} answered {s.status}: {s.body[:200]}"
    assert s.content_type.split(";")[0].strip() == "text/event-stream", f"content type is {s.content_type!r}"
    bad = [line for line in s.lines if not line.startswith("data:")
           and not line.startswith((":", "event:", "id:", "retry:"))]
    assert not bad, f"lines that are not SSE fields: {bad[:3]!r}"
    data = [line for line in s.lines if line.startswith("data:")]
    not_json = []
    for line in data:
        payload = line[5:].strip()
        if payload == "[DONE]":
            continue
        try:
            if not isinstance(json.loads(payload), dict):
                not_json.append(payload)
        except json.JSONDecodeError:
            not_json.append(payload)
    assert not not_json, f"data lines that are not one JSON object: {not_json[:3]!r}"
    assert s.done, "the stream did not end with 'data: [DONE]'"
    assert data[-1][5:].strip() == "[DONE]" and not s.after_done, f"data after [DONE]: {s.after_done[:3]!r}"


@clause("api/sse/2")
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_stream_chunks_are_consistent(client: Client, endpoint: str):
    if endpoint == "chat":
        s = client.stream_ok(path="/v1/chat/completions", body=chat_body(client, stream=True, max_tokens=12, temperature=0))
        kind = "chat.completion.chunk"
    else:
        s = client.stream_ok("Once upon a time", max_tokens=12, temperature=0)
        kind = "text_completion"
    chunks = [c for c in s.chunks if c.get("choices")]
    assert chunks, "the stream carried no chunk with choices"
    ids = {c.get("id") for c in s.chunks}
    assert len(ids) == 1 and None not in ids, f"chunks carry ids {sorted(map(str, ids))}, expected one"
    objects = {c.get("object") for c in s.chunks}
    assert objects == {kind}, f"chunk objects are {sorted(map(str, objects))}, expected {kind!r}"
    finishing = [i for i, c in enumerate(chunks) if any(ch.get("finish_reason") for ch in c["choices"])]
    assert finishing == [len(chunks) - 1], \
        f"finish_reason appears in chunks {finishing} of {len(chunks)}, expected only in the last"
    if endpoint == "chat":
        first = chunks[0]["choices"][0].get("delta") or {}
        assert first.get("role") == "assistant", f"first chat delta is {first!r}, expected role 'assistant'"


@clause("api/sse/3")
def test_stream_can_end_with_usage(client: Client):
    params = {"max_tokens": 10, "temperature": 0}
    plain = client.complete("Usage please", **params)
    s = client.stream_ok("Usage please", stream_options={"include_usage": True}, **params)
    assert s.chunks, "empty stream"
    last = s.chunks[-1]
    assert last.get("usage"), f"the last chunk carries no usage: {last!r}"
    assert not last.get("choices"), f"the usage chunk should have no choices: {last.get('choices')!r}"
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert last["usage"].get(key) == plain["usage"][key], \
            f"streamed usage.{key} {last['usage'].get(key)} != non-streamed {plain['usage'][key]}"


@clause("api/stream/1")
def test_chat_stream_equals_non_stream(client: Client):
    body = chat_body(client, max_tokens=24, temperature=0)
    plain = client.chat(body["messages"], max_tokens=24, temperature=0)
    s = client.stream_ok(path="/v1/chat/completions", body={**body, "stream": True})
    want = plain["choices"][0]["message"]["content"]
    assert s.text == want, f"streamed chat {s.text!r} != non-streamed {want!r}"
    assert s.finish_reason == plain["choices"][0]["finish_reason"], \
        f"streamed finish {s.finish_reason!r} != {plain['choices'][0]['finish_reason']!r}"


@clause("api/usage/1")
def test_usage_is_consistent(client: Client):
    a = client.complete("Counting tokens here", max_tokens=7, temperature=0)["usage"]
    b = client.complete("Counting tokens here", max_tokens=3, temperature=0)["usage"]
    for u in (a, b):
        assert u["prompt_tokens"] > 0, f"prompt_tokens is {u['prompt_tokens']}"
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"], f"total != sum in {u!r}"
    assert a["completion_tokens"] <= 7 and b["completion_tokens"] <= 3, f"completion_tokens over max_tokens: {a!r} {b!r}"
    assert a["prompt_tokens"] == b["prompt_tokens"], f"same prompt, prompt_tokens {a['prompt_tokens']} vs {b['prompt_tokens']}"


BAD_JSON = [b"{not json", b"[1, 2, 3]", b'"just a string"', b""]


@clause("api/errors/1")
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_non_json_body_gets_400(client: Client, path: str):
    for raw in BAD_JSON:
        r = client.post(path, content=raw)
        assert r.status_code == 400, f"POST {path} with body {raw!r} answered {r.status_code}, expected 400"
        error_object(r)


def bad_requests(client: Client) -> list[tuple[str, dict, str]]:
    """(path, body, the offending parameter). Each body but those about max_tokens asks for 4
    tokens, so a server that wrongly takes one answers soon."""
    m = client.model
    c, ch = "/v1/completions", "/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    return [
        (c, {"model": m, "max_tokens": 4}, "prompt"),
        (c, {"model": m, "prompt": 5, "max_tokens": 4}, "prompt"),
        (c, {"model": m, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
        (c, {"model": m, "prompt": "hi", "max_tokens": -1}, "max_tokens"),
        (c, {"model": m, "prompt": "hi", "max_tokens": "8"}, "max_tokens"),
        (c, {"model": m, "prompt": "hi", "max_tokens": 2.5}, "max_tokens"),
        (c, {"model": m, "prompt": "hi", "max_tokens": 4, "temperature": -1}, "temperature"),
        (c, {"model": m, "prompt": "hi", "max_tokens": 4, "temperature": "hot"}, "temperature"),
        (c, {"model": m, "prompt": "hi", "max_tokens": 4, "top_p": 0}, "top_p"),
        (c, {"model": m, "prompt": "hi", "max_tokens": 4, "top_p": 1.5}, "top_p"),
        (c, {"model": m, "prompt": "hi", "max_tokens": 4, "stop": 5}, "stop"),
        (c, {"model": m, "prompt": "hi", "max_tokens": 4, "stop": [""]}, "stop"),
        (c, {"model": m, "prompt": "hi", "max_tokens": 4, "stream": "yes"}, "stream"),
        (ch, {"model": m, "max_tokens": 4}, "messages"),
        (ch, {"model": m, "messages": "hi", "max_tokens": 4}, "messages"),
        (ch, {"model": m, "messages": [{"content": "no role"}], "max_tokens": 4}, "messages"),
        (ch, {"model": m, "messages": msgs, "max_tokens": 0}, "max_tokens"),
    ]


REFUSE_WITHIN_S = 10.0  # a request that must be refused gets its 400 at once, not after a generation


def answer_to_bad(client: Client, path: str, body: dict) -> httpx.Response | None:
    """The answer to a request that must be refused, or None when none came within
    REFUSE_WITHIN_S (the server took it and is running it)."""
    try:
        return client.http.post(path, json=body, timeout=REFUSE_WITHIN_S)
    except httpx.TimeoutException:
        return None


@clause("api/errors/2")
def test_invalid_parameters_get_400(client: Client):
    wrong = []
    for path, body, _ in bad_requests(client):
        r = answer_to_bad(client, path, body)
        if r is None:
            wrong.append(f"{path} {json.dumps(body)} -> no answer within {REFUSE_WITHIN_S:.0f} s (taken and running)")
        elif r.status_code != 400:
            wrong.append(f"{path} {json.dumps(body)} -> {r.status_code}")
        else:
            error_object(r)
    assert not wrong, "expected 400 for: " + "; ".join(wrong)


@clause("api/errors/3")
def test_errors_name_the_parameter(client: Client):
    wrong = []
    for path, body, param in bad_requests(client):
        r = answer_to_bad(client, path, body)
        if r is None:
            wrong.append(f"{json.dumps(body)}: no answer within {REFUSE_WITHIN_S:.0f} s (taken and running), "
                         f"expected a 400 naming {param!r}")
            continue
        try:
            got = (r.json().get("error") or {}).get("param") if r.status_code == 400 else None
        except (ValueError, AttributeError):
            got = None
        if got != param:
            wrong.append(f"{json.dumps(body)}: param {got!r}, expected {param!r}")
    assert not wrong, "; ".join(wrong)


def refusal(client: Client, path: str, body: dict, what: str, within: float = 10.0) -> httpx.Response:
    """The answer to a request that must be refused at once; failing the clause, and saying so,
    when none comes within `within` seconds (the server took the request and is running it)."""
    try:
        return client.http.post(path, json=body, timeout=within)
    except httpx.TimeoutException:
        raise AssertionError(f"{what} got no answer within {within:.0f} s, expected 400 at once: "
                             "the server took the request and is running it") from None


@clause("api/errors/4")
def test_request_beyond_context_gets_400(client: Client):
    plan = {"positions": client.facts.get("positions") if client.facts else (client.plan() or {}).get("positions")}
    too_many = (plan.get("positions") or 10**6) * 4
    for path, body in (("/v1/completions", client.body("hello", max_tokens=too_many)),
                       ("/v1/chat/completions", {"model": client.model, "max_tokens": too_many,
                                                 "messages": [{"role": "user", "content": "hello"}]})):
        # Streamed first: a server that takes the request shows it in its status line, and the
        # hang-up that follows ends it there (a server may run a non-streamed one on for long).
        with client.http.stream("POST", path, json={**body, "stream": True}, timeout=10.0) as streamed:
            status = streamed.status_code
        assert status == 400, f"max_tokens={too_many} on {path} (streamed) answered {status}, expected 400"
        r = refusal(client, path, body, f"max_tokens={too_many} on {path}")
        assert r.status_code == 400, f"max_tokens={too_many} on {path} answered {r.status_code}, expected 400"
        error_object(r)
    if plan.get("positions"):
        long_prompt = "x " * (plan["positions"] * 2)
        r = refusal(client, "/v1/completions", client.body(long_prompt, max_tokens=1),
                    f"a prompt of {plan['positions'] * 2}+ tokens")
        assert r.status_code == 400, f"a prompt of {plan['positions'] * 2}+ tokens answered {r.status_code}, expected 400"


@clause("api/errors/5")
def test_unknown_path_gets_404(client: Client):
    assert client.get("/v1/no-such-thing").status_code == 404
    assert client.post("/v1/no-such-thing", {}).status_code == 404


# A field no OpenAI-compatible server implements.
NO_SUCH_FIELD = "poot_no_such_field"


@clause("api/fields/1")
def test_unimplemented_field_is_refused_by_name(client: Client):
    chat = {"model": client.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    wrong = []
    for path, body in (("/v1/completions", client.body("hi", max_tokens=4)), ("/v1/chat/completions", chat)):
        r = answer_to_bad(client, path, {**body, NO_SUCH_FIELD: 1})
        if r is None:
            wrong.append(f"{path}: no answer within {REFUSE_WITHIN_S:.0f} s (taken and running)")
        elif r.status_code == 200:
            wrong.append(f"{path}: answered 200, the field silently dropped")
        elif not refusal_names(r.status_code, r.text, NO_SUCH_FIELD):
            wrong.append(f"{path}: answered {r.status_code} without naming it: {r.text[:200]}")
    assert not wrong, f"a request carrying {NO_SUCH_FIELD!r} must get a 4xx naming the field; " + "; ".join(wrong)


@clause("api/prompt/1")
def test_token_id_prompt_is_accepted(client: Client):
    body = client.complete([72, 101, 108, 108, 111], max_tokens=4, temperature=0)
    assert body["usage"]["prompt_tokens"] >= 5, f"prompt_tokens is {body['usage']['prompt_tokens']}"


# How to start a keyed server of a known kind from its command: (extra options, environment).
KEYED_START = {
    "poot": lambda key: ((), {"POOT_API_KEY": key}),
    "llamacpp": lambda key: (("--api-key", key), {}),
    "vllm": lambda key: (("--api-key", key), {}),
}


@clause("api/auth/1")
def test_keyed_server_refuses_requests_without_its_key(client: Client, target, spawn):
    if client.api_key:
        return refuses_without_its_key(client)
    kind = target.facts.get("kind")
    if kind not in KEYED_START:
        raise NotSupported("needs the server's API key (--api-key or OPENAI_API_KEY) to tell a refusal from an outage, "
                           f"or a server command of a kind whose key option is known ({', '.join(KEYED_START)}), "
                           f"not {kind}")
    target.can_spawn()
    key = "k" + secrets.token_urlsafe(24)  # never "-...", which a command-line parser takes for an option
    args, env = KEYED_START[kind](key)
    server = spawn(args, env)
    server.wait_healthy(target.options.getoption("poot_startup_timeout"))
    keyed = Client(server.url, model=client.model, api_key=key)
    try:
        refuses_without_its_key(keyed)
    finally:
        keyed.close()


def refuses_without_its_key(client: Client) -> None:
    body = client.body("hello", max_tokens=2)
    for what, headers in (("no key", {}), ("a wrong key", {"authorization": "Bearer not-" + "x" * 12})):
        r = httpx.post(client.base_url + "/v1/completions", json=body, headers=headers, timeout=10.0)
        assert r.status_code == 401, f"a completion request with {what} answered {r.status_code}, expected 401"
        try:
            message = (r.json().get("error") or {}).get("message")
        except (ValueError, AttributeError):
            message = None
        assert isinstance(message, str) and message, \
            f"the 401 to a request with {what} has no error.message: {r.text[:200]!r}"
    client.complete("hello", max_tokens=2)  # and with the key it is served
