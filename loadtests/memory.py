"""A server's resident memory over a run: sampled from /proc or /metrics, with its slope.

The source is /proc/PID/status (VmRSS, of the process and every process below it) when the
run started the server and knows its process, else `process_resident_memory_bytes` on the server's /metrics (prometheus_client's process
collector, which poot-serve registers). The slope is the least-squares line through the
samples after warm-up, in MB (10^6 bytes) per minute.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence

from poot.loadtests import scrape

RSS_METRIC = "process_resident_memory_bytes"


def proc_rss_bytes(pid: int) -> int | None:
    """VmRSS of a live process, from /proc (Linux); None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def descendants(pid: int) -> list[int]:
    """The live processes below `pid` (its children, theirs, ...), from /proc; [] where it
    cannot be read."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                stat = f.read()
            # The name, in parentheses, may hold spaces and parentheses itself: the parent's
            # pid is the second field after its last closing one.
            parent = int(stat[stat.rindex(")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], list(children.get(pid, ()))
    while todo:
        child = todo.pop()
        found.append(child)
        todo.extend(children.get(child, ()))
    return found


def tree_rss_bytes(pid: int) -> int | None:
    """VmRSS of a live process and every process below it, summed: a server that runs its
    engine in a process of its own (vLLM's engine core) holds its memory there. Pages two of
    them share count in each. None when the process itself cannot be read."""
    own = proc_rss_bytes(pid)
    if own is None:
        return None
    return own + sum(v for child in descendants(pid) if (v := proc_rss_bytes(child)) is not None)


def metrics_rss_bytes(url: str, api_key: str | None = None) -> int | None:
    m = scrape.fetch(url, api_key=api_key)
    if m is None or RSS_METRIC not in m:
        return None
    return int(m[RSS_METRIC])


class RssSampler:
    """Background thread sampling a server's RSS every `interval` seconds.

    `samples` holds (wall time, bytes). `source` says where they came from: "proc", "metrics",
    or None when neither gave a value."""

    def __init__(self, pid: int | None = None, url: str | None = None, interval: float = 2.0,
                 max_samples: int = 100000, api_key: str | None = None):
        self.pid = pid
        self.url = url
        self.api_key = api_key  # for a server whose /metrics needs it
        self.interval = interval
        self.max_samples = max_samples
        self.samples: list[tuple[float, int]] = []
        self.source: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="poot-rss", daemon=True)

    def read(self) -> int | None:
        if self.pid is not None:
            v = tree_rss_bytes(self.pid)
            if v is not None:
                self.source = "proc"
                return v
        if self.url is not None:
            v = metrics_rss_bytes(self.url, self.api_key)
            if v is not None:
                self.source = "metrics"
                return v
        return None

    def sample(self) -> int | None:
        """One sample now (also called at marks: start, end of warm-up, end)."""
        v = self.read()
        if v is not None and len(self.samples) < self.max_samples:
            self.samples.append((time.time(), v))
        return v

    def start(self) -> RssSampler:
        self.sample()
        self._thread.start()
        return self

    def stop(self) -> list[tuple[float, int]]:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sample()
        return self.samples

    def _run(self) -> None:
        misses = 0
        while not self._stop.wait(self.interval):
            if self.sample() is None:
                misses += 1
                if not self.samples and misses >= 3:
                    return  # no source at all: stop asking


def slope_per_minute(points: Sequence[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, bytes) points, in MB per minute; None under 3 points
    or when all points share one time."""
    if len(points) < 3:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    sxx = sum((t - mt) ** 2 for t, _ in points)
    if sxx == 0:
        return None
    sxy = sum((t - mt) * (v - mv) for t, v in points)
    return sxy / sxx * 60 / 1e6


def summarize(samples: Sequence[tuple[float, int]], warmup_end: float, load_end: float | None = None,
              limit_mb_per_min: float = 1.0, min_window_s: float = 600.0, source: str | None = None) -> dict:
    """RSS at start, after warm-up and at the end, and the slope after warm-up.

    The flatness check holds when the slope over [warmup_end, load_end] is under
    `limit_mb_per_min`; it is judged (ok True or False) only when that window spans at least
    `min_window_s`, since a shorter run cannot tell a leak of that size from allocator noise.
    The slope is reported either way."""
    if not samples:
        return {"available": False, "ok": None, "source": source,
                "text": "no RSS source: neither /proc/PID (the run did not start the server) nor "
                        f"{RSS_METRIC} on /metrics"}
    t0 = samples[0][0]
    end = load_end if load_end is not None else samples[-1][0]
    after = [(t, v) for t, v in samples if warmup_end <= t <= end]
    at_warm = min(samples, key=lambda s: abs(s[0] - warmup_end))
    slope = slope_per_minute([(t - t0, v) for t, v in after])
    window = (after[-1][0] - after[0][0]) if len(after) >= 2 else 0.0
    mb = lambda v: v / 1e6  # noqa: E731
    out = {"available": True, "source": source, "samples": len(samples), "samples_after_warmup": len(after),
           "start_mb": mb(samples[0][1]), "warmup_mb": mb(at_warm[1]), "end_mb": mb(samples[-1][1]),
           "peak_mb": mb(max(v for _, v in samples)), "warmup_s": warmup_end - t0, "window_s": window,
           "slope_mb_per_min": slope, "limit_mb_per_min": limit_mb_per_min, "min_window_s": min_window_s}
    desc = (f"RSS {out['start_mb']:.1f} MB at start, {out['warmup_mb']:.1f} MB after warm-up "
            f"({out['warmup_s']:.0f} s), {out['end_mb']:.1f} MB at the end; slope after warm-up ")
    if slope is None:
        out["ok"] = None
        out["text"] = desc + "unknown (under 3 samples)"
    elif window < min_window_s:
        out["ok"] = None
        out["text"] = desc + (f"{slope:+.2f} MB/min over {window:.0f} s (reported, not judged: the bound "
                              f"{limit_mb_per_min} MB/min is judged over at least {min_window_s:.0f} s)")
    else:
        out["ok"] = slope < limit_mb_per_min
        out["text"] = desc + f"{slope:+.2f} MB/min over {window:.0f} s (bound {limit_mb_per_min} MB/min)"
    return out
