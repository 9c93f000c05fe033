"""The reference server over real HTTP: each test talks to a `poot-serve` process on loopback."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

import poot

from .proc import MUTANTS, TESTS, Server, run_cli

STEP_DELAY = "0.02"  # hidden test option: slow steps so that cancellation and draining are observable


@pytest.fixture(scope="module")
def srv():
    s = Server("--fault-injection")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def slow():
    s = Server("--step-delay", STEP_DELAY)
    yield s
    s.stop()


def text_of(events: list, chat: bool = False) -> tuple[str, str | None]:
    """Joined text and the finish_reason of a parsed stream."""
    parts, reason = [], None
    for e in events:
        if e == "[DONE]" or not e["choices"]:
            continue
        c = e["choices"][0]
        parts.append((c["delta"].get("content") or "") if chat else c["text"])
        if c["finish_reason"] is not None:
            assert reason is None, "two chunks carry a finish_reason"
            reason = c["finish_reason"]
    return "".join(parts), reason


def check_error(r: httpx.Response, status: int, param: str | None = "any") -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"], err
    if param != "any":
        assert err["param"] == param, err
    return err


# ---- shape -------------------------------------------------------------------------------

def test_health_models_and_metrics(srv):
    h = srv.client.get("/health")
    assert h.status_code == 200
    plan = h.json()["plan"]
    assert h.json()["status"] == "ok"
    assert h.json()["version"] == poot.__version__  # reports name the run by it
    assert {"rows", "positions", "num_blocks", "block_size", "token_budget", "backend", "model"} <= set(plan)
    models = srv.client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == plan["model"]
    srv.complete(prompt="warm", max_tokens=2)
    m = srv.metrics()
    for name in ("engine_compiles", "engine_steps_total", "engine_requests_waiting", "engine_requests_running",
                 "engine_rows", "kv_blocks_total", "kv_blocks_reserved", "kv_blocks_in_use", "kv_blocks_cached",
                 'requests_finished_total{reason="stop"}', 'requests_finished_total{reason="cancelled"}',
                 "prompt_tokens_total", "generation_tokens_total", "prefix_registered_tokens",
                 "prefix_skipped_releases", "prefix_cache_hit_rate", "spec_drafted_tokens_total",
                 "spec_accepted_tokens_total"):
        assert name in m, name
    assert m["engine_rows"] == plan["rows"] and m["kv_blocks_total"] == plan["num_blocks"]
    if sys.platform == "linux":  # the process collector reads /proc
        assert m["process_resident_memory_bytes"] > 1e6
    text = srv.client.get("/metrics").text
    assert "# HELP engine_steps_total " in text and "# TYPE engine_steps_total counter" in text


def test_metrics_split_step_durations_by_kind_and_show_the_event_loop_lag(srv):
    """A stream's gap is one loop iteration, or a late event loop: /metrics shows both, so a
    long gap can be traced to its cause."""
    before = srv.metrics()
    srv.complete(prompt="a prompt to prefill first", max_tokens=6, temperature=0, ignore_eos=True)
    after = srv.metrics()
    steps = after["engine_steps_total"] - before["engine_steps_total"]
    counted = sum(after[f'engine_step_duration_seconds_count{{kind="{k}"}}'] -
                  before[f'engine_step_duration_seconds_count{{kind="{k}"}}'] for k in ("decode", "mixed", "prefill"))
    assert counted == steps  # every step is one iteration of exactly one kind
    grew = {k: after[f'engine_step_duration_seconds_count{{kind="{k}"}}'] -
            before[f'engine_step_duration_seconds_count{{kind="{k}"}}'] for k in ("decode", "prefill")}
    assert grew["prefill"] >= 1 and grew["decode"] >= 5, grew  # alone, a prompt is prefill then decode
    for k in ("decode", "prefill"):
        assert 0 < after[f'engine_step_duration_max_seconds{{kind="{k}"}}'] < 60
        assert 0 <= after[f'engine_step_host_seconds_total{{kind="{k}"}}'] <= \
            after[f'engine_step_duration_seconds_sum{{kind="{k}"}}']
    assert after["server_event_loop_lag_seconds_count"] > 0  # the timer has been waking
    assert after["server_event_loop_lag_seconds_sum"] >= 0


def test_answers_say_where_the_time_to_first_token_went(srv):
    """`timings`: queued for a row, then prefill to the first token, in the whole answer and in
    a stream's usage chunk; the load tests put both in their report."""
    c = srv.complete(prompt="where did the time go", max_tokens=3, temperature=0)
    t = c["timings"]
    assert set(t) == {"queued_ms", "prefill_ms"} and t["queued_ms"] >= 0 and t["prefill_ms"] > 0, t
    r = srv.client.post("/v1/completions", json={"prompt": "and in a stream", "max_tokens": 3, "stream": True,
                                                  "stream_options": {"include_usage": True}})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    last = events[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3
    assert last["timings"]["prefill_ms"] > 0 and last["timings"]["queued_ms"] >= 0


def test_completion_and_chat_shapes(srv):
    c = srv.complete(prompt="Hello", max_tokens=5, temperature=0, ignore_eos=True)
    assert c["object"] == "text_completion" and c["id"] and isinstance(c["created"], int) and c["model"]
    assert c["choices"][0]["finish_reason"] == "length" and c["choices"][0]["index"] == 0
    u = c["usage"]
    assert u["completion_tokens"] == 5 and u["total_tokens"] == u["prompt_tokens"] + 5
    r = srv.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                          "temperature": 0})
    assert r.status_code == 200, r.text
    chat = r.json()
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert isinstance(chat["choices"][0]["message"]["content"], str)
    # token-id prompt
    c = srv.complete(prompt=[72, 101, 108, 108, 111], max_tokens=3, temperature=0)
    assert c["usage"]["prompt_tokens"] == 5  # ids are used as given


def test_stream_framing_and_usage(srv):
    body = {"prompt": "Once upon", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    events, _ = srv.stream("/v1/completions", body)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len({e["id"] for e in chunks}) == 1 and all(e["object"] == "text_completion" for e in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    # one event per committed token (the byte tokenizer releases one character per token)
    assert len(chunks) - 2 == 12
    non = srv.complete(**{k: v for k, v in body.items() if k != "stream_options"})
    assert chunks[-1]["usage"]["prompt_tokens"] == non["usage"]["prompt_tokens"]

    events, _ = srv.stream("/v1/chat/completions", {"messages": [{"role": "user", "content": "hey"}],
                                                    "max_tokens": 6, "temperature": 0})
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1]) and events[-1] == "[DONE]"


@pytest.mark.parametrize("body", [
    {"prompt": "Hello world", "max_tokens": 40},
    {"prompt": "The quick brown fox", "max_tokens": 64, "stop": ["zz", "\n"]},
    {"prompt": [10, 20, 30, 40], "max_tokens": 30},
    {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What is 2+2?"}],
     "max_tokens": 50},
])
def test_streamed_equals_nonstreamed_greedy(srv, body):
    chat = "messages" in body
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {**body, "temperature": 0}
    r = srv.post(path, body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    expected = choice["message"]["content"] if chat else choice["text"]
    events, _ = srv.stream(path, body)
    assert text_of(events, chat) == (expected, choice["finish_reason"])


def test_stop_string_across_token_boundaries(srv):
    base = {"prompt": "Tell me a story", "max_tokens": 60, "temperature": 0, "ignore_eos": True}
    full = srv.complete(**base)["choices"][0]["text"]
    assert len(full) >= 30
    stop = full[20:24]  # four characters, hence four tokens: the match spans token edges
    cut = full[: full.find(stop)]
    body = {**base, "stop": [stop, "never-occurs-here"]}
    c = srv.complete(**body)
    assert c["choices"][0]["text"] == cut and c["choices"][0]["finish_reason"] == "stop"
    events, _ = srv.stream("/v1/completions", body)
    # The stream never shows text of the stop string, even the part that arrived first.
    assert text_of(events) == (cut, "stop")


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_held_back_step_still_gets_its_chunk(srv, chat):
    """Text that might start a stop string is held, but the step's chunk goes out with empty
    content: the stream keeps the step cadence, so a client does not read held text as a
    stall."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    base = {"max_tokens": 24, "temperature": 0, "ignore_eos": True,
            **({"messages": [{"role": "user", "content": "a tale"}]} if chat else {"prompt": "A tale"})}
    r = srv.post(path, base).json()["choices"][0]
    full = r["message"]["content"] if chat else r["text"]
    stop = full[10:13] + "\x00"  # its first three characters arrive, then it never completes
    events, _ = srv.stream(path, {**base, "stop": [stop]})
    steps = [e["choices"][0] for e in events[:-1] if e["choices"] and not e["choices"][0]["finish_reason"]]
    if chat:
        assert steps[0]["delta"] == {"role": "assistant", "content": ""}
        steps = steps[1:]
    texts = [c["delta"]["content"] if chat else c["text"] for c in steps]
    assert len(texts) == 24  # one chunk per committed token (one character each)
    assert texts[10:13] == ["", "", ""]  # held while they might begin the stop string
    assert "".join(texts) == full and text_of(events, chat) == (full, "length")


# ---- bad input ---------------------------------------------------------------------------

BAD = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/chat/completions", b"\"text\"", 400, None),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 999999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "8"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2.5}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**6}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_k": -5}, 400, "top_k"),
    ("/v1/completions", {"prompt": "x", "seed": "s"}, 400, "seed"),
    ("/v1/completions", {"prompt": "x", "stop": 5}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "n": 2, "best_of": 1}, 400, "best_of"),
    ("/v1/completions", {"prompt": "x", "best_of": 3, "stream": True}, 400, "best_of"),
    ("/v1/completions", {"prompt": "x", "suffix": "end"}, 400, "suffix"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": "x"}, 400, "frequency_penalty"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"a": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"1": 500}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 99}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": ["a"]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "echo": "yes"}, 400, "echo"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "x", "logprobs": 6}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": True}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "model": "no-such-model"}, 404, "model"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**6, "stream": True}, 400, "max_tokens"),
    ("/v1/chat/completions", {"max_tokens": 4}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": "3"}, 400, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                              "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": 1}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "best_of": 2}, 400, "best_of"),
]


def test_bad_inputs_get_4xx_and_leave_the_engine_alone(srv):
    counters = ("prompt_tokens_total", "generation_tokens_total", "engine_steps_total",
                'requests_finished_total{reason="error"}', 'requests_finished_total{reason="cancelled"}')
    before = srv.metrics()
    for path, body, status, param in BAD:
        if isinstance(body, bytes):
            r = srv.client.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = srv.post(path, body)
        err = check_error(r, status, param)
        assert "Traceback" not in err["message"]
    huge = b'{"prompt": "' + b"a" * (1 << 20) + b'"}'
    check_error(srv.client.post("/v1/completions", content=huge), 413)
    check_error(srv.client.get("/v1/nothing-here"), 404)
    check_error(srv.client.get("/v1/completions"), 405)
    after = srv.metrics()
    assert {k: after[k] for k in counters} == {k: before[k] for k in counters}
    assert after["engine_requests_running"] == after["engine_requests_waiting"] == 0
    assert srv.client.get("/health").status_code == 200


# ---- failures ----------------------------------------------------------------------------

def test_refused_step_fails_only_its_requests(srv):
    assert srv.post("/debug/fault", {"kind": "refuse"}).status_code == 200
    r = srv.post("/v1/completions", {"prompt": "Hello", "max_tokens": 8})
    err = check_error(r, 500)
    assert "refused" in err["message"]
    assert srv.client.get("/health").json()["status"] == "ok"
    srv.complete(prompt="Hello", max_tokens=8)

    assert srv.post("/debug/fault", {"kind": "refuse"}).status_code == 200
    events, r = srv.stream("/v1/completions", {"prompt": "Hello", "max_tokens": 8})
    assert r.status_code == 200 and events[-1] == "[DONE]" and "error" in events[-2]
    srv.complete(prompt="Hello again", max_tokens=8)
    m = srv.wait_metric("engine_requests_running", lambda v: v == 0)
    assert m["kv_blocks_reserved"] == 0
    check_error(srv.post("/debug/fault", {"kind": "explode"}), 400, "kind")


@pytest.mark.parametrize("kind,cause", [("fault", "fault"), ("panic", "panicked")])
def test_fault_and_panic_fail_everything_in_flight(kind, cause):
    s = Server("--fault-injection", "--step-delay", STEP_DELAY)
    try:
        body = {"prompt": "Hello", "max_tokens": 300, "ignore_eos": True}
        with ThreadPoolExecutor(2) as pool:
            streamed = pool.submit(s.stream, "/v1/completions", body)
            plain = pool.submit(s.post, "/v1/completions", body)
            s.wait_metric("engine_requests_running", lambda v: v == 2)
            assert s.post("/debug/fault", {"kind": kind}).status_code == 200
            events, r = streamed.result(10)
            assert r.status_code == 200 and events[-1] == "[DONE]" and "error" in events[-2]
            check_error(plain.result(10), 503)
        h = s.client.get("/health")
        assert h.status_code == 503
        assert h.json()["status"] == "dead" and h.json()["cause"] == cause and h.json()["reason"]
        t0 = time.monotonic()
        check_error(s.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2}), 503)
        check_error(s.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}), 503)
        assert time.monotonic() - t0 < 2
    finally:
        s.stop()


# ---- cancellation ------------------------------------------------------------------------

def long_request_over_raw_socket(s: Server, stream: bool = False) -> socket.socket:
    body = json.dumps({"prompt": "Hello", "max_tokens": 400, "ignore_eos": True, "stream": stream}).encode()
    sock = socket.create_connection(("127.0.0.1", s.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return sock


@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
def test_disconnect_frees_the_row_within_one_step(slow, stream):
    cancelled = 'requests_finished_total{reason="cancelled"}'
    before = slow.wait_metric("engine_requests_running", lambda v: v == 0)
    sock = long_request_over_raw_socket(slow, stream)
    slow.wait_metric("generation_tokens_total", lambda v: v >= before["generation_tokens_total"] + 3)
    sock.close()
    steps_at_close = slow.metrics()["engine_steps_total"]
    after = slow.wait_metric("engine_requests_running", lambda v: v == 0, timeout=5)
    assert after["engine_steps_total"] - steps_at_close <= 2
    assert after[cancelled] == before[cancelled] + 1
    assert after["kv_blocks_reserved"] == 0


@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
def test_disconnect_cancels_every_choice(slow, stream):
    cancelled = 'requests_finished_total{reason="cancelled"}'
    before = slow.wait_metric("engine_requests_running", lambda v: v == 0)
    body = json.dumps({"prompt": "Hello", "max_tokens": 400, "ignore_eos": True, "stream": stream, "n": 3,
                       "logprobs": 1}).encode()
    sock = socket.create_connection(("127.0.0.1", slow.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    slow.wait_metric("generation_tokens_total", lambda v: v >= before["generation_tokens_total"] + 9)
    sock.close()
    after = slow.wait_metric("engine_requests_running", lambda v: v == 0, timeout=5)
    assert after[cancelled] == before[cancelled] + 3
    assert after["kv_blocks_reserved"] == 0


def test_best_of_answers_the_n_best_and_counts_every_sequence(srv):
    r = srv.post("/v1/completions", {"prompt": "Once", "max_tokens": 5, "ignore_eos": True, "temperature": 1.0,
                                     "seed": 3, "best_of": 3, "n": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert all(c["logprobs"] is None for c in body["choices"])  # ranked by logprobs nobody asked to see
    assert body["usage"]["completion_tokens"] == 15
    scored = srv.post("/v1/completions", {"prompt": "Once", "max_tokens": 5, "ignore_eos": True, "temperature": 1.0,
                                          "seed": 3, "best_of": 3, "logprobs": 0}).json()
    everyone = srv.post("/v1/completions", {"prompt": "Once", "max_tokens": 5, "ignore_eos": True, "temperature": 1.0,
                                            "seed": 3, "n": 3, "logprobs": 0}).json()
    sums = sorted((sum(c["logprobs"]["token_logprobs"]) for c in everyone["choices"]), reverse=True)
    assert sum(scored["choices"][0]["logprobs"]["token_logprobs"]) == pytest.approx(sums[0])


def test_fault_route_absent_without_the_flag(slow):
    assert slow.post("/debug/fault", {"kind": "panic"}).status_code == 404
    assert slow.client.get("/health").json()["status"] == "ok"


# ---- draining and start-up ---------------------------------------------------------------

def test_sigterm_drains_in_flight_requests_then_exits_0():
    s = Server("--step-delay", STEP_DELAY)
    try:
        body = {"prompt": "Hello", "max_tokens": 60, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        events: list = []
        started = threading.Event()

        def consume():
            with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=30) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        started.set()

        reader = threading.Thread(target=consume)
        reader.start()
        assert started.wait(10)
        s.proc.send_signal(signal.SIGTERM)
        h = httpx.get(s.url + "/health", timeout=5)
        assert h.status_code == 503 and h.json()["status"] == "draining"
        try:
            r = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=5)
            check_error(r, 503)
        except httpx.ConnectError:
            pass  # the listener already closed: also a refusal
        assert s.proc.poll() is None  # still draining
        reader.join(15)
        assert events[-1] == "[DONE]"
        usage = json.loads(events[-2])["usage"]
        assert usage["completion_tokens"] == 60
        assert json.loads(events[-3])["choices"][0]["finish_reason"] == "length"
        assert s.proc.wait(10) == 0
    finally:
        s.stop()


@pytest.mark.parametrize("args,needle", [
    (["--rows", "4"], "--rows"),
    (["--max-num-seqs", "8"], "--max-num-seqs"),
    (["--ctx-size", "512"], "--ctx-size"),
    (["--mutation", "youngest_first"], "--mutation"),
    (["--model", "synthetic:abc"], "synthetic:abc"),
    (["--model", "/no/such/model.gguf"], "/no/such/model.gguf"),
    (["--step-delay", "nan"], "--step-delay"),
    (["--step-delay", "-1"], "--step-delay"),
    (["--step-delay", "5"], "--step-delay"),
])
def test_bad_startup_fails_at_once(args, needle):
    r = run_cli(*args, "--port", "1")
    assert r.returncode != 0
    assert needle in r.stderr


def test_test_only_options_are_hidden_and_leave_the_plan_alone(srv, slow):
    r = run_cli("--help")
    assert r.returncode == 0 and "--model" in r.stdout
    assert "--step-delay" not in r.stdout and "--mutation" not in r.stdout
    # The slowed server fits the very same plan as the plain one: the option changes timing only.
    plain, slowed = (s.client.get("/health").json()["plan"] for s in (srv, slow))
    assert slowed == plain


def test_loading_state_is_reported():
    from starlette.testclient import TestClient

    from poot.server.app import build_app
    from poot.server.state import ServerState

    state = ServerState(model_spec="synthetic")
    client = TestClient(build_app(state))  # no lifespan: nothing loads
    h = client.get("/health")
    assert h.status_code == 503
    assert h.json() == {"status": "loading", "phase": "model", "detail": "starting", "progress": None}
    check_error(client.post("/v1/completions", json={"prompt": "x"}), 503)
    state.progress.report("compile", "compiling CPU kernels", 2, 8)  # what the loading thread would say
    h = client.get("/health")
    assert h.status_code == 503
    assert h.json() == {"status": "loading", "phase": "compile", "detail": "compiling CPU kernels (3 of 8)",
                        "progress": 0.25}


def test_the_driver_is_made_and_preloaded_beside_the_model_reporting_to_the_start(monkeypatch):
    from poot.engine.drivers.cpu import CpuDriver
    from poot.server.state import ServerState

    preloaded = []
    monkeypatch.setattr(CpuDriver, "preload", lambda self: preloaded.append(self.progress))
    state = ServerState(model_spec="synthetic", backend="numpy")
    driver = state.ready_driver()
    assert driver.progress is state.progress and preloaded == [state.progress]


# ---- deliberate defects (tests/poot_mutants): what a conformance run must catch --------------

def test_an_unknown_defect_fails_startup():
    r = subprocess.run([*MUTANTS, "--mutation", "no_such_defect", "--port", "1"], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "PYTHONPATH": TESTS})
    assert r.returncode == 2 and "no_such_defect" in r.stderr


def test_mutations_break_what_they_claim():
    s = Server("--step-delay", "0.005", "--mutation", "stream_stop_prefix",
               "--mutation", "ignore_disconnect_nonstream", "--mutation", "healthy_while_draining", exe=MUTANTS)
    try:
        base = {"prompt": "Tell me a story", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        full = s.complete(**base)["choices"][0]["text"]
        stop = full[20:24]
        events, _ = s.stream("/v1/completions", {**base, "stop": [stop]})
        streamed, _ = text_of(events)
        kept = full[: full.find(stop)]
        assert streamed.startswith(kept) and streamed != kept  # the stop string's start leaked

        cancelled = 'requests_finished_total{reason="cancelled"}'
        before = s.metrics()
        sock = long_request_over_raw_socket(s)
        s.wait_metric("engine_requests_running", lambda v: v == 1)
        sock.close()
        # It runs its 400 tokens to the end: waited for as long as tokens are still made.
        after = s.wait_metric("engine_requests_running", lambda v: v == 0, timeout=10,
                              moving="generation_tokens_total")
        assert after[cancelled] == before[cancelled]  # ran to its end instead
        assert after['requests_finished_total{reason="length"}'] > before['requests_finished_total{reason="length"}']
    finally:
        s.stop()


def test_more_mutations_break_what_they_claim():
    s = Server("--fault-injection", "--rows", "7", *[a for m in ("accept_unknown_options", "rows_from_env",
               "no_done_sentinel", "bad_params_500", "no_metrics_steps", "healthy_when_dead")
               for a in ("--mutation", m)], env={"POOT_ROWS": "3"}, exe=MUTANTS)
    try:
        assert s.client.get("/health").json()["plan"]["rows"] == 3
        check_error(s.post("/v1/completions", {"prompt": "x", "temperature": -1}), 500)
        events, _ = s.stream("/v1/completions", {"prompt": "x", "max_tokens": 3})
        assert events and "[DONE]" not in events
        assert "engine_steps_total" not in s.metrics()
        s.post("/debug/fault", {"kind": "panic"})
        time.sleep(0.3)
        assert s.client.get("/health").status_code == 200
    finally:
        s.stop()
    plain = Server(env={"POOT_ROWS": "3"})
    try:
        assert plain.client.get("/health").json()["plan"]["rows"] != 3  # the environment changes nothing
    finally:
        plain.stop()
