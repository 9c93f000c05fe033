"""What constrained decoding costs the loop, on the served model (SmolLM2 by default):

- building llguidance's view of the vocabulary (once, while the engine prepares);
- compiling a schema, cold, over a set of schemas from small to large (p50, p99, max);
- making a matcher and computing one row's allowed-token mask (p50, p99);
- a decode step with 0, 1 and all of 32 rows constrained (the masks are computed on the
  engine thread, in the step's pick);
- how long the engine thread is held while another thread compiles a large schema (the
  server compiles on a worker thread: its cost to running streams is what the GIL lets
  through).

    .venv/bin/python benchmarks/bench_grammar.py [--model default] [--rows 32] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_startup import cpu  # noqa: E402
from poot.conformance import documents  # noqa: E402


def schemas() -> list[tuple[str, dict]]:
    """Schemas users send, from one field to hundreds, each made unique per compile."""
    pet = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "age": {"type": "integer"}},
           "required": ["kind", "age"]}
    person = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40}, "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "zip": {"type": "string",
                                                                                         "pattern": "^[0-9]{5}$"}},
                    "required": ["street", "zip"]}},
              "required": ["name", "email", "address"]}
    wide = {"type": "object", "properties": {f"field_{i}": {"type": "string", "maxLength": 20} if i % 3 else
                                             {"enum": [f"v{i}_{j}" for j in range(50)]} for i in range(300)},
            "required": [f"field_{i}" for i in range(300)]}
    deep: dict = {"type": "integer"}
    for i in range(40):
        deep = {"type": "object", "properties": {f"level_{i}": deep, "note": {"type": "string"}},
                "required": [f"level_{i}"]}
    any_of = {"anyOf": [{"type": "object", "properties": {f"k{i}_{j}": {"type": "integer"} for j in range(10)},
                         "required": [f"k{i}_{j}" for j in range(10)]} for i in range(300)]}
    return [*suite_schemas(), ("pet", pet), ("person", person), ("300 fields", wide), ("40 levels", deep),
            ("anyOf of 300 objects", any_of)]


def suite_schemas() -> list[tuple[str, dict]]:
    """The schemas the structured-output and tools clauses send."""
    return [("clause animal", documents.ANIMAL), ("clause weather", documents.WEATHER),
            ("clause clock", documents.CLOCK)]


def percentiles(seconds: list[float]) -> dict:
    ms = np.array(seconds) * 1e3
    return {"p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99)), "max": float(ms.max()),
            "n": len(ms)}


def compile_times(grammars, repeats: int) -> dict:
    out = {}
    for name, schema in schemas():
        times, makes = [], []
        for i in range(repeats):
            unique = {**schema, "description": f"run {i}"}  # a new source: compiled, not found kept
            t = time.perf_counter()
            grammar = grammars.json_schema(unique)
            times.append(time.perf_counter() - t)
            t = time.perf_counter()
            grammar.matcher()
            makes.append(time.perf_counter() - t)
        out[name] = {"compile": percentiles(times), "matcher": percentiles(makes)}
    return out


def mask_times(grammars, tokens: int = 64) -> dict:
    """One row's mask at each position of a document the grammar walks (its first allowed
    token taken each time)."""
    out = {}
    for name, schema in schemas():
        matcher = grammars.json_schema(schema).matcher()
        logits = np.zeros(matcher.vocab_size, np.float32)
        times = []
        for _ in range(tokens):
            t = time.perf_counter()
            masked = matcher.mask(logits)
            times.append(time.perf_counter() - t)
            if matcher.done:
                break
            matcher.consume(int(np.flatnonzero(np.isfinite(masked))[-1]))
        out[name] = percentiles(times)
    return out


def step_times(model, grammars, rows: int, constrained: list[int], steps: int = 24) -> dict:
    """Decode steps of `rows` rows, k of them masked by an open-ended grammar (a string field
    of up to 2,000 characters: it stays open for the whole run), for each k in `constrained`:
    one engine per k, their steps taken in turn so that the machine's noise falls on each."""
    from poot.engine import Engine, SamplingParams
    from poot.engine.drivers.cpu import CpuDriver

    long_text = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 2000}}, "required": ["text"]}
    grammar = grammars.json_schema(long_text)
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    engines = {}
    for k in constrained:
        engine = engines[k] = Engine.create(model, driver=CpuDriver(memory_bytes=4 << 30))
        for r in range(rows):
            engine.submit_choices(f"Row {r} says:", params, [lambda ev: None], [grammar.matcher()] if r < k else None)
        while any(s.prefilling for s in engine.scheduler.running) or engine.scheduler.waiting:
            engine.iteration()
    times: dict[int, list[float]] = {k: [] for k in constrained}
    with grammar_clock() as spent:
        for _ in range(steps):
            for k, engine in engines.items():
                t = time.perf_counter()
                engine.iteration()
                times[k].append(time.perf_counter() - t)
    for engine in engines.values():
        while engine.in_flight():
            engine.iteration()
    out = {k: percentiles(t) for k, t in times.items()}
    for k in constrained:  # the masks and matcher moves themselves, per step (all engines' rows)
        out[k]["grammar_ms"] = spent[0] * 1e3 / steps * k / max(sum(constrained), 1)
    return out


@contextlib.contextmanager
def grammar_clock():
    """Adds up the time the loop spends in the matchers (masks and consumed tokens)."""
    from poot.engine.grammar import Matcher

    spent = [0.0]
    plain = {name: getattr(Matcher, name) for name in ("mask", "consume")}

    def timed(method):
        def run(self, *a):
            t = time.perf_counter()
            try:
                return method(self, *a)
            finally:
                spent[0] += time.perf_counter() - t
        return run

    for name, method in plain.items():
        setattr(Matcher, name, timed(method))
    try:
        yield spent
    finally:
        for name, method in plain.items():
            setattr(Matcher, name, method)


def held_while_compiling(grammars) -> dict:
    """The longest the main thread waited between two short spins while a worker thread
    compiled the anyOf of 300 objects and started a matcher on it, against the same spins with
    nothing beside them."""

    def spins(during) -> float:
        gaps, last = [], time.perf_counter()
        worker = threading.Thread(target=during)
        worker.start()
        while worker.is_alive():
            sum(range(2000))
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
        worker.join()
        return max(gaps) * 1e3

    wide = dict(schemas())["anyOf of 300 objects"]
    compiling = [spins(lambda i=i: grammars.json_schema({**wide, "description": f"held {i}"}).matcher())
                 for i in range(5)]
    idle = [spins(lambda: time.sleep(0.05)) for _ in range(5)]
    return {"compiling_max_ms": max(compiling), "idle_max_ms": max(idle)}


def measure(model_spec: str | None, rows: int) -> dict:
    from poot.engine.grammar import Grammars
    from poot.engine.models import load_model

    model = load_model(model_spec)
    grammars = Grammars(model.tokenizer)
    t = time.perf_counter()
    grammars.tokenizer()
    vocabulary = time.perf_counter() - t
    name, flags, cores = cpu()
    return {"cpu": name, "flags": flags, "cores": cores, "model": model.name,
            "vocab_size": model.tokenizer.vocab_size, "vocabulary_s": vocabulary,
            "compile": compile_times(grammars, repeats=20), "mask": mask_times(grammars),
            "steps": step_times(model, grammars, rows, sorted({0, 1, rows})), "rows": rows,
            "lone_steps": step_times(model, grammars, 1, [0, 1]),
            "held": held_while_compiling(grammars)}


def render(r: dict) -> str:
    lines = [f"CPU: {r['cpu']} ({r['cores']} cores; {', '.join(r['flags'])})",
             f"model: {r['model']} ({r['vocab_size']} tokens); vocabulary built in {r['vocabulary_s']:.2f} s",
             "", "| schema | compile p50 | p99 | max | matcher p50 | mask p50 | mask p99 |", "|---|---|---|---|---|---|---|"]
    for name, c in r["compile"].items():
        m = r["mask"][name]
        lines.append(f"| {name} | {c['compile']['p50']:.2f} ms | {c['compile']['p99']:.2f} ms | {c['compile']['max']:.2f} ms "
                     f"| {c['matcher']['p50']:.2f} ms | {m['p50']:.3f} ms | {m['p99']:.3f} ms |")
    base = r["steps"][0]["p50"]
    lines += ["", f"| rows constrained of {r['rows']} | step p50 | p99 | p50 against none | grammar work per step |",
              "|---|---|---|---|---|"]
    for k, s in sorted(r["steps"].items(), key=lambda kv: int(kv[0])):
        lines.append(f"| {k} | {s['p50']:.1f} ms | {s['p99']:.1f} ms | {s['p50'] / base:.2f}x | {s['grammar_ms']:.2f} ms |")
    lone = r["lone_steps"]
    lines += ["", "| one row alone | step p50 | p99 | grammar work per step |", "|---|---|---|---|"]
    for k, s in sorted(lone.items(), key=lambda kv: int(kv[0])):
        lines.append(f"| {'constrained' if int(k) else 'free'} | {s['p50']:.1f} ms | {s['p99']:.1f} ms | "
                     f"{s['grammar_ms']:.2f} ms |")
    h = r["held"]
    lines += ["", f"longest wait of another thread while a worker compiled the anyOf of 300 objects and started a matcher: "
                  f"{h['compiling_max_ms']:.1f} ms (with nothing beside it: {h['idle_max_ms']:.1f} ms)"]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a model spec as poot-serve takes it (default: SmolLM2)")
    ap.add_argument("--rows", type=int, default=32, help="rows decoding in the step timings")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    result = measure(args.model, args.rows)
    print(render(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
