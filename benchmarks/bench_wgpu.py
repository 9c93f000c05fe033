"""The wgpu driver's step times on this machine's adapter (lavapipe on a CPU machine):
decode steps at a few row counts and one prefill chunk, on a synthetic model (Llama or
Mamba) or SmolLM2.
Each decode step is timed three ways: the host picks (the step reads back every row's
logits, then the host's sampler picks greedily), the device picks greedily (the step reads
back one token id per row), and the device samples (temperature 0.8, top-k 50, top-p 0.9).
Speed on lavapipe is reported, not a target. Run it in a process of its own (lavapipe's
threads and BLAS's fight on a small machine):

    XDG_RUNTIME_DIR=/tmp LP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_wgpu.py --model default
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="synthetic", help="synthetic, synthetic-mamba, default (SmolLM2) or a path")
    ap.add_argument("--backend", default="vulkan", choices=["wgpu", "vulkan"])
    ap.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8])
    ap.add_argument("--context", type=int, default=64, help="tokens of context each decoding row holds")
    ap.add_argument("--prefill", type=int, default=44, help="tokens of the prefill chunk")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)

    from poot.engine import SamplingParams, sampler
    from poot.engine.drivers.base import Pick, RowWork, StepPlan
    from poot.engine.drivers.wgpu_driver import WgpuDriver
    from poot.engine.models import load_model
    from poot.engine.plan import fit_plan
    from poot.engine.random_stream import random_stream

    model = load_model(args.model)
    driver = WgpuDriver(args.backend)
    plan = fit_plan(driver.device(), model.config, driver.weight_bytes(model), model.name,
                    kv_bytes_per_token=driver.kv_bytes_per_token(model.config))
    t = time.perf_counter()
    driver.prepare(plan, model)
    built = driver.compiles
    print(f"adapter: {plan.adapter}; prepare {time.perf_counter() - t:.2f} s, {driver.compiles} compiles; "
          f"plan rows={plan.rows} token_budget={plan.token_budget} idle={plan.idle_token_budget} blocks={plan.num_blocks}")
    rng = np.random.default_rng(0)
    per_row = 0 if getattr(model.config, "recurrent", False) else plan.blocks_for(args.context + 1)  # Mamba: no KV
    tables = [list(range(r * per_row, (r + 1) * per_row)) for r in range(max(args.rows))]
    for r, table in enumerate(tables):
        driver.step(StepPlan.opening({r: table}))
        for start in range(0, args.context, plan.max_step_tokens):
            n = min(plan.max_step_tokens, args.context - start)
            driver.step(StepPlan([RowWork(r, rng.integers(0, 200, n).astype(np.int32), start, table, 0)]))

    greedy = SamplingParams(temperature=0.0)
    picks = {"host": None, "greedy": greedy,
             "sampled": SamplingParams(temperature=0.8, top_k=50, top_p=0.9)}

    def timed(batches: dict) -> dict:
        """Median seconds of each batch's step (and, for the host's, of its greedy pick
        after it), the batches taken in turn within each repeat so that other work on a
        small machine lands on all of them alike."""
        times = {name: ([], []) for name in batches}
        for batch in batches.values():
            driver.step(StepPlan(batch))
        for _ in range(args.repeats):
            for name, batch in batches.items():
                t = time.perf_counter()
                out = driver.step(StepPlan(batch))
                times[name][0].append(time.perf_counter() - t)
                t = time.perf_counter()
                if out.token_ids is None:
                    for row in out.logits:
                        sampler.sample(row, greedy, 0.0)
                times[name][1].append(time.perf_counter() - t)
        return {name: (float(np.median(a)), float(np.median(b))) for name, (a, b) in times.items()}

    print("phase     rows  tokens  picked   step_ms  host_pick_ms  read_back_KiB  tok/s")
    for rows in args.rows:
        batches = {name: [RowWork(r, np.array([65], np.int32), args.context, tables[r], 1,
                                  None if params is None else Pick(params, random_stream(r), args.context))
                          for r in range(rows)] for name, params in picks.items()}
        for name, (s, p) in timed(batches).items():
            kib = rows * (model.config.vocab_size if picks[name] is None else 1) * 4 / 1024
            print(f"decode    {rows:4d}  {rows:6d}  {name:7s}  {s * 1e3:7.1f}  {p * 1e3:12.2f}  {kib:13.1f}  "
                  f"{rows / (s + p):5.1f}")
    n = min(args.prefill, plan.max_step_tokens)
    batch = [RowWork(0, rng.integers(0, 200, n).astype(np.int32), 0, tables[0], 1)]
    s, _ = timed({"prefill": batch})["prefill"]
    print(f"prefill   {1:4d}  {n:6d}  host     {s * 1e3:7.1f}  {'':12s}  {'':13s}  {n / s:5.1f}")
    print(f"compiles after prepare: {driver.compiles - built}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
