"""Statistics over recorded streams: percentiles, per-request timings, goodput, burst ratio."""

import math

import pytest

from poot.loadtests import stats


def rec(chunks, *, status="ok", t_sent=0.0, kind="main", completion_tokens=None, end=None, **kw):
    return {"chunks": list(chunks), "status": status, "t_sent": t_sent, "kind": kind,
            "completion_tokens": completion_tokens, "end": end if end is not None else (chunks[-1] if chunks else 0.1),
            **kw}


def test_percentile_matches_linear_interpolation():
    xs = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert stats.percentile(xs, 50) == pytest.approx(5.5)
    assert stats.percentile(xs, 0) == 1
    assert stats.percentile(xs, 100) == 10
    assert stats.percentile(xs, 99) == pytest.approx(9.91)
    assert stats.percentile([], 50) is None
    assert stats.percentile([3.0], 99) == 3.0


def test_request_metrics_ttft_gaps_tpot():
    m = stats.request_metrics(rec([0.5, 0.6, 0.7, 1.7, 1.8], end=1.9))
    assert m["ttft"] == 0.5
    assert m["gaps"] == pytest.approx([0.1, 0.1, 1.0, 0.1])
    assert m["gap_max"] == pytest.approx(1.0)
    assert m["gap_p50"] == pytest.approx(0.1)
    # TPOT: (last token - first token) / (tokens - 1), the stall is averaged in.
    assert m["tpot"] == pytest.approx((1.8 - 0.5) / 4)
    assert m["output_tokens"] == 5
    assert m["tokens_per_s"] == pytest.approx(5 / 1.9)


def test_usage_count_beats_chunk_count_for_multi_token_chunks():
    # Three chunks carrying 7 tokens (a speculative server): TPOT divides by tokens, not chunks.
    m = stats.request_metrics(rec([0.1, 0.2, 0.4], completion_tokens=7))
    assert m["output_tokens"] == 7
    assert m["tpot"] == pytest.approx(0.3 / 6)


def test_single_chunk_request_has_no_gaps():
    m = stats.request_metrics(rec([0.2]))
    assert m["gaps"] == [] and m["gap_p99"] is None and m["tpot"] is None


def test_goodput_counts_ttft_and_gap_objectives():
    records = [
        rec([0.1, 0.2, 0.3]),                   # good
        rec([0.9, 1.0, 1.1]),                   # TTFT too slow
        rec([0.1, 0.2, 1.2]),                   # a 1 s gap
        rec([], status="error", error="HTTP 500"),  # failed: never good
        rec([0.1], status="disconnected"),      # left on purpose: not counted at all
    ]
    s = stats.summarize(records, stats.Slo(ttft_s=0.5, gap_p99_s=0.5))
    assert s["good_requests"] == 1
    assert s["goodput"] == pytest.approx(1 / 4)
    assert s["errors"] == 1 and s["disconnected"] == 1 and s["ok"] == 3
    assert s["error_kinds"] == {"HTTP 500": 1}
    # No objectives: every finished request is good.
    assert stats.summarize(records)["goodput"] == pytest.approx(3 / 4)


def test_summary_throughput_and_pooled_gaps():
    records = [rec([0.1, 0.2, 0.3], t_sent=10.0, end=0.4), rec([0.1, 0.3], t_sent=11.0, end=1.0)]
    s = stats.summarize(records)
    assert s["duration_s"] == pytest.approx(2.0)       # 10.0 .. 12.0
    assert s["output_tokens"] == 5
    assert s["output_throughput"] == pytest.approx(2.5)
    assert s["itl"]["count"] == 3
    assert s["itl"]["max"] == pytest.approx(0.2)


def test_schedule_lag_from_open_loop_records():
    records = [rec([0.1], t_sent=1.05, t_scheduled=1.0), rec([0.1], t_sent=2.5, t_scheduled=2.0)]
    lag = stats.summarize(records)["schedule_lag"]
    assert lag["max"] == pytest.approx(0.5) and lag["min"] == pytest.approx(0.05)


def decode_stream(t_sent, n, step, stall_at=None, stall=0.0):
    t, out = 0.05, []
    for _ in range(n):
        out.append(t)
        t += step
        if stall_at is not None and t_sent + t >= stall_at and stall:
            t += stall
            stall = 0.0
    return out


def test_burst_interference_ratio_and_verdict():
    # Two decoders at 10 ms per token; a burst at t=1.0 stalls one of them by 25 ms, the other by 100 ms.
    d1 = rec(decode_stream(0.0, 200, 0.01, 1.0, 0.025), kind="decode", id=0)
    d2 = rec(decode_stream(0.0, 200, 0.01, 1.0, 0.100), kind="decode", id=1)
    late = rec(decode_stream(1.5, 20, 0.01), t_sent=1.5, kind="decode", id=2)  # started after the burst
    burst = [rec([0.3], t_sent=1.0, kind="burst", id=3 + i) for i in range(3)]
    b = stats.burst_interference([d1, d2, late, *burst], limit=3.0)
    assert b["streams"] == 2
    assert b["window"] == pytest.approx([1.0, 1.3])
    assert b["worst"]["id"] == 1
    assert b["worst_ratio"] == pytest.approx(0.11 / 0.01, rel=0.05)
    assert b["ok"] is False
    ok = stats.burst_interference([d1, *burst], limit=5.0)
    assert ok["ok"] is True and ok["worst_ratio"] == pytest.approx(3.5, rel=0.05)


def test_burst_interference_with_clumped_tokens_uses_the_mean():
    # Tokens read three at a time (gaps 0, 0, 30 ms): the median is 0, the mean is 10 ms;
    # one 200 ms stall after the burst.
    chunks, t = [], 0.05
    for k in range(90):
        chunks.append(t)
        t += 0.03 if k % 3 == 2 else 0.0
        if k == 60:
            t += 0.2
    d = rec(chunks, kind="decode", id=0)
    b = stats.burst_interference([d, rec([0.1], t_sent=0.5, kind="burst", id=1)])
    row = b["worst"]
    assert row["basis"] == "mean before burst"
    assert row["typical_gap"] == pytest.approx(0.01, rel=0.15)
    assert row["max_gap"] == pytest.approx(0.2)
    assert b["worst_ratio"] == pytest.approx(0.2 / row["typical_gap"])
    assert b["ok"] is False


def test_burst_interference_without_burst():
    assert stats.burst_interference([rec([0.1, 0.2], kind="decode")])["ok"] is None


def test_token_throughput_series_weights_multi_token_chunks():
    records = [rec([0.1, 0.2, 1.1], t_sent=0.0, completion_tokens=6)]
    xs, ys = stats.token_throughput_series(records, t0=0.0, bin_s=1.0)
    assert xs == [0.5, 1.5]
    assert ys == pytest.approx([4.0, 2.0])
    assert sum(ys) == pytest.approx(6)


def test_cdf_and_describe():
    xs, ys = stats.cdf([3, 1, 2])
    assert xs == [1, 2, 3] and ys[-1] == 1.0
    d = stats.describe([])
    assert d["count"] == 0 and d["p99"] is None and d["mean"] is None
    assert math.isclose(stats.describe([1, 3])["mean"], 2.0)
