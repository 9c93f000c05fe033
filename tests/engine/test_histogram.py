"""The one histogram type behind the step durations, the step token counts and the event loop's lag."""

from __future__ import annotations

from poot.engine.histogram import Histogram


def test_a_value_on_a_bound_counts_in_that_bounds_bucket_and_buckets_are_cumulative():
    h = Histogram((1, 2, 4))
    for v in (0, 1, 1.5, 2, 3, 4, 9):
        h.observe(v)
    assert h.counts == [2, 2, 2, 1]  # per bucket; the last is above every bound
    assert h.cumulative() == [2, 4, 6]  # Prometheus's le buckets, +Inf being the count
    assert h.count == 7
    assert h.sum == 20.5 and h.max == 9


def test_an_empty_histogram_keeps_the_type_of_its_zero():
    times, tokens = Histogram((0.1, 1.0)), Histogram((1, 2), zero=0)
    assert times.snapshot() == {"buckets": [0, 0], "count": 0, "sum": 0.0}
    assert isinstance(times.sum, float) and isinstance(times.max, float)
    tokens.observe(2)
    tokens.observe(5)
    assert tokens.snapshot() == {"buckets": [0, 1], "count": 2, "sum": 7}
    assert isinstance(tokens.sum, int)
