"""The one Prometheus reader: samples by (name, labels), flat keys that round-trip."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from poot.conformance import prometheus

SCRAPE = """# TYPE requests_finished counter
requests_finished_total{reason="stop"} 3
requests_finished_total{reason="cancelled"} 1
requests_finished_created{reason="stop"} 1.7e9
# TYPE engine_step_duration_seconds histogram
engine_step_duration_seconds_bucket{kind="decode",le="0.01"} 2
engine_step_duration_seconds_bucket{kind="decode",le="+Inf"} 5
engine_step_duration_seconds_count{kind="decode"} 5
engine_step_duration_seconds_sum{kind="decode"} 0.2
engine_rows 32
"""


def test_samples_are_keyed_by_name_and_labels_and_created_is_no_measurement():
    samples = prometheus.parse(SCRAPE)
    assert prometheus.value(samples, "requests_finished_total") == 4
    assert prometheus.value(samples, "requests_finished_total", reason="cancelled") == 1
    assert prometheus.value(samples, "requests_finished_total", reason="length") is None
    assert "requests_finished_created" not in prometheus.names(samples)
    assert prometheus.label(samples, "engine_step_duration_seconds_count", "kind") == "decode"


def test_flat_keys_are_what_the_load_reports_store():
    flat = prometheus.parse_flat(SCRAPE)
    assert flat['engine_step_duration_seconds_bucket{kind="decode",le="+Inf"}'] == 5
    assert flat["engine_rows"] == 32


@given(st.text("abc_:", min_size=1, max_size=8).filter(lambda s: s[0] != ":"),
       st.dictionaries(st.sampled_from(["kind", "le", "reason"]), st.text("xyz0.+Inf", max_size=5)))
def test_a_flat_key_splits_back_into_its_name_and_labels(name, labels):
    assert prometheus.split_key(prometheus.key(name, labels)) == (name, labels)


@pytest.mark.parametrize("text", ["engine_rows many", "$$ 1"])
def test_text_that_is_not_prometheus_is_a_format_error(text):
    with pytest.raises(prometheus.MetricsFormatError):
        prometheus.parse(text)
