"""GET /metrics: a Prometheus collector that reads `engine.metrics()`, the snapshot the engine
thread published at the end of its last iteration, at each scrape."""

from __future__ import annotations

from prometheus_client import ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from poot.engine.histogram import Histogram

# name in engine.metrics() -> HELP text. Counters are exported with the _total suffix.
COUNTERS = {
    "engine_steps": "Driver steps taken by the engine loop.",
    "prompt_tokens": "Prompt tokens of accepted requests.",
    "generation_tokens": "Tokens committed to request outputs.",
    "prefix_cache_queried_tokens": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hit_tokens": "Prompt tokens served from the prefix cache.",
    "spec_drafted_tokens": "Speculative draft tokens proposed.",
    "spec_accepted_tokens": "Speculative draft tokens accepted.",
    "spec_rounds": "Speculative rounds verified (accepted per round = accepted / rounds).",
}
GAUGES = {
    "engine_compiles": "Prepared driver entries built so far; constant after the first request.",
    "engine_requests_waiting": "Requests accepted but not yet holding a row.",
    "engine_requests_running": "Requests holding a row.",
    "engine_rows": "Rows in the engine plan.",
    "kv_blocks_total": "KV blocks in the engine plan.",
    "kv_blocks_reserved": "KV blocks reserved by open requests (prompt plus the whole max_tokens).",
    "kv_blocks_in_use": "KV blocks holding KV written for running requests (a subset of reserved).",
    "kv_blocks_cached": "KV blocks held by no request that still hold a registered prefix (evictable).",
    "kv_blocks_free": "KV blocks holding nothing: reserved + cached + free = total.",
    "prefix_registered_tokens": "Prompt tokens registered in the prefix cache so far.",
    "prefix_skipped_releases": "Releases that registered nothing (recurrent-state models).",
    "prefix_cache_hit_rate": "Prompt tokens served from the prefix cache / prompt tokens looked up.",
}
FINISHED = ("requests_finished", "Finished requests by reason: stop, length, cancelled, error.")
STEP_TOKENS = ("engine_step_tokens", "Tokens fed per step; decoding=\"true\" for steps beside a decoding row. "
               "The plan's token_budget and idle_token_budget are bucket bounds.")
STEP_SECONDS = ("engine_step_duration_seconds",
                "Loop iterations that stepped, by what the step carried: kind=\"decode\" (decoding rows "
                "only), \"mixed\" (decoding rows and prefill chunks), \"prefill\" (prefill only). A "
                "decoding stream's gap between tokens is one such iteration.")
HOST_SECONDS = ("engine_step_host_seconds", "Seconds of those iterations spent outside the driver's step "
                "(scheduling, sampling, streaming), by kind.")
MAX_SECONDS = ("engine_step_duration_max_seconds", "The longest iteration so far, by kind.")


HTTP_REQUESTS = ("http_requests", "Generation requests received, by endpoint (/v1/completions, "
                 "/v1/chat/completions, /v1/responses), whatever their answer.")


class EngineCollector(Collector):
    def __init__(self, state):
        self.state = state

    def collect(self):
        yield loop_lag_family(self.state.loop_lag)
        requests = CounterMetricFamily(HTTP_REQUESTS[0], HTTP_REQUESTS[1], labels=["endpoint"])
        for endpoint, count in sorted(self.state.requests.items()):
            requests.add_metric([endpoint], count)
        yield requests
        engine = self.state.engine
        if engine is None:  # still loading: nothing to report yet
            return
        m = engine.metrics()
        for name, help_text in COUNTERS.items():
            if name in m:
                yield CounterMetricFamily(name, help_text, value=m[name])
        for name, help_text in GAUGES.items():
            if name in m:
                yield GaugeMetricFamily(name, help_text, value=m[name])
        finished = CounterMetricFamily(FINISHED[0], FINISHED[1], labels=["reason"])
        for reason, count in sorted(m.get(FINISHED[0], {}).items()):
            finished.add_metric([reason], count)
        yield finished
        if STEP_TOKENS[0] in m:
            yield step_tokens_family(m[STEP_TOKENS[0]])
        if "engine_step_seconds" in m:
            yield from step_seconds_families(m["engine_step_seconds"])
        known = set(COUNTERS) | set(GAUGES) | {FINISHED[0], STEP_TOKENS[0], "engine_step_seconds"}
        for name, value in sorted(m.items()):  # anything the engine adds later still shows up
            if name not in known and isinstance(value, int | float) and not isinstance(value, bool):
                yield GaugeMetricFamily(name, f"Engine metric {name}.", value=value)


def step_tokens_family(hist: dict) -> HistogramMetricFamily:
    family = HistogramMetricFamily(STEP_TOKENS[0], STEP_TOKENS[1], labels=["decoding"])
    for kind, label in (("decoding", "true"), ("idle", "false")):
        h = hist[kind]
        buckets = [(str(float(b)), c) for b, c in zip(hist["bounds"], h["buckets"], strict=True)]
        family.add_metric([label], buckets + [("+Inf", h["count"])], sum_value=h["sum"])
    return family


def step_seconds_families(hist: dict):
    durations = HistogramMetricFamily(STEP_SECONDS[0], STEP_SECONDS[1], labels=["kind"])
    host = CounterMetricFamily(HOST_SECONDS[0], HOST_SECONDS[1], labels=["kind"])
    longest = GaugeMetricFamily(MAX_SECONDS[0], MAX_SECONDS[1], labels=["kind"])
    for kind, h in hist.items():
        if kind == "bounds":
            continue
        buckets = [(str(float(b)), c) for b, c in zip(hist["bounds"], h["buckets"], strict=True)]
        durations.add_metric([kind], buckets + [("+Inf", h["count"])], sum_value=h["sum"])
        host.add_metric([kind], h["host_sum"])
        longest.add_metric([kind], h["max"])
    return durations, host, longest


LOOP_LAG = ("server_event_loop_lag_seconds", "How late the server's event loop woke for a timer due every "
            "20 ms: a late loop delays every stream's tokens at once, whatever the engine's steps took.")


def loop_lag_family(lag: Histogram) -> HistogramMetricFamily:
    family = HistogramMetricFamily(LOOP_LAG[0], LOOP_LAG[1])
    buckets = [(str(float(b)), c) for b, c in zip(lag.bounds, lag.cumulative(), strict=True)]
    family.add_metric([], buckets + [("+Inf", lag.count)], sum_value=lag.sum)
    return family


def make_registry(state) -> CollectorRegistry:
    """The engine's metrics, and the process's own (process_resident_memory_bytes, CPU seconds,
    open files; read from /proc, so exported on Linux only)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(state))
    ProcessCollector(registry=registry)
    return registry
