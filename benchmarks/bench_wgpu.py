"""The wgpu driver's step times on this machine's adapter (lavapipe on a CPU machine):
decode steps at a few row counts and one prefill chunk, on the synthetic model or SmolLM2.
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
    ap.add_argument("--model", default="synthetic", help="synthetic, default (SmolLM2) or a path")
    ap.add_argument("--backend", default="vulkan", choices=["wgpu", "vulkan"])
    ap.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8])
    ap.add_argument("--context", type=int, default=64, help="tokens of context each decoding row holds")
    ap.add_argument("--prefill", type=int, default=44, help="tokens of the prefill chunk")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)

    from poot.engine.drivers.base import RowWork
    from poot.engine.drivers.wgpu_driver import WgpuDriver
    from poot.engine.models import load_model
    from poot.engine.plan import fit_plan

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
    per_row = plan.blocks_for(args.context + 1)
    tables = [list(range(r * per_row, (r + 1) * per_row)) for r in range(max(args.rows))]
    for r, table in enumerate(tables):
        driver.open_row(r, table)
        for start in range(0, args.context, plan.max_step_tokens):
            n = min(plan.max_step_tokens, args.context - start)
            driver.step([RowWork(r, rng.integers(0, 200, n).astype(np.int32), start, table, 0)])

    def timed(batch):
        driver.step(batch)
        t = time.perf_counter()
        for _ in range(args.repeats):
            driver.step(batch)
        return (time.perf_counter() - t) / args.repeats

    print("phase     rows  tokens  step_ms  tok/s")
    for rows in args.rows:
        batch = [RowWork(r, np.array([65], np.int32), args.context, tables[r], 1) for r in range(rows)]
        s = timed(batch)
        print(f"decode    {rows:4d}  {rows:6d}  {s * 1e3:7.1f}  {rows / s:5.1f}")
    n = min(args.prefill, plan.max_step_tokens)
    batch = [RowWork(0, rng.integers(0, 200, n).astype(np.int32), 0, tables[0], 1)]
    s = timed(batch)
    print(f"prefill   {1:4d}  {n:6d}  {s * 1e3:7.1f}  {n / s:5.1f}")
    print(f"compiles after prepare: {driver.compiles - built}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
