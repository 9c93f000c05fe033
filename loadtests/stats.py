"""Pure statistics over recorded streams: per-request timings, token-level gaps, goodput.

Everything here works on plain data (dicts and lists of floats) so it can be tested against
recorded or synthetic timelines without a server.

Vocabulary (times in seconds, all from one monotonic clock of one client process):
- `sent`: when the request left the client. `scheduled`: when the workload said it should
  arrive (open-loop); `sent - scheduled` is the client's own lag.
- `chunks`: arrival time of every streamed chunk that carried output text, relative to `sent`.
  A chunk is one token on servers that stream token by token; a server that commits several
  tokens per step (speculative decoding) sends them in one chunk.
- TTFT: first chunk with text. Gap (inter-token latency, ITL): difference between successive
  chunks of one request. TPOT: (e2e - ttft) / (output_tokens - 1), the mean time per token
  after the first. E2E: last byte of the stream.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

PERCENTILES = (50, 90, 95, 99)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default method); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    if len(xs) == 1:
        return float(xs[0])
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


def describe(values: Sequence[float], pcts: Iterable[float] = PERCENTILES) -> dict:
    """count, mean, min, max and the given percentiles (keys p50, p90 ...), None when empty."""
    vals = [float(v) for v in values]
    out: dict = {"count": len(vals)}
    out["mean"] = sum(vals) / len(vals) if vals else None
    out["min"] = min(vals) if vals else None
    out["max"] = max(vals) if vals else None
    for q in pcts:
        out[f"p{q:g}"] = percentile(vals, q)
    return out


def gaps(times: Sequence[float]) -> list[float]:
    """Differences between successive arrival times."""
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def gap_ratio(g: Sequence[float], clump: float = 0.25) -> dict | None:
    """One stream's largest gap over its typical gap: the median, or the mean when the median is
    under `clump` times the mean (chunks read in clumps give many gaps near 0, and a median of
    those says nothing). None under three gaps or when every gap is 0."""
    if len(g) < 3 or max(g) <= 0:
        return None
    med = percentile(g, 50)
    mean = sum(g) / len(g)
    typical, basis = med, "median"
    if med < clump * mean:
        typical, basis = mean, "mean"
    return {"ratio": max(g) / typical, "max_gap": max(g), "typical_gap": typical, "median_gap": med,
            "basis": basis}


@dataclass(frozen=True)
class Slo:
    """Objectives for goodput; None means not constrained."""

    ttft_s: float | None = None
    gap_p99_s: float | None = None

    def as_dict(self) -> dict:
        return {"ttft_ms": None if self.ttft_s is None else self.ttft_s * 1e3,
                "gap_p99_ms": None if self.gap_p99_s is None else self.gap_p99_s * 1e3}


def request_metrics(rec: dict) -> dict:
    """Derived timings of one recorded request (see module doc). Missing values are None.

    `rec` holds: status ("ok" | "error" | "disconnected"), chunks (list of offsets from send),
    end (offset of the end of the stream), completion_tokens (usage; may be None).
    """
    chunks = list(rec.get("chunks") or [])
    ttft = chunks[0] if chunks else None
    g = gaps(chunks)
    n_out = rec.get("completion_tokens")
    if n_out is None:
        n_out = len(chunks)
    end = rec.get("end")
    tpot = None
    if ttft is not None and end is not None and n_out and n_out > 1:
        last = chunks[-1]
        tpot = (last - ttft) / (n_out - 1)
    return {
        "ttft": ttft,
        "e2e": end,
        "gaps": g,
        "gap_p50": percentile(g, 50),
        "gap_p99": percentile(g, 99),
        "gap_max": max(g) if g else None,
        "tpot": tpot,
        "output_tokens": n_out,
        "tokens_per_s": (n_out / end) if (end and n_out) else None,
    }


def meets_slo(m: dict, slo: Slo) -> bool:
    """A request is good when it finished and every given objective holds.

    A request with a single chunk has no gaps and passes the gap objective trivially."""
    if m.get("status", "ok") != "ok" or m["ttft"] is None:
        return False
    if slo.ttft_s is not None and m["ttft"] > slo.ttft_s:
        return False
    if slo.gap_p99_s is not None and m["gap_p99"] is not None and m["gap_p99"] > slo.gap_p99_s:
        return False
    return True


def summarize(records: Sequence[dict], slo: Slo = Slo(), duration: float | None = None) -> dict:
    """Aggregate view of a run. `duration` defaults to first send .. last end."""
    per = []
    for r in records:
        m = request_metrics(r)
        m["status"] = r.get("status", "ok")
        per.append(m)
    ok = [m for m, r in zip(per, records, strict=True) if r.get("status") == "ok"]
    errors = [r for r in records if r.get("status") == "error"]
    disconnected = [r for r in records if r.get("status") == "disconnected"]
    if duration is None:
        starts = [r["t_sent"] for r in records if r.get("t_sent") is not None]
        ends = [r["t_sent"] + r["end"] for r in records if r.get("t_sent") is not None and r.get("end") is not None]
        duration = (max(ends) - min(starts)) if starts and ends else 0.0
    out_tokens = sum(m["output_tokens"] or 0 for m in per)
    all_gaps = [g for m in ok for g in m["gaps"]]
    lags = [r["t_sent"] - r["t_scheduled"] for r in records
            if r.get("t_scheduled") is not None and r.get("t_sent") is not None]
    good = sum(1 for m in per if meets_slo(m, slo))  # clients that left on purpose are not counted
    error_kinds: dict[str, int] = {}
    for r in errors:
        key = str(r.get("error") or "error")[:80]
        error_kinds[key] = error_kinds.get(key, 0) + 1
    return {
        "requests": len(records),
        "ok": len(ok),
        "errors": len(errors),
        "disconnected": len(disconnected),
        "error_kinds": error_kinds,
        "duration_s": duration,
        "request_throughput": (len(ok) / duration) if duration else None,
        "output_tokens": out_tokens,
        "output_throughput": (out_tokens / duration) if duration else None,
        "ttft": describe([m["ttft"] for m in ok if m["ttft"] is not None]),
        "tpot": describe([m["tpot"] for m in ok if m["tpot"] is not None]),
        "e2e": describe([m["e2e"] for m in ok if m["e2e"] is not None]),
        "itl": describe(all_gaps),
        "req_gap_p99": describe([m["gap_p99"] for m in ok if m["gap_p99"] is not None]),
        "req_gap_max": describe([m["gap_max"] for m in ok if m["gap_max"] is not None]),
        "req_tokens_per_s": describe([m["tokens_per_s"] for m in ok if m["tokens_per_s"]]),
        "schedule_lag": describe(lags),
        # The server's split of time to first token (seconds), where it reports one.
        "queue_time": describe([r["queued_ms"] / 1e3 for r in records
                                if r.get("status") == "ok" and r.get("queued_ms") is not None]),
        "prefill_time": describe([r["prefill_ms"] / 1e3 for r in records
                                  if r.get("status") == "ok" and r.get("prefill_ms") is not None]),
        "slo": slo.as_dict(),
        "goodput": (good / (len(records) - len(disconnected))) if len(records) > len(disconnected) else None,
        "good_requests": good,
    }


def burst_interference(records: Sequence[dict], window: tuple[float, float] | None = None,
                       limit: float = 3.0) -> dict:
    """How much a burst of long prompts stalled streams that were already decoding.

    For every request of kind "decode" that received tokens both before and after the start of
    the burst, compares its largest gap with its median gap (or, when tokens arrived in clumps
    so that the median is under a quarter of the mean, with its mean gap before the burst). `window` is (start, end) in the
    client clock; by default it spans the sends of the "burst" requests to their first tokens.
    The check holds when every stream's max/median ratio is within `limit`.
    """
    burst = [r for r in records if r.get("kind") == "burst" and r.get("t_sent") is not None]
    if window is None:
        if not burst:
            return {"streams": 0, "ok": None, "reason": "no burst requests recorded"}
        start = min(r["t_sent"] for r in burst)
        firsts = [r["t_sent"] + r["chunks"][0] for r in burst if r.get("chunks")]
        end = max(firsts) if firsts else start
        window = (start, end)
    start, end = window
    rows = []
    for r in records:
        if r.get("kind") != "decode" or not r.get("chunks") or r.get("t_sent") is None:
            continue
        abs_t = [r["t_sent"] + c for c in r["chunks"]]
        if not (abs_t[0] < start and abs_t[-1] > start):
            continue  # not decoding when the burst arrived
        g = gaps(abs_t)
        if len(g) < 3:
            continue
        med = percentile(g, 50)
        mx = max(g)
        before = [b - a for a, b in zip(abs_t, abs_t[1:], strict=False) if b < start]
        mean_before = (sum(before) / len(before)) if before else sum(g) / len(g)
        # When the client reads several tokens per network read the median gap is ~0 and says
        # nothing; then the mean gap before the burst is the typical gap instead.
        typical, basis = med, "median"
        if mean_before > 0 and med < 0.25 * mean_before:
            typical, basis = mean_before, "mean before burst"
        in_window = [b - a for a, b in zip(abs_t, abs_t[1:], strict=False) if b >= start and a <= end]
        rows.append({"id": r.get("id"), "median_gap": med, "mean_gap_before": mean_before,
                     "typical_gap": typical, "basis": basis, "max_gap": mx,
                     "max_gap_in_burst": max(in_window) if in_window else None,
                     "ratio": (mx / typical) if typical else math.inf})
    worst = max(rows, key=lambda x: x["ratio"]) if rows else None
    return {
        "window": [start, end],
        "streams": len(rows),
        "limit": limit,
        "worst_ratio": worst["ratio"] if worst else None,
        "worst": worst,
        "median_ratio": percentile([x["ratio"] for x in rows], 50),
        "ok": (worst["ratio"] <= limit) if worst else None,
        "rows": rows,
    }


def token_throughput_series(records: Sequence[dict], t0: float, bin_s: float = 1.0) -> tuple[list[float], list[float]]:
    """Output tokens per second in bins of `bin_s`, from chunk arrivals.

    When the server reported more tokens than chunks (several tokens per chunk), each chunk is
    weighted so a request's chunks add up to its completion tokens."""
    counts: dict[int, float] = {}
    for r in records:
        chunks = r.get("chunks") or []
        if not chunks or r.get("t_sent") is None:
            continue
        n = r.get("completion_tokens") or len(chunks)
        w = n / len(chunks)
        for c in chunks:
            b = int((r["t_sent"] + c - t0) // bin_s)
            counts[b] = counts.get(b, 0.0) + w
    if not counts:
        return [], []
    last = max(counts)
    xs = [(b + 0.5) * bin_s for b in range(0, last + 1)]
    ys = [counts.get(b, 0.0) / bin_s for b in range(0, last + 1)]
    return xs, ys


def cdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    xs = sorted(values)
    n = len(xs)
    return xs, [(i + 1) / n for i in range(n)]
