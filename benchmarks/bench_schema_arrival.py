"""What running streams feel when a schema slow to compile arrives.

Starts poot-serve (or takes --base-url), runs N plain streams (greedy, ignore_eos), and while
they run sends a streamed chat whose json_schema is documents.slow_schema (about 750 KB, a new
one each time). For each try it prints the running streams' median gap between tokens, their
longest gap while the slow request was in the server, the longest gap of the same streams
over as long a window with nothing arriving, and how long the slow request took to its
first token and its end. The CPU, its flags and the load average come with the figures.

    python benchmarks/bench_schema_arrival.py                       # poot-serve, SmolLM2, 8 streams
    python benchmarks/bench_schema_arrival.py --streams 8 --tries 3 --base-url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import string
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_startup import cpu, free_port, load_average, poot_serve  # noqa: E402
from poot.conformance.documents import slow_schema  # noqa: E402


@dataclass
class Reader:
    """One plain stream, read on its own thread: the moment each event arrived."""

    host: str
    port: int
    body: dict
    times: list[float] = field(default_factory=list)

    def run(self) -> None:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=600)
        conn.request("POST", "/v1/completions", json.dumps(self.body), {"content-type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"a plain stream answered {response.status}: {response.read()[:300]!r}")
        while line := response.readline():
            if line.startswith(b"data:"):
                self.times.append(time.monotonic())

    def gaps(self, since: float, until: float) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:], strict=False) if b > since and a < until]


def slow_request(host: str, port: int, model: str) -> tuple[float, float]:
    """Sends the slow schema, streamed; seconds to its first event and to its end."""
    tag = "".join(random.choices(string.ascii_lowercase, k=6))
    body = {"model": model, "messages": [{"role": "user", "content": "Reply with a JSON object."}], "max_tokens": 8,
            "stream": True, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "slow", "schema": slow_schema(tag)}}}
    sent = time.monotonic()
    conn = http.client.HTTPConnection(host, port, timeout=600)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"the slow schema answered {response.status}: {response.read()[:300]!r}")
    first = None
    while line := response.readline():
        if first is None and line.startswith(b"data:"):
            first = time.monotonic()
    return (first or time.monotonic()) - sent, time.monotonic() - sent


def one_try(host: str, port: int, model: str, streams: int, max_tokens: int) -> dict:
    readers = [Reader(host, port, {"model": model, "prompt": f"Story {i} {random.random()}:", "max_tokens": max_tokens,
                                   "temperature": 0, "ignore_eos": True, "stream": True}) for i in range(streams)]
    threads = [threading.Thread(target=r.run, daemon=True) for r in readers]
    for t in threads:
        t.start()
    while min(len(r.times) for r in readers) < 10:  # every stream running
        time.sleep(0.05)
    quiet_from = time.monotonic()
    sent = quiet_from + 2.0
    time.sleep(2.0)  # a window with nothing arriving, as long as the slow request usually takes
    first, took = slow_request(host, port, model)
    for t in threads:
        t.join()
    quiet = [g for r in readers for g in r.gaps(quiet_from, sent)]
    during = [g for r in readers for g in r.gaps(sent, sent + took)]
    every = [g for r in readers for g in r.gaps(0, float("inf"))]
    return {"first_s": first, "took_s": took, "median_ms": statistics.median(every) * 1e3,
            "during_max_ms": max(during) * 1e3 if during else float("nan"),
            "quiet_max_ms": max(quiet) * 1e3 if quiet else float("nan")}


def serve(model: str | None) -> tuple[subprocess.Popen, int]:
    port = free_port()
    args = [*poot_serve(), "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    if model:
        args += ["--model", model]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    began = time.monotonic()
    while time.monotonic() - began < 600:
        if proc.poll() is not None:
            raise RuntimeError(f"poot-serve exited with {proc.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc, port
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("poot-serve was not ready within 600 s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", help="a running server (default: start poot-serve)")
    ap.add_argument("--model", help="poot-serve's --model (default: its own, SmolLM2)")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=600, help="each plain stream's length")
    ap.add_argument("--tries", type=int, default=3)
    args = ap.parse_args()
    proc = None
    if args.base_url:
        url = urlsplit(args.base_url)
        host, port = url.hostname, url.port or 80
    else:
        proc, port = serve(args.model)
        host = "127.0.0.1"
    try:
        conn = http.client.HTTPConnection(host, port, timeout=10)
        conn.request("GET", "/v1/models")
        model = json.loads(conn.getresponse().read())["data"][0]["id"]
        name, flags, cores = cpu()
        print(f"{name}; flags {' '.join(flags)}; {cores} cores; load average {load_average()}; model {model}; "
              f"{args.streams} streams of {args.max_tokens} tokens")
        print("| try | slow schema: first token | end | running streams: median gap | longest gap while it was "
              "in the server | longest gap, 2 s before it |")
        print("|---|---|---|---|---|---|")
        for i in range(args.tries):
            r = one_try(host, port, model, args.streams, args.max_tokens)
            print(f"| {i + 1} | {r['first_s']:.2f} s | {r['took_s']:.2f} s | {r['median_ms']:.1f} ms | "
                  f"{r['during_max_ms']:.0f} ms ({r['during_max_ms'] / r['median_ms']:.1f}x) | "
                  f"{r['quiet_max_ms']:.0f} ms ({r['quiet_max_ms'] / r['median_ms']:.1f}x) |", flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
