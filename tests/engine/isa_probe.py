"""What tests/engine/test_instruction_sets.py compares across instruction sets, computed in a
process of its own (numba's target, hence the instruction set, is fixed per process) and
written to an .npz:

- the integer path's products on seeded block codes (4-bit and byte codes, matrices and heads,
  row and token counts on either side of every tile size, widths with and without whole runs
  of 16 blocks), or nothing where this process has no integer path;
- a block-coded synthetic Llama's logits through the CPU driver, over steps mixing prefill
  chunks and decode rows;
- the plan's facts: its instruction set, rows, positions, KV blocks and the KV cache's type;
  the code MKL runs, or why it does not, and the paths the products of block codes are offered.

    POOT_CPU_ISA=avx2 python -m tests.engine.isa_probe OUT.npz [--facts-only]

With POOT_PROBE_MKL=refuses, MKL answers every request to keep to a mode with a refusal, as it
does on CPUs that are not Intel's (with MKL_CBWR=COMPATIBLE beside it, it also runs its generic
code, as a CPU it knows nothing of would): an Intel machine checks what an AMD one does.
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import numpy as np

BLOCK = 32
ROWS = (1, 2, 5, 13, 67)
WIDTHS = (64, 576, 1088)  # a pair of blocks; a run of 16 and a pair; two runs and a pair
TOKENS = (1, 2, 3, 4, 5, 7, 8, 9, 13, 17, 33)
STEPS = [[(0, list(range(3, 16))), (1, [7, 8, 9, 10, 11])], [(0, [4]), (1, [5])],
         [(0, [6]), (1, [7]), (2, list(range(40, 49)))], [(2, [1]), (0, [2])], [(1, [3])]]


def codes(rng, rows: int, cols: int, signed: bool) -> SimpleNamespace:
    """Q8_0-like (signed bytes) or Q4_1-like (0..15 and a block minimum) codes, float16 scales."""
    blocks = cols // BLOCK
    d = rng.uniform(0.001, 0.1, (rows, blocks)).astype(np.float16).astype(np.float32)
    if signed:
        q, m = rng.integers(-127, 128, (rows, cols)).astype(np.int8), np.zeros((rows, blocks), np.float32)
    else:
        q = rng.integers(0, 16, (rows, cols)).astype(np.uint8)
        m = -rng.uniform(0, 0.5, (rows, blocks)).astype(np.float16).astype(np.float32)
    return SimpleNamespace(codes=q, d=d, m=m, values=None)


def products(runtime, path: str) -> dict[str, np.ndarray]:
    from poot.engine.drivers.cpu.products import coded_product

    out = {}
    rng = np.random.default_rng(0)
    for signed in (False, True):
        for head in (False, True):
            for rows in ROWS:
                for width in WIDTHS:
                    product = coded_product(codes(rng, rows, width, signed), rng.uniform(0.5, 2, width).astype(np.float32),
                                            runtime, (path,), head=head)
                    for tokens in TOKENS:
                        x = rng.standard_normal((width, tokens)).astype(np.float32)
                        out[f"{'q8' if signed else 'q4'}/{'head' if head else 'matrix'}/{rows}x{width}/{tokens}"] = \
                            product.run(x, path=path)
    return out


def main(target: str, facts_only: bool = False) -> None:
    from poot.engine.drivers.cpu import CpuDriver
    from poot.engine.drivers.cpu.platform import mkl
    from poot.engine.drivers.cpu.products.registry import CODE_PATHS

    if os.environ.get("POOT_PROBE_MKL") == "refuses":
        mkl.hold = lambda lib, isa: False
    from poot.engine.drivers.cpu.products.integer import integer_path
    from poot.engine.drivers.cpu.runtime import shared
    from poot.engine.models.synthetic import synthetic_llama
    from poot.engine.plan import fit_plan

    from .harness import feed_steps

    runtime = shared()
    kind = integer_path(runtime)
    arrays = products(runtime, kind.name) if kind is not None and not facts_only else {}
    model = synthetic_llama(7, block_coded=True)
    driver = CpuDriver(memory_bytes=1 << 30)
    plan = fit_plan(driver.device(), model.config, driver.weight_bytes(model), model.name,
                    kv_bytes_per_token=driver.kv_bytes_per_token(model.config))
    driver.prepare(plan, model)
    for k, logits in enumerate(feed_steps(driver, [0, 1, 2], [] if facts_only else STEPS)):
        arrays[f"logits/{k}"] = logits
    facts = {"isa": plan.isa, "path": kind.name if kind else None, "rows": plan.rows, "positions": plan.positions,
             "num_blocks": plan.num_blocks, "kv": str(driver.kv_pool.dtype), "stack": driver.stack is not None,
             "mkl": mkl.dispatched() if mkl.available(runtime.requested_isa) else None,
             "mkl_reason": mkl.unavailable_reason(runtime.requested_isa),
             "offered": [k.name for k in CODE_PATHS if k.available(runtime)],
             "token_multiple": driver.device().token_multiple}
    arrays["facts"] = np.array(json.dumps(facts))
    np.savez(target, **arrays)


if __name__ == "__main__":
    main(sys.argv[1], "--facts-only" in sys.argv[2:])
