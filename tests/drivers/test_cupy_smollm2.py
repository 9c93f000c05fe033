"""SmolLM2 on the CuPy driver (ptx, rocm) against the NumPy driver: logits of a mixed step,
and greedy continuations of many prompts decoded side by side, the GPU's rows picked on the
device.

Runs only where CuPy sees a device of that backend (ci/gpu_ptx.sh runs it on a lent GPU,
ci/gpu_rocm.sh on an AMD one); elsewhere it skips, saying what is missing. The CuPy driver
keeps weights in fp16 and the NumPy driver in float32, so
logits agree to fp16's precision, not bit for bit, and a greedy continuation may part where
the NumPy driver's two best tokens are within that precision of each other: each parting is
printed with that margin, and only such near-ties may part.
"""

from __future__ import annotations

import numpy as np
import pytest

from poot.engine.params import SamplingParams
from poot.engine.random_stream import RandomStream
from poot.engine.step import Pick, RowWork, StepPlan

pytestmark = [pytest.mark.realmodel]

PROMPTS = [
    "The capital of France is", "Water boils at", "A haiku about autumn:", "def fibonacci(n):",
    "The three primary colors are", "Once upon a time, in a small village,", "To make a cup of tea, first",
    "The largest planet in our solar system is", "Photosynthesis is the process by which",
    "In 1969, the first person to walk on the Moon", "The quick brown fox", "SELECT name FROM users WHERE",
    "My favourite book is", "The opposite of hot is", "Translate to French: good morning", "2 + 2 =",
]
STEPS = 24
LOGIT_TOLERANCE = 1e-2  # relative to the largest logit's magnitude: fp16 weights against float32
NEAR_TIE = 0.05  # a parting is allowed only where the NumPy driver's top two were this close


def cupy_driver(backend: str):
    from poot.engine.drivers import make_driver
    from poot.engine.drivers.cupy_device import NoDevice

    try:
        return make_driver(backend)
    except NoDevice as e:
        pytest.skip(str(e))


def prepared(driver, model):
    from poot.engine.plan import fit_plan

    plan = fit_plan(driver.device(), model.config, driver.weight_bytes(model), model.name,
                    kv_bytes_per_token=driver.kv_bytes_per_token(model.config))
    driver.prepare(plan, model)
    return plan


@pytest.mark.parametrize("backend", ["ptx", "rocm"])
def test_smollm2_logits_and_greedy_continuations_match_the_numpy_driver(smollm2, backend):
    from poot.engine.drivers.cpu import CpuDriver

    gpu = cupy_driver(backend)
    cpu = CpuDriver(device_picks=False, compact=False)
    plans = [prepared(d, smollm2) for d in (cpu, gpu)]
    per_row = max(p.blocks_for(64 + STEPS) for p in plans)
    prompts = [np.asarray(smollm2.tokenizer.encode(p), np.int32) for p in PROMPTS]
    tables = [list(range(i * per_row, (i + 1) * per_row)) for i in range(len(prompts))]
    for d in (cpu, gpu):
        for row, table in enumerate(tables):
            d.step(StepPlan.opening({row: table}))

    # One mixed step: every prompt prefilled at once, rows of different lengths.
    first = [RowWork(r, p, 0, tables[r], 1) for r, p in enumerate(prompts)]
    ref = cpu.step(StepPlan(first)).logits
    gpu.device_picks = False
    got = gpu.step(StepPlan(first)).logits
    scale = float(np.abs(ref).max())
    worst = float(np.abs(got - ref).max())
    print(f"\nSmolLM2 prefill logits, {len(prompts)} rows: max |{backend} - numpy| = {worst:.4f} "
          f"({worst / scale:.2e} of the largest logit, {scale:.1f})")
    assert worst <= LOGIT_TOLERANCE * scale

    # Greedy continuations, decoded side by side: NumPy on host argmax, the GPU's picked on the device.
    gpu.device_picks = True
    greedy = SamplingParams(temperature=0.0)
    ours = [[int(np.argmax(ref[r]))] for r in range(len(prompts))]
    theirs = [[int(np.argmax(got[r]))] for r in range(len(prompts))]
    margins: list[list[float]] = [[float(np.diff(np.sort(ref[r])[-2:])[0])] for r in range(len(prompts))]
    for k in range(1, STEPS):
        batch_cpu = [RowWork(r, np.asarray(ours[r][-1:], np.int32), len(prompts[r]) + k - 1, tables[r], 1)
                     for r in range(len(prompts))]
        batch_gpu = [RowWork(r, np.asarray(theirs[r][-1:], np.int32), len(prompts[r]) + k - 1, tables[r], 1,
                             Pick(greedy, RandomStream(0), k)) for r in range(len(prompts))]
        logits = cpu.step(StepPlan(batch_cpu)).logits
        out = gpu.step(StepPlan(batch_gpu))
        assert all(out.picked)
        for r in range(len(prompts)):
            ours[r].append(int(np.argmax(logits[r])))
            theirs[r].append(int(out.token_ids[r]))
            margins[r].append(float(np.diff(np.sort(logits[r])[-2:])[0]))
    agree = sum(a == b for a, b in zip(ours, theirs, strict=True))
    print(f"greedy continuations of {STEPS} tokens: {agree} of {len(prompts)} identical")
    for r, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if a != b:
            k = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
            print(f"  prompt {r} ({PROMPTS[r]!r}) parts at token {k}: numpy {a[k]}, {backend} {b[k]}, "
                  f"numpy's top-two margin {margins[r][k]:.4f}")
            assert margins[r][k] < NEAR_TIE, "a continuation parted where the NumPy driver had no near-tie"
