"""Workloads are seeded and reproducible; the SSE recorder timestamps text chunks."""

import json
import random
import statistics

import pytest

from poot.loadtests import convoy, workloads
from poot.loadtests.sse import SseParser, StreamRecorder, chunk_text
from poot.loadtests.workloads import Lengths, LoadConfig, build, request_body, scenario_config


@pytest.mark.parametrize("name", sorted(workloads.SCENARIOS))
def test_every_scenario_is_reproducible_and_fits_the_context(name):
    cfg = scenario_config(name, seed=7)
    a, b = build(cfg), build(cfg)
    assert [s.as_dict() for s in a] == [s.as_dict() for s in b]
    assert a, name
    for s in a:
        assert s.prompt_tokens_target + s.max_tokens <= cfg.max_context
        assert s.max_tokens >= 1 and s.prompt
    other = build(scenario_config(name, seed=8))
    assert [s.prompt for s in other] != [s.prompt for s in a]


def test_open_loop_arrivals_are_poisson_at_the_rate():
    cfg = LoadConfig(requests=2000, rate=5.0, seed=3)
    t = [s.arrival for s in build(cfg)]
    assert t == sorted(t)
    gaps = [b - a for a, b in zip(t, t[1:], strict=False)]
    assert statistics.mean(gaps) == pytest.approx(0.2, rel=0.08)
    assert statistics.stdev(gaps) == pytest.approx(0.2, rel=0.1)  # exponential: sd == mean


def test_closed_loop_has_no_arrivals():
    assert all(s.arrival is None for s in build(scenario_config("closed")))


def test_streams_are_independent():
    # Changing output lengths must not move arrival times.
    a = build(LoadConfig(seed=1))
    b = build(LoadConfig(seed=1, output=Lengths("uniform", 5, 10)))
    assert [s.arrival for s in a] == [s.arrival for s in b]


def test_length_distributions_are_bounded():
    rng = random.Random(0)
    ln = Lengths("lognormal", 8, 300, 64.0, 1.0)
    xs = [ln.draw(rng) for _ in range(5000)]
    assert min(xs) >= 8 and max(xs) <= 300
    assert statistics.median(xs) == pytest.approx(64, rel=0.1)
    u = Lengths.parse("uniform:10:20")
    assert {u.draw(rng) for _ in range(500)} == set(range(10, 21))
    assert Lengths.parse("lognormal:64:0.8:8:320") == Lengths("lognormal", 8, 320, 64.0, 0.8)
    assert Lengths.parse("fixed:5").draw(rng) == 5
    with pytest.raises(ValueError):
        Lengths.parse("normal:1:2")


def test_shared_prefix_and_byte_length_prompts():
    specs = build(scenario_config("shared-prefix", seed=2))
    prefix = specs[0].prompt.split("\n")[0]
    assert len(prefix) == 192
    assert all(s.prompt.startswith(prefix + "\n") for s in specs)
    for s in specs:  # one character per token at chars_per_token=1.0
        assert len(s.prompt) == s.prompt_tokens_target


def test_quote_prompts_contain_what_they_ask_for():
    for s in build(scenario_config("quote")):
        assert s.kind == "quote" and s.extra["passage"] in s.prompt
        assert s.max_tokens == len(s.extra["passage"])


def test_burst_scenario_shape():
    specs = build(scenario_config("long-burst"))
    decode = [s for s in specs if s.kind == "decode"]
    burst = [s for s in specs if s.kind == "burst"]
    assert len(decode) == 4 and len(burst) == 6
    assert all(s.arrival == 0.5 and s.prompt_tokens_target >= 400 for s in burst)
    assert all(s.arrival < 0.5 and s.max_tokens >= 300 for s in decode)


def test_disconnect_points_are_within_the_output():
    specs = build(scenario_config("disconnect"))
    leavers = [s for s in specs if s.disconnect_after is not None]
    assert len(leavers) > len(specs) // 2
    assert all(0 <= s.disconnect_after <= s.max_tokens // 2 for s in leavers)


def test_request_body_shapes():
    spec = build(LoadConfig(requests=1))[0]
    path, body = request_body(spec, LoadConfig(model="m"))
    assert path == "/v1/completions" and body["stream"] is True and body["prompt"] == spec.prompt
    assert body["stream_options"] == {"include_usage": True} and body["ignore_eos"] is True
    path, body = request_body(spec, LoadConfig(endpoint="chat", include_usage=False, ignore_eos=False))
    assert path == "/v1/chat/completions" and body["messages"][0]["content"] == spec.prompt
    assert "stream_options" not in body and "ignore_eos" not in body


def test_sse_parser_handles_split_lines_crlf_and_comments():
    p = SseParser()
    out = list(p.feed(b'data: {"a"')) + list(p.feed(b': 1}\r\n\r\n: keepalive\n\ndata: [DO'))
    out += list(p.feed(b"NE]\n\n")) + list(p.close())
    assert out == ['{"a": 1}', "[DONE]"]


def _event(obj) -> bytes:
    return ("data: " + json.dumps(obj) + "\n\n").encode()


def test_recorder_timestamps_text_and_held_back_steps():
    # A step whose text is held back still marks the cadence once text has started; the
    # closing chunk with no text and the usage chunk do not.
    clock = iter([0.0, 0.05, 0.1, 0.25, 0.3, 0.4, 0.5, 0.6]).__next__
    r = StreamRecorder(clock=clock)
    r.feed(_event({"choices": [{"index": 0, "text": "", "finish_reason": None}]}))      # 0.05 before any text
    r.feed(_event({"choices": [{"index": 0, "text": "a", "finish_reason": None}]}))     # 0.1
    r.feed(_event({"choices": [{"index": 0, "text": "", "finish_reason": None}]}))      # 0.25 held back
    r.feed(_event({"choices": [{"index": 0, "text": "bc", "finish_reason": None}]}))    # 0.3
    r.feed(_event({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}) + _event(
        {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 4,
                                  "prompt_tokens_details": {"cached_tokens": 2}}}))  # 0.4
    r.feed(b"data: [DONE]\n\n")                                                   # 0.5
    r.finish()                                                                    # 0.6
    rec = r.record()
    assert rec["chunks"] == [0.1, 0.25, 0.3] and rec["chunk_chars"] == [1, 0, 2]
    assert rec["empty_chunks"] == 2  # the one before any text and the closing one
    assert rec["finish_reason"] == "length" and rec["done"] and rec["end"] == 0.6
    assert rec["completion_tokens"] == 4 and rec["cached_tokens"] == 2


def test_recorder_chat_role_chunk_is_not_a_step():
    clock = iter([0.0, 0.05, 0.1, 0.2, 0.3, 0.4]).__next__
    r = StreamRecorder(clock=clock)
    r.feed(_event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}))
    r.feed(_event({"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]}))  # 0.1
    r.feed(_event({"choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": None}]}))    # 0.2
    r.feed(_event({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}))               # 0.3
    r.finish()
    assert r.record()["chunks"] == [0.1, 0.2]


def test_recorder_error_event_and_chat_delta():
    r = StreamRecorder(clock=iter([0.0, 0.1, 0.2, 0.3]).__next__)
    r.feed(b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n')
    r.feed(b'data: {"error": {"message": "boom"}}\n\n')
    r.finish()
    assert r.chunks == [0.1] and r.error == "boom"
    assert chunk_text({"choices": [{"delta": {"role": "assistant"}}]}) == ("", None)


def test_convoy_group_plans():
    arrivals = [0.0, 0.01, 0.02, 0.5, 0.51, 1.0, 1.001, 1.002, 1.003]
    assert convoy.group_plan(arrivals, "static", 4, 0.05) == [[0, 1, 2, 3], [4, 5, 6, 7], [8]]
    # Dynamic: a group closes when the oldest has waited 50 ms, or when 4 are waiting.
    assert convoy.group_plan(arrivals, "dynamic", 4, 0.05) == [[0, 1, 2], [3, 4], [5, 6, 7, 8]]
