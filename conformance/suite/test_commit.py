"""loop/commit/*: what a step keeps (up to EOS, a stop string or max_tokens) and streams."""

from __future__ import annotations

import random
import string

import pytest

from poot.conformance.client import Client
from poot.conformance.outcomes import NotSupported
from poot.conformance.scenarios import KNOWN_EOS, Probes, unique_text

clause = pytest.mark.clause
PRINTABLE = set(string.ascii_letters + string.digits + string.punctuation + " ")


@clause("loop/commit/eos/1")
def test_generation_ends_at_end_of_sequence(client: Client, probes: Probes):
    prompt, params = probes.eos_case()
    short = client.complete(prompt, max_tokens=48, **params)
    longer = client.complete(prompt, max_tokens=96, **params)
    n = short["usage"]["completion_tokens"]
    known = KNOWN_EOS.get(client.model)
    if known is not None and prompt == known[0]:
        assert short["choices"][0]["finish_reason"] == "stop" and n == known[2], \
            (f"no prompt ended by itself; {client.model} is known to end at end-of-sequence after {known[2]} "
             f"tokens for {prompt!r}, but the answer ended {short['choices'][0]['finish_reason']!r} after {n}: "
             "generation goes on past end-of-sequence")
    assert short["choices"][0]["finish_reason"] == "stop" and n < 48, f"probe no longer ends by itself: {short!r}"
    assert longer["choices"][0]["finish_reason"] == "stop", \
        f"with max_tokens 96 the answer ended {longer['choices'][0]['finish_reason']!r}, expected 'stop' at EOS"
    assert longer["usage"]["completion_tokens"] == n, \
        f"generation went on after end-of-sequence: {longer['usage']['completion_tokens']} tokens vs {n}"
    assert longer["choices"][0]["text"] == short["choices"][0]["text"], "text differs after end-of-sequence"
    s = client.stream_ok(prompt, max_tokens=96, **params)
    assert s.finish_reason == "stop" and s.text == short["choices"][0]["text"], \
        f"streamed: finish {s.finish_reason!r}, text {s.text!r}; expected 'stop' and {short['choices'][0]['text']!r}"


def stop_cases(client: Client, count: int = 6) -> list[tuple[str, str, str]]:
    """(prompt, stop string, expected text): stop strings of 1-3 printable characters cut from
    greedy outputs, at their first occurrence."""
    rng = random.Random(11)
    cases = []
    for _ in range(40):
        prompt = unique_text(rng.randint(10, 30), rng)
        full = client.complete(prompt, max_tokens=40, temperature=0)["choices"][0]["text"]
        spans = [(i, n) for n in (3, 2, 1) for i in range(2, len(full) - n)
                 if set(full[i:i + n]) <= PRINTABLE]
        if not spans:
            continue
        i, n = spans[rng.randrange(len(spans))] if len(cases) % 2 else spans[0]
        stop = full[i:i + n]
        cases.append((prompt, stop, full[: full.index(stop)]))
        if len(cases) == count:
            break
    if len(cases) < 2:
        raise NotSupported("greedy outputs held no printable text to use as stop strings")
    return cases


@pytest.fixture(scope="module")
def cases(client: Client):
    return stop_cases(client)


@clause("loop/commit/stop/1")
def test_stop_string_ends_output_before_it(client: Client, cases):
    for prompt, stop, want in cases:
        answer = client.complete(prompt, max_tokens=40, temperature=0, stop=[stop, "\u2603never"])
        got = answer["choices"][0]
        assert got["finish_reason"] == "stop", f"stop={stop!r}: finish_reason {got['finish_reason']!r}, expected 'stop'"
        assert stop not in got["text"], f"stop={stop!r}: the text contains the stop string: {got['text']!r}"
        assert got["text"] == want, f"stop={stop!r}: text {got['text']!r}, expected {want!r}"
        single = client.complete(prompt, max_tokens=40, temperature=0, stop=stop)["choices"][0]["text"]
        assert single == want, f"stop given as a string {stop!r}: text {single!r}, expected {want!r}"


@clause("loop/commit/stop/2")
def test_stream_never_sends_stop_string_text(client: Client, cases):
    for prompt, stop, want in cases:
        s = client.stream_ok(prompt, max_tokens=40, temperature=0, stop=[stop])
        leaked = [d for d in s.deltas() if stop in d]
        assert not leaked, f"stop={stop!r}: a delta holds the stop string: {leaked!r}"
        assert s.text == want, f"stop={stop!r}: streamed text {s.text!r}, expected {want!r}"
        assert s.finish_reason == "stop", f"stop={stop!r}: streamed finish_reason {s.finish_reason!r}"


@clause("loop/commit/length/1")
def test_max_tokens_is_honoured_exactly(client: Client, probes: Probes):
    checked, ended_early = 0, []
    for max_tokens in (1, 2, 7, 33):
        prompt = unique_text(20)
        answer = client.complete(prompt, **probes.long_params(max_tokens))
        choice, usage = answer["choices"][0], answer["usage"]
        if choice["finish_reason"] == "stop" and usage["completion_tokens"] < max_tokens:
            # The model ended by itself (loop/commit/eos/1's; whether ignore_eos keeps it going
            # is api/ignore-eos/1's), which checks nothing here.
            ended_early.append(max_tokens)
            continue
        assert choice["finish_reason"] == "length", f"finish_reason {choice['finish_reason']!r}"
        assert usage["completion_tokens"] == max_tokens, \
            f"max_tokens={max_tokens}: completion_tokens {usage['completion_tokens']}"
        s = client.stream_ok(prompt, stream_options={"include_usage": True}, **probes.long_params(max_tokens))
        assert s.finish_reason == "length", f"streamed max_tokens={max_tokens}: finish_reason {s.finish_reason!r}"
        assert s.text == choice["text"], f"streamed max_tokens={max_tokens}: text differs from non-streamed"
        if s.usage:
            assert s.usage["completion_tokens"] == max_tokens, f"streamed usage {s.usage!r}"
        checked += 1
    if not checked:
        raise NotSupported(f"every request (max_tokens {ended_early}) ended by itself before max_tokens, and neither "
                           "ignore_eos nor a logit bias kept it going: max_tokens could not be checked")


@clause("loop/commit/stream/1")
def test_tokens_stream_as_committed(client: Client, probes: Probes):
    # A fast model streams 96 tokens in well under 0.1 s, so a moment without CPU for the
    # client or the server's HTTP loop can pile one stream's chunks up; a server that holds
    # its text back does it every time. The stream is sized to last about a second on this
    # server (at least 96 tokens, at most the positions), and tried up to three times.
    positions = client.facts.get("positions") if client.facts is not None else None
    tokens = probes.tokens_lasting(1.0, max(96, (positions or 1040) - 40), least=96)
    for _ in range(3):
        s = client.stream_ok(unique_text(20), **probes.long_params(tokens))
        times = s.content_times()
        assert len(times) >= 8, f"{tokens} tokens came in {len(times)} content chunks; expected them token by token"
        first, last = times[0], s.times[-1]
        total = s.ended - s.started
        if last - first >= total * 0.25:
            return
    raise AssertionError(f"content arrived in a burst, three times: the last time first chunk {first - s.started:.3f}s, "
                         f"last {last - s.started:.3f}s into a {total:.3f}s request")
