"""The decode step on any backend against the memory-bandwidth bound, in one run.

    python benchmarks/bench_gpu_step.py [--backend ptx] [--model default] [--context 256]
        [--rows 1,32,256] [--steps 20] [--json PATH]

Loads the model, fits the plan the engine would, and gives each row a context of its own,
written by a real prefill (distinct KV blocks). Then, for 1, 32, 256 and the plan's rows (as
many as the plan has), times decode steps, every row one token at CONTEXT, and compares each
with its bound: the bytes the step must read at least (every streamed weight once, in the
driver's own dtype, plus each row's KV) over the bandwidth measured in the same run (a
device-to-device copy of 1 GiB: bytes read plus bytes written, over its time). A step returns
its picked ids or logits to the host, so its time includes the launch, the pick and the
read-back, as a request sees it.

Prints a Markdown table: rows, step ms (median of STEPS), bound ms, step / bound, output
tokens per second. The target on a GPU: full rows within 2x of the bound.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

COPY_BYTES = 1 << 30


def bandwidth(backend: str) -> tuple[float, str]:
    """Bytes per second a device-to-device copy moves (read plus written), best of five."""
    if backend in ("ptx", "rocm"):
        import cupy

        a, b = cupy.ones(COPY_BYTES // 4, cupy.float32), cupy.empty(COPY_BYTES // 4, cupy.float32)

        def copy():
            cupy.copyto(b, a)
            cupy.cuda.Device().synchronize()
        where = "device copy (CuPy)"
    else:
        a, b = np.ones(COPY_BYTES // 4, np.float32), np.empty(COPY_BYTES // 4, np.float32)

        def copy():
            np.copyto(b, a)
        where = "host copy (NumPy)"
    copy()
    best = min(_time(copy) for _ in range(5))
    return 2 * COPY_BYTES / best, where


def _time(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def streamed_weight_bytes(driver, model) -> int:
    """What a decode step reads of the weights: all of them in the driver's dtype, less an
    embedding that is only gathered (it is streamed when the head is tied to it)."""
    total = driver.weight_bytes(model)
    config = model.config
    if not getattr(config, "tie_embeddings", True):
        embed = model.weights["embed"]
        total -= embed.size * total // sum(w.size for w in model.weights.values())
    return total


def run(args) -> dict:
    from poot.engine.drivers import make_driver
    from poot.engine.models import load_model
    from poot.engine.plan import fit_plan
    from poot.engine.step import RowWork, StepPlan

    model = load_model(None if args.model == "default" else args.model)
    driver = make_driver(args.backend)
    config = model.config
    plan = fit_plan(driver.device(), config, driver.weight_bytes(model), model.name,
                    kv_bytes_per_token=driver.kv_bytes_per_token(config))
    t = time.perf_counter()
    driver.prepare(plan, model)
    prepare_s = time.perf_counter() - t
    context = min(args.context, plan.positions - 1)
    counts = sorted({r for r in args.rows if r <= plan.rows} | {plan.rows})
    rng = np.random.default_rng(0)
    per_row = plan.blocks_for(context + 1)
    if counts[-1] * per_row > plan.num_blocks:
        raise SystemExit(f"the plan's {plan.num_blocks} KV blocks cannot give {counts[-1]} rows {context} tokens each")
    tables = [list(range(r * per_row, (r + 1) * per_row)) for r in range(counts[-1])]
    t = time.perf_counter()
    for r, table in enumerate(tables):  # a real prefill writes each row's context
        driver.step(StepPlan.opening({r: table}))
        prompt = rng.integers(100, config.vocab_size, context).astype(np.int32)
        for start in range(0, context, plan.max_step_tokens):
            piece = prompt[start : start + plan.max_step_tokens]
            driver.step(StepPlan([RowWork(r, piece, start, table, int(start + len(piece) == context))]))
    fill_s = time.perf_counter() - t
    bw, where = bandwidth(args.backend)
    weights = streamed_weight_bytes(driver, model)
    kv_per_token = driver.kv_bytes_per_token(config)
    compiles = driver.compiles
    rows_out = []
    for rows in counts:
        batch = [RowWork(r, rng.integers(100, config.vocab_size, 1).astype(np.int32), context, tables[r], 1)
                 for r in range(rows)]
        driver.step(StepPlan(batch))  # the first step of a shape is not timed
        times = [_time(lambda b=batch: driver.step(StepPlan(b))) for _ in range(args.steps)]
        step = statistics.median(times)
        bound = (weights + rows * (context + 1) * kv_per_token) / bw
        rows_out.append(dict(rows=rows, step_ms=step * 1e3, best_ms=min(times) * 1e3, bound_ms=bound * 1e3,
                             x_bound=step / bound, tok_s=rows / step))
    return dict(backend=args.backend, device=driver.device().name, model=model.name, plan=plan.as_dict(),
                context=context, prepare_s=prepare_s, fill_s=fill_s, bandwidth_gb_s=bw / 1e9, bandwidth_from=where,
                weight_bytes=weights, kv_bytes_per_token=kv_per_token, compiles_before=compiles,
                compiles_after=driver.compiles, rows=rows_out)


def markdown(result: dict) -> str:
    lines = [f"## Decode step on {result['backend']} ({result['device']}), {result['model']}, "
             f"context {result['context']}",
             "",
             f"Bandwidth {result['bandwidth_gb_s']:.0f} GB/s ({result['bandwidth_from']}); streamed weights "
             f"{result['weight_bytes'] / 1e6:.1f} MB; KV {result['kv_bytes_per_token']} bytes a token; plan rows "
             f"{result['plan']['rows']}; compiles {result['compiles_before']} -> {result['compiles_after']}; "
             f"prepare {result['prepare_s']:.1f} s, fill {result['fill_s']:.1f} s.",
             "",
             "| rows | step ms (median) | best ms | bound ms | step / bound | tok/s |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['rows']} | {r['step_ms']:.3f} | {r['best_ms']:.3f} | {r['bound_ms']:.3f} | "
                     f"{r['x_bound']:.2f} | {r['tok_s']:,.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="ptx")
    ap.add_argument("--model", default="default", help='"default" (SmolLM2), "synthetic", or a file')
    ap.add_argument("--context", type=int, default=256, help="tokens of context each decoding row holds")
    ap.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32, 256])
    ap.add_argument("--steps", type=int, default=20, help="timed steps per row count")
    ap.add_argument("--json", help="also write the results as JSON here")
    args = ap.parse_args(argv)
    result = run(args)
    print(markdown(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
