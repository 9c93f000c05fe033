"""What the CuPy driver's tests share: the driver on a CPU (NumPy for CuPy, the reference
launcher for the kernels) beside the NumPy driver on one plan, mixed steps over shuffled
block tables, the logits' tolerance, and rows marked for picking on the device."""

from __future__ import annotations

import numpy as np

from poot.engine import SamplingParams, sampler
from poot.engine.drivers.base import RowWork, StepPlan
from poot.engine.drivers.cpu import CpuDriver
from poot.engine.drivers.cupy_device import Probe
from poot.engine.drivers.cupy_driver import CupyDriver
from poot.engine.drivers.cupy_launch import ReferenceLauncher
from poot.engine.plan import fit_plan

SMALL = Probe("test device", 8 << 30, 8 << 30, 16, (9, 0))  # 16 SMs: the fewest rows, 32
# The same small device as each platform's lane count sees it: a CUDA warp, a CDNA wavefront
# (MI200/MI300, 64 lanes), an RDNA one (32 lanes).
PLATFORMS = {"cuda": SMALL, "cdna": Probe("test CDNA device", 8 << 30, 8 << 30, 16, (9, 0), True, 64, "gfx90a"),
             "rdna": Probe("test RDNA device", 8 << 30, 8 << 30, 16, (10, 3), True, 32, "gfx1030")}
H200 = Probe("NVIDIA H200", 150_000_000_000, 141_000_000_000, 132, (9, 0))
# Logits of 16-bit weights and activations against the NumPy driver's float32, as a share of
# the step's largest logit: fp16 words carry 11 significant bits (relative rounding 2^-11 =
# 4.9e-4 per stored value, over a handful of stored activations per layer), bf16 words 8.
TOLERANCE = {"f16": 4e-3, "bf16": 3e-2}


def cupy_on_cpu(probe: Probe = SMALL, kernels=ReferenceLauncher, **kw) -> CupyDriver:
    """The driver on NumPy, for the platform the probe names (ptx, or rocm at its wavefront)."""
    return CupyDriver("rocm" if probe.hip else "ptx", xp=np, kernels=kernels, probe=probe, memory_bytes=1 << 30, **kw)


def pair(model, **kw):
    """The CuPy driver (on NumPy) and the NumPy driver, prepared on the CuPy driver's plan."""
    gpu = cupy_on_cpu(**kw)
    plan = fit_plan(gpu.device(), model.config, gpu.weight_bytes(model), model.name,
                    kv_bytes_per_token=gpu.kv_bytes_per_token(model.config))
    gpu.prepare(plan, model)
    cpu = CpuDriver(memory_bytes=1 << 30, compact=False)
    cpu.prepare(plan, model)
    return cpu, gpu, plan


def mixed_steps(plan, rng, vocab, n_rows=5, avoid=()):
    """Rows with shuffled block tables prefill prompts in chunks (two rows a step, one of
    them split mid-prompt), then all decode together while one verifies four tokens."""
    tokens = np.setdiff1d(np.arange(vocab), avoid)
    prompts = [rng.choice(tokens, int(rng.integers(5, 40))).astype(np.int32) for _ in range(n_rows)]
    pool = rng.permutation(plan.num_blocks).tolist()
    tables = [[pool.pop() for _ in range(plan.blocks_for(len(p) + 8))] for p in prompts]
    rows = list(zip(prompts, tables, strict=True))
    steps = []
    for i in range(0, n_rows, 2):
        batch = []
        for r in range(i, min(i + 2, n_rows)):
            p, t = rows[r]
            cut = len(p) // 2
            steps.append([RowWork(r, p[:cut], 0, t, 0)])  # a mid-prefill chunk: no logits
            batch.append(RowWork(r, p[cut:-1], cut, t, 1))
        steps.append(batch)
    steps.append([RowWork(r, p[-1:], len(p) - 1, t, 1) for r, (p, t) in enumerate(rows)])
    extra = rng.choice(tokens, 4).astype(np.int32)
    steps.append([RowWork(0, extra, len(prompts[0]), tables[0], 4)]
                 + [RowWork(r, extra[:1], len(p), t, 1) for r, (p, t) in enumerate(rows) if r])
    return tables, steps


def open_all(drivers, tables):
    for d in drivers:
        for row, t in enumerate(tables):
            d.step(StepPlan.opening({row: t}))


def worst_relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(a).max())


def greedy_agrees(a: np.ndarray, b: np.ndarray, tol: float) -> bool:
    """Same argmax per row, except where the NumPy logits' top two lie within the tolerance
    (a near-tie that rounding may flip)."""
    for x, y in zip(a, b, strict=True):
        top2 = np.sort(x)[-2:]
        if x.argmax() != y.argmax() and top2[1] - top2[0] > 2 * tol * np.abs(x).max():
            return False
    return True


def compare_logits(cpu, gpu, plan, vocab, seed, avoid=()):
    tables, steps = mixed_steps(plan, np.random.default_rng(seed), vocab, avoid=avoid)
    open_all((cpu, gpu), tables)
    worst = 0.0
    for batch in steps:
        a, b = cpu.step(StepPlan(batch)).logits, gpu.step(StepPlan(batch)).logits
        assert a.shape == b.shape == (sum(w.num_logits for w in batch), vocab)
        if len(a):
            worst = max(worst, worst_relative(a, b))
            assert greedy_agrees(a, b, TOLERANCE[gpu.wtype])
    return worst


def on_an_edge(logits: np.ndarray, params: SamplingParams, u: float) -> bool:
    """Whether float32 rounding may move a sampled pick: the uniform within 1e-5 of a step of
    the CDF, or a top-p level's mass within 1e-5 of top_p (the kernel sums in float32 in a
    fixed tree, the sampler in float64)."""
    p = sampler.probabilities(logits, params)
    if np.min(np.abs(np.cumsum(p) - u)) < 1e-5:
        return True
    q = sampler.probabilities(logits, SamplingParams(temperature=params.temperature, top_k=params.top_k))
    ahead = np.array([q[q > v].sum() for v in np.unique(q)])
    return params.top_p < 1 and bool(np.min(np.abs(ahead - params.top_p)) < 1e-5)


def cuda_device() -> bool:
    """Whether CuPy sees a GPU (CUDA or ROCm)."""
    try:
        import cupy

        return bool(cupy.is_available())
    except Exception:
        return False


def device_backend() -> str:
    """The backend of the GPU CuPy sees."""
    import cupy

    return "rocm" if cupy.cuda.runtime.is_hip else "ptx"
