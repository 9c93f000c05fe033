"""Prefix cache benchmark: time to first token with a 1,024-token shared system prompt, cold
(nothing cached) against cached (the system prompt's blocks registered by an earlier request).

Through the Engine loop on the NumPy driver, one request at a time, greedy. Each repeat uses
a fresh system prompt (cold), then the same system prompt with another question (cached).
TTFT is the time from submit to the first Tokens event, driving the loop by hand: CPU time of
the loop's thread (steady on a shared machine) and wall time beside it.

    python benchmarks/bench_prefix.py                      # synthetic, then SmolLM2 if it loads
    python benchmarks/bench_prefix.py --model synthetic
    python benchmarks/bench_prefix.py --model default      # SmolLM2 (load_model(None)) only
    python benchmarks/bench_prefix.py --repeats 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SYSTEM_TOKENS = 1024
TARGET = 0.05  # cached TTFT at most this share of cold TTFT


def load(spec: str):
    from poot.engine.models import load_model
    from poot.engine.models.synthetic import synthetic_llama

    if spec == "synthetic":
        return synthetic_llama(0, max_positions=2048)  # room for the 1,024-token system prompt
    return load_model(None if spec == "default" else spec)


def system_prompt(model, salt: int) -> list[int]:
    text = (f"[{salt}] You are a careful assistant for the harbour office of a small town. Answer questions "
            "about ferry times, berths, fees and the weather at sea, politely and briefly. ")
    ids = model.encode_prompt(text)
    while len(ids) < SYSTEM_TOKENS:
        ids += model.tokenizer.encode(text)
    return ids[:SYSTEM_TOKENS]


def ttft(engine, prompt: list[int]) -> tuple[float, float, int]:
    """(CPU seconds, wall seconds, cached tokens) of one request's first token."""
    from poot.engine import SamplingParams

    events = []
    c0, t0 = time.process_time(), time.perf_counter()
    engine.submit(prompt, SamplingParams(max_tokens=1, temperature=0.0), events.append)
    while not any(type(e).__name__ == "Tokens" for e in events):
        engine.iteration()
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    while engine.in_flight():
        engine.iteration()
    (end,) = [e for e in events if type(e).__name__ == "Finished"]
    return cpu, wall, end.cached_tokens


def bench(spec: str, repeats: int) -> dict:
    from poot.engine import Engine

    model = load(spec)
    engine = Engine.create(model, backend="numpy")
    # A short question: the benchmark is about the system prompt; every question token is computed.
    question = lambda i: model.tokenizer.encode(f" Q{i}: first ferry?")  # noqa: E731
    ttft(engine, system_prompt(model, -1) + question(0))  # warm up
    cold, cached, hits = [], [], []
    for i in range(repeats):
        system = system_prompt(model, i)
        *t, c = ttft(engine, system + question(i))
        cold.append(t)
        assert c == 0, "the cold request hit the cache"
        before = engine.metrics()
        *t, c = ttft(engine, system + question(i + 1000))
        after = engine.metrics()
        cached.append(t)
        hits.append((after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"])
                    / (after["prefix_cache_queried_tokens"] - before["prefix_cache_queried_tokens"]))
    m = engine.metrics()
    row = {"model": model.name, "prompt_tokens": SYSTEM_TOKENS + len(question(0)),
           "cold_ms": 1000 * statistics.median(c for c, _ in cold),
           "cached_ms": 1000 * statistics.median(c for c, _ in cached),
           "cold_wall_ms": 1000 * statistics.median(w for _, w in cold),
           "cached_wall_ms": 1000 * statistics.median(w for _, w in cached),
           "cached_hit_rate": statistics.median(hits), "overall_hit_rate": m["prefix_cache_hit_rate"],
           "registered_tokens": m["prefix_registered_tokens"], "plan": engine.plan.as_dict()}
    row["ratio"] = row["cached_ms"] / row["cold_ms"]
    row["wall_ratio"] = row["cached_wall_ms"] / row["cold_wall_ms"]
    print(f"{model.name}: prompt {row['prompt_tokens']} tokens (system {SYSTEM_TOKENS}); token budget "
          f"{engine.plan.token_budget}; median of {repeats}: TTFT (CPU) cold {row['cold_ms']:.1f} ms, cached "
          f"{row['cached_ms']:.1f} ms -> {row['ratio']:.3f}x (target <= {TARGET}; wall {row['cold_wall_ms']:.1f} "
          f"-> {row['cached_wall_ms']:.1f} ms, {row['wall_ratio']:.3f}x); hit rate of the cached "
          f"requests {row['cached_hit_rate']:.3f}, prefix_cache_hit_rate overall {row['overall_hit_rate']:.3f}",
          flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="synthetic, default (SmolLM2), or a load_model path; "
                    "omitted: synthetic, then SmolLM2 when it loads")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for spec in [args.model] if args.model else ["synthetic", "default"]:
        try:
            rows.append(bench(spec, args.repeats))
        except Exception as e:  # the default model's package may be missing
            if args.model:
                raise
            print(f"{spec}: skipped ({type(e).__name__}: {e})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
