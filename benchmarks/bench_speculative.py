"""Speculative decoding benchmark: output tokens/s with and without the n-gram draft policy.

Two workloads, greedy, through the Engine loop on the NumPy driver:
- quote: "repeat this code with one change" (the answer quotes the prompt);
- free:  open-ended prompts whose answers never quote them.
Each at one row (five prompts, one after another) and at the plan's full rows; ratios are
measured within one run.

    python benchmarks/bench_speculative.py                 # SmolLM2 (load_model(None))
    python benchmarks/bench_speculative.py --model synthetic
    python benchmarks/bench_speculative.py --rows 1 --max-tokens 64 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time

PARAGRAPHS = [
    ("The little red house stood at the end of the long road. Every morning the old man opened the red door, "
     "walked to the garden, and watered the flowers. In the evening he sat on the porch and watched the sun go "
     "down behind the hills.", "red", "blue"),
    ("Our train left the station at nine in the morning. We passed green fields, small villages and a wide "
     "river before the first stop. At noon we ate sandwiches by the window and watched the mountains come "
     "closer.", "train", "bus"),
    ("The baker wakes up at four every day. She mixes flour, water and salt, shapes the dough into long loaves, "
     "and bakes them in a hot stone oven. By seven the shop smells of fresh bread and the first customers are "
     "waiting.", "baker", "cook"),
    ("A small cat lived in the library. It slept on the warm shelves near the window during the day and walked "
     "between the tables at night. The readers liked the cat and brought it milk on Sundays.", "cat", "dog"),
]
CODE = ("def total(values):\n    s = 0\n    for v in values:\n        s = s + v\n    return s\n\n"
        "print(total([1, 2, 3]))\nprint(total([4, 5, 6]))\n")
TOPICS = ["a lighthouse keeper", "the history of bread", "why the sky is blue", "a robot learning to paint",
          "how bees communicate", "a city under the sea", "the rules of chess", "a journey across a desert",
          "the life of a tree", "how volcanoes form", "a detective in Paris", "the first day of school"]


def render(model, text: str) -> list[int]:
    if model.chat_template:
        from jinja2 import Template

        prompt = Template(model.chat_template).render(
            messages=[{"role": "user", "content": text}], add_generation_prompt=True, **model.special_tokens)
        return model.tokenizer.encode(prompt)
    return model.encode_prompt(text)


def prompts(model, workload: str, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        if workload == "quote":  # repeat this text or code with one change
            if i % 5 == 4:
                text = ("Repeat this code with one change: fix the bug.\n\n```python\n"
                        + CODE.replace("s = s + v", "s = s - v").replace("[4, 5, 6]", f"[{i}, {i + 1}]") + "```")
            else:
                para, old, new = PARAGRAPHS[i % len(PARAGRAPHS)]
                para = para if i < len(PARAGRAPHS) else f"Story {i}. " + para
                text = f"Repeat the following text exactly, but change the word '{old}' to '{new}':\n\n{para}"
        else:
            text = f"Write a short paragraph about {TOPICS[i % len(TOPICS)]}. Do not use lists."
        out.append(render(model, text))
    return out


def run_once(engine, batch: list[list[int]], max_tokens: int) -> dict:
    from poot.engine import SamplingParams

    before = dict(engine.metrics())
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    done = []
    for p in batch:
        engine.submit(p, params, lambda e, d=done: d.append(e) if type(e).__name__ == "Finished" else None)
    # prefill first, untimed: the decode phase is what speculation changes
    while any(q.prefilling for q in engine.scheduler.running) or engine.scheduler.waiting or engine._jobs.qsize():
        engine.iteration()
    first = sum(len(q.output) for q in engine.scheduler.running)
    t0, c0 = time.perf_counter(), time.process_time()
    steps = 0
    while engine.in_flight():
        engine.iteration()
        steps += 1
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    after = engine.metrics()
    tokens = sum(e.completion_tokens for e in done) - first
    d = {k: after[k] - before[k] for k in ("spec_drafted_tokens", "spec_accepted_tokens", "spec_rounds")}
    return {"tokens": tokens, "seconds": dt, "wall_tok_s": tokens / dt, "tok_s": tokens / cpu, "steps": steps, **d,
            "acceptance": d["spec_accepted_tokens"] / d["spec_drafted_tokens"] if d["spec_drafted_tokens"] else 0.0,
            "tokens_per_round": ((d["spec_accepted_tokens"] + d["spec_rounds"]) / d["spec_rounds"]
                                 if d["spec_rounds"] else 1.0),
            "tokens_per_step": tokens / steps / len(batch)}


def run_serial(engine, batches: list[list[list[int]]], max_tokens: int) -> dict:
    """run_once over each batch in turn, summed (one row: several prompts one after another,
    so the figure does not rest on one answer)."""
    parts = [run_once(engine, b, max_tokens) for b in batches]
    total = {k: sum(p[k] for p in parts) for k in ("tokens", "seconds", "steps", "spec_drafted_tokens",
                                                   "spec_accepted_tokens", "spec_rounds")}
    cpu = sum(p["tokens"] / p["tok_s"] for p in parts)
    d = total
    return {**total, "tok_s": d["tokens"] / cpu, "wall_tok_s": d["tokens"] / d["seconds"],
            "acceptance": d["spec_accepted_tokens"] / d["spec_drafted_tokens"] if d["spec_drafted_tokens"] else 0.0,
            "tokens_per_round": ((d["spec_accepted_tokens"] + d["spec_rounds"]) / d["spec_rounds"]
                                 if d["spec_rounds"] else 1.0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="load_model spec (default: SmolLM2)")
    ap.add_argument("--rows", default="1,full", help="comma list of row counts; 'full' = the plan's rows")
    ap.add_argument("--workloads", default="quote,free")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--full-max-tokens", type=int, default=48, help="max_tokens at more than 4 rows")
    ap.add_argument("--repeats", type=int, default=3, help="alternating repeats; the best of each is kept")
    ap.add_argument("--one-row-prompts", type=int, default=5, help="prompts run one after another at one row")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from poot.engine import Engine
    from poot.engine.models import load_model

    model = load_model(args.model)
    engines = {d: Engine.create(model, backend="numpy", draft=d) for d in ("none", "ngram")}
    plan = engines["none"].plan
    rows = [plan.rows if r == "full" else int(r) for r in args.rows.split(",")]
    print(f"model {model.name}; plan rows {plan.rows}, token budget {plan.token_budget}; "
          f"max_tokens {args.max_tokens} (at >4 rows {args.full_max_tokens}); greedy; best of {args.repeats}; "
          "tok/s = output tokens per second of engine-thread CPU time after prefill (wall-clock ratio beside it)")
    for e in engines.values():  # warm up each engine once
        run_once(e, prompts(model, "free", 1), 4)
    results = []
    for workload in args.workloads.split(","):
        for n in rows:
            if n == 1:
                batches = [[p] for p in prompts(model, workload, args.one_row_prompts)]
            else:
                batches = [prompts(model, workload, n)]
            best: dict[str, dict] = {}
            for _ in range(args.repeats):
                for d, e in engines.items():
                    r = run_serial(e, batches, args.max_tokens if n <= 4 else args.full_max_tokens)
                    if d not in best or r["tok_s"] > best[d]["tok_s"]:
                        best[d] = r
            base, spec = best["none"], best["ngram"]
            row = {"workload": workload, "rows": n, "plain_tok_s": base["tok_s"], "spec_tok_s": spec["tok_s"],
                   "speedup": spec["tok_s"] / base["tok_s"], "wall_speedup": spec["wall_tok_s"] / base["wall_tok_s"],
                   "acceptance": spec["acceptance"],
                   "tokens_per_round": spec["tokens_per_round"], "rounds": spec["spec_rounds"],
                   "drafted": spec["spec_drafted_tokens"], "accepted": spec["spec_accepted_tokens"],
                   "plain_steps": base["steps"], "spec_steps": spec["steps"]}
            results.append(row)
            print(f"{workload:5s} rows {n:3d}: plain {base['tok_s']:7.1f} tok/s, ngram {spec['tok_s']:7.1f} tok/s "
                  f"-> {row['speedup']:.2f}x (wall {row['wall_speedup']:.2f}x) | rounds {row['rounds']}, tokens/round {row['tokens_per_round']:.2f}, "
                  f"acceptance {row['acceptance']:.2f} | steps {base['steps']} -> {spec['steps']}", flush=True)
    compiles = {d: e.driver.compiles for d, e in engines.items()}
    print(f"compiles: {compiles}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": model.name, "plan": plan.as_dict(), "results": results, "compiles": compiles}, f,
                      indent=1)


if __name__ == "__main__":
    main()
