"""The drain clauses' verdicts name the fault they found (conformance/drain.py): a server that
stops at the shutdown signal fails for not draining, not as a crash, and a stream cut short
says it ended without [DONE], not that it ended as expected. The same server run for real is
the exit_at_sigterm variant of the mutation proof (tests/poot_mutants)."""

from __future__ import annotations

from poot.conformance.drain import Drain, exit_verdict, health_verdict, inflight_verdict


def test_a_server_that_drains_passes_every_verdict():
    d = Drain(health=[(503, {"status": "draining"})] * 3, finish_reason="length", done=True, exit_code=0)
    assert health_verdict(d) is None and inflight_verdict(d) is None and exit_verdict(d) is None


def test_a_server_that_stops_at_the_signal_is_said_to_stop_instead_of_draining():
    d = Drain(health=[(None, {"no answer": "ConnectError"})], stopped_at_signal=1, finish_reason=None, done=False,
              exit_code=1)
    health = health_verdict(d)
    assert "stopped at the shutdown signal (exited with status 1) instead of draining" in health
    assert "/health got no answer after the shutdown signal (ConnectError)" in health
    assert "cut off before its last chunk" in inflight_verdict(d) and "without [DONE]" in inflight_verdict(d)
    assert "at the shutdown signal, without draining" in exit_verdict(d)


def test_a_stream_with_its_last_chunk_but_no_done_is_cut_not_ended():
    """finish_reason 'length' came, then the connection closed: the reason says what is missing."""
    d = Drain(health=[(503, {"status": "draining"})], finish_reason="length", done=False, exit_code=0)
    why = inflight_verdict(d)
    assert why == ("the stream in flight at shutdown was cut off after its last chunk (finish_reason 'length'): "
                   "it ended without [DONE]")


def test_a_stream_ended_early_with_done_names_its_finish_reason():
    d = Drain(health=[(503, {"status": "draining"})], finish_reason="abort", done=True, exit_code=0)
    assert inflight_verdict(d) == "the stream in flight at shutdown ended with finish_reason 'abort', expected 'length'"


def test_a_health_answer_other_than_draining_is_quoted():
    d = Drain(health=[(503, {"status": "draining"}), (200, {"status": "ok"})], finish_reason="length", done=True)
    assert health_verdict(d) == "while draining /health answered 200 {'status': 'ok'}, expected 503 status 'draining'"



def test_a_request_that_ended_normally_before_health_was_asked_names_the_suites_sizing():
    d = Drain(max_tokens=400, finish_reason="length", done=True, exit_code=0)
    assert health_verdict(d) == "the request (400 tokens) ended before /health could be asked"


def test_a_stream_cut_at_the_signal_before_health_was_asked_is_not_called_short():
    """vLLM 0.32 with its default --shutdown-timeout 0: the stream in flight ends at SIGTERM,
    before the first probe of /health; that is the server not draining, not a short request."""
    d = Drain(max_tokens=400, finish_reason=None, done=False)
    assert health_verdict(d) == ("the stream in flight ended at the shutdown signal (before its last chunk (no "
                                 "finish_reason): it ended without [DONE]), before /health could be asked")
    d.stopped_at_signal = -15
    assert health_verdict(d).startswith("the server stopped at the shutdown signal (exited with status -15)")


def test_a_stream_ended_with_done_but_no_finish_reason_says_so():
    d = Drain(health=[(None, {"no answer": "ConnectError"})], finish_reason=None, done=True)
    assert inflight_verdict(d) == ("the stream in flight at shutdown ended with [DONE] but no finish_reason, "
                                   "expected 'length'")
