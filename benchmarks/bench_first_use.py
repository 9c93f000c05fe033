"""Waits that have nothing to do with load: the first request after start-up, and a prefix-cache hit.

    .venv/bin/python benchmarks/bench_first_use.py                 # poot-serve, default model
    .venv/bin/python benchmarks/bench_first_use.py --model synthetic --repeats 5
    .venv/bin/python benchmarks/bench_first_use.py --url http://127.0.0.1:8000   # no start-up part

1. First use: a server is started, and as soon as /health answers ok the same short streamed
   request is sent twice, one after the other. Printed: both latencies (to the last token) and
   first / second (target: at most 1.2; anything built or first touched on first use shows up
   here). Repeated over `--starts` fresh servers.
2. Prefix hit: a long prompt (about `--prefix-tokens` tokens) is sent once so its blocks are
   registered; then, alternating, the same prompt with a few new tokens at its end (a hit:
   everything but those few is cached) and a fresh short prompt, `--repeats` times each.
   Printed: TTFT medians and hit / short (target: at most 1.5; a hit should cost what its few
   uncached tokens cost), and the cached-token counts the server reported.

Ratios are measured in one run, next to each other, so a busy machine moves both sides.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from poot.loadtests.server_proc import BundledServer  # noqa: E402
from poot.loadtests.sse import SseParser  # noqa: E402

SENTENCE = ("The river carried the light of the morning past the old stone mill, and the children "
            "who lived by the water counted the boats that went down to the market. ")


def streamed(client: httpx.Client, url: str, prompt: str, max_tokens: int) -> dict:
    """One streamed completion: TTFT, total time, and the usage the server reported."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    first, usage = None, {}
    parser = SseParser()
    with client.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        for chunk in r.iter_bytes():
            for payload in parser.feed(chunk):
                if payload == "[DONE]":
                    continue
                event = json.loads(payload)
                if first is None and event.get("choices") and event["choices"][0].get("text"):
                    first = time.perf_counter() - sent
                usage = event.get("usage") or usage
    return {"ttft": first, "total": time.perf_counter() - sent, "usage": usage}


def first_use(model: str, starts: int) -> list[tuple[float, float]]:
    pairs = []
    for i in range(starts):
        with BundledServer(model, startup_timeout=300) as url, httpx.Client() as client:
            a = streamed(client, url, "Tell me about rivers.", 16)["total"]
            b = streamed(client, url, "Tell me about rivers.", 16)["total"]
        pairs.append((a, b))
        print(f"  start {i + 1}/{starts}: first {a * 1e3:.0f} ms, second {b * 1e3:.0f} ms, "
              f"ratio {a / b:.2f}", flush=True)
    return pairs


def prefix_hit(url: str, prefix_tokens: int, repeats: int) -> dict:
    long_prompt = (SENTENCE * (prefix_tokens // 25 + 1))[: int(prefix_tokens * 4.9)]  # about 4.9 characters a token
    hits, shorts, cached = [], [], []
    with httpx.Client() as client:
        streamed(client, url, long_prompt, 1)  # registers the prompt's blocks
        streamed(client, url, "A warm-up of the short path.", 2)
        for i in range(repeats):
            hit = streamed(client, url, long_prompt + f" Question {i}: why?", 2)
            short = streamed(client, url, f"Question {i}: what is a river made of, mostly?", 2)
            hits.append(hit["ttft"])
            shorts.append(short["ttft"])
            details = hit["usage"].get("prompt_tokens_details") or {}
            cached.append((details.get("cached_tokens"), hit["usage"].get("prompt_tokens")))
            print(f"  {i + 1}/{repeats}: hit {hit['ttft'] * 1e3:.0f} ms ({cached[-1][0]} of {cached[-1][1]} "
                  f"cached), short {short['ttft'] * 1e3:.0f} ms", flush=True)
    return {"hit_ms": [h * 1e3 for h in hits], "short_ms": [s * 1e3 for s in shorts], "cached": cached}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="poot-serve --model (default: SmolLM2)")
    p.add_argument("--url", help="an already running server: only the prefix-hit part runs")
    p.add_argument("--starts", type=int, default=3)
    p.add_argument("--prefix-tokens", type=int, default=900)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args(argv)
    out: dict = {}
    if not a.url:
        print(f"first use: {a.starts} fresh poot-serve --model {a.model}", flush=True)
        pairs = first_use(a.model, a.starts)
        ratios = [x / y for x, y in pairs]
        out["first_use"] = {"first_ms": [x * 1e3 for x, _ in pairs], "second_ms": [y * 1e3 for _, y in pairs],
                            "ratio_median": statistics.median(ratios)}
        print(f"first / second request, median over starts: {statistics.median(ratios):.2f} (target <= 1.2)")
    print(f"prefix hit: a {a.prefix_tokens}-token prompt, then hits and fresh short prompts in turn", flush=True)
    if a.url:
        out["prefix_hit"] = prefix_hit(a.url.rstrip("/"), a.prefix_tokens, a.repeats)
    else:
        with BundledServer(a.model, startup_timeout=300) as url:
            out["prefix_hit"] = prefix_hit(url, a.prefix_tokens, a.repeats)
    hit = statistics.median(out["prefix_hit"]["hit_ms"])
    short = statistics.median(out["prefix_hit"]["short_ms"])
    out["prefix_hit"]["ratio_median"] = hit / short
    print(f"prefix-hit TTFT {hit:.0f} ms / fresh short prompt {short:.0f} ms (medians) = {hit / short:.2f} "
          "(target <= 1.5)")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
