"""What a server's /metrics says about one benchmark level: the change of every counter, and
poot's step durations by kind with quantiles read off the histogram's buckets."""

from __future__ import annotations

from poot.conformance import prometheus

STEP_KINDS = ("decode", "mixed", "prefill")


def bucket_quantile(buckets: list[tuple[float, float]], q: float, largest: float | None = None) -> float | None:
    """Prometheus-style quantile from cumulative (upper bound, count) buckets, linear within a
    bucket; the last finite bound when it falls in +Inf; never above `largest` (a known maximum)."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    prev_bound, prev_count = 0.0, 0.0
    value = prev_bound
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                value = prev_bound
            elif count == prev_count:
                value = bound
            else:
                value = prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
            break
        prev_bound, prev_count = bound, count
    return min(value, largest) if largest else value


def metrics_delta(before: dict | None, after: dict | None) -> dict:
    """What /metrics says about one level: poot's step durations by kind (count, mean, p50,
    p99 from the histogram's buckets, the longest since start) and compiles; every *_total
    series's change (llama.cpp's llamacpp:* counters included)."""
    if before is None or after is None:
        return {"available": False}
    out: dict = {"available": True, "totals": {}}
    for key, v in after.items():
        if key.endswith("_total") or "_total{" in key:
            out["totals"][key] = v - before.get(key, 0.0)
    if "engine_compiles" in after:
        out["compiles"] = {"before": before.get("engine_compiles"), "after": after["engine_compiles"]}
    steps = {}
    for kind in STEP_KINDS:
        count_key = f'engine_step_duration_seconds_count{{kind="{kind}"}}'
        if count_key not in after:
            continue
        n = after[count_key] - before.get(count_key, 0.0)
        total = (after.get(f'engine_step_duration_seconds_sum{{kind="{kind}"}}', 0.0)
                 - before.get(f'engine_step_duration_seconds_sum{{kind="{kind}"}}', 0.0))
        buckets = []
        for key, v in after.items():
            name, labels = prometheus.split_key(key)
            if name == "engine_step_duration_seconds_bucket" and labels.get("kind") == kind:
                buckets.append((float(labels["le"]), v - before.get(key, 0.0)))
        max_key = f'engine_step_duration_max_seconds{{kind="{kind}"}}'
        longest = after.get(max_key)
        steps[kind] = {"count": n, "mean_s": (total / n) if n else None,
                       "p50_s": bucket_quantile(buckets, 0.5, longest) if n else None,
                       "p99_s": bucket_quantile(buckets, 0.99, longest) if n else None,
                       "max_since_start_s": after.get(max_key),
                       "max_grew": (after.get(max_key, 0.0) > before.get(max_key, 0.0))}
    if steps:
        out["steps"] = steps
    return out


