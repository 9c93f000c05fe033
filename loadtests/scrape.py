"""Scrapes a server's Prometheus `/metrics` while a load runs, and checks it ends idle."""

from __future__ import annotations

import threading
import time

import httpx

from poot.conformance import prometheus
from poot.loadtests.keys import headers

# Series shown in reports (names as in docs/contracts.md). Counters are stored under their
# sample names (with _total), gauges as they are.
TRACKED = ("engine_requests_running", "engine_requests_waiting", "kv_blocks_in_use", "kv_blocks_reserved",
           "kv_blocks_total", "kv_blocks_cached", "prefix_cache_hit_rate", "engine_steps_total",
           "generation_tokens_total", "prompt_tokens_total", "spec_drafted_tokens_total",
           "spec_accepted_tokens_total", "engine_compiles", "prefix_cache_queried_tokens_total",
           "prefix_cache_hit_tokens_total", "process_resident_memory_bytes")


def fetch_samples(url: str, client: httpx.Client | None = None, timeout: float = 2.0,
                  api_key: str | None = None) -> prometheus.Samples | None:
    """One scrape (with the key, for a server whose /metrics needs it), as the suite reads it;
    None when the server has no /metrics or does not answer."""
    try:
        if client is None:
            r = httpx.get(url.rstrip("/") + "/metrics", timeout=timeout, headers=headers(api_key))
        else:
            r = client.get(url.rstrip("/") + "/metrics", timeout=timeout)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    try:
        return prometheus.parse(r.text)
    except prometheus.MetricsFormatError:
        return None


def fetch(url: str, client: httpx.Client | None = None, timeout: float = 2.0,
          api_key: str | None = None) -> dict[str, float] | None:
    """One scrape with flat keys (prometheus.flat: `name{a="x"}`), for reports that are JSON."""
    samples = fetch_samples(url, client, timeout, api_key)
    return None if samples is None else prometheus.flat(samples)


class Scraper:
    """Background thread sampling /metrics every `interval` seconds (bounded by `max_samples`)."""

    def __init__(self, url: str, interval: float = 0.5, max_samples: int = 20000, api_key: str | None = None):
        self.url = url
        self._headers = headers(api_key)
        self.interval = interval
        self.max_samples = max_samples
        self.samples: list[dict] = []   # {"t": wall time, metric: value, ...}
        self.available: bool | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="poot-scrape", daemon=True)

    def start(self) -> Scraper:
        self._thread.start()
        return self

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.samples

    def _run(self) -> None:
        with httpx.Client(headers=self._headers) as client:
            misses = 0
            while not self._stop.is_set() and len(self.samples) < self.max_samples:
                t = time.time()
                m = fetch(self.url, client)
                if m is None:
                    misses += 1
                    if self.available is None and misses >= 3:
                        self.available = False
                        return  # no /metrics here: stop asking
                else:
                    self.available = True
                    row = {"t": t}
                    row.update({k: v for k, v in m.items() if k.split("{")[0] in TRACKED})
                    self.samples.append(row)
                self._stop.wait(self.interval)


def wait_idle(url: str, timeout: float = 15.0, interval: float = 0.25, api_key: str | None = None) -> dict:
    """Polls /metrics until no request runs or waits and no KV block is reserved.

    Returns {"ok": bool | None, "waited_s", "last": {...}}; ok is None without /metrics."""
    start = time.time()
    last = None
    with httpx.Client(headers=headers(api_key)) as client:
        while True:
            m = fetch(url, client)
            if m is None and last is None and time.time() - start > 2.0:
                return {"ok": None, "waited_s": time.time() - start, "last": None,
                        "reason": "no /metrics endpoint"}
            if m is not None:
                last = {k: m.get(k) for k in ("engine_requests_running", "engine_requests_waiting",
                                              "kv_blocks_reserved", "kv_blocks_in_use")}
                if (m.get("engine_requests_running", 0) == 0 and m.get("engine_requests_waiting", 0) == 0
                        and m.get("kv_blocks_reserved", 0) == 0):
                    return {"ok": True, "waited_s": time.time() - start, "last": last}
            if time.time() - start > timeout:
                if last is None:
                    return {"ok": None, "waited_s": time.time() - start, "last": None,
                            "reason": "no /metrics endpoint"}
                return {"ok": False, "waited_s": time.time() - start, "last": last}
            time.sleep(interval)


def delta(samples: list[dict], name: str) -> float | None:
    vals = [s[name] for s in samples if name in s]
    return (vals[-1] - vals[0]) if len(vals) >= 2 else None
