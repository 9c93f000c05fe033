"""The CuPy driver (backends ptx and rocm) against the NumPy driver, on every run: NumPy
stands in for CuPy and cupy_launch.ReferenceLauncher for the kernels, taking the same packed
arguments the device launcher passes (checked against each kernel's signature in the .cu
sources) and running engine/drivers/cuda/reference.py. Checked: the logits of mixed steps
(prefill chunks beside decoding rows, shuffled block tables; Llama in fp16 and bf16, Mamba)
within the 16-bit words' tolerance of the NumPy driver's and the same greedy tokens, the
program's launches and compiles, the whole loop, and tokens picked on the "device" equal to
the host sampler's from the same logits, each at the lane counts of a CUDA warp, a CDNA and an
RDNA wavefront; the same over the kernels' own code built for the CPU. Where CuPy sees a GPU
(CUDA or ROCm), the same on it."""

from __future__ import annotations

import numpy as np
import pytest

from poot.engine.drivers.base import Pick, RowWork, StepPlan
from poot.engine.drivers.cpu import CpuDriver
from poot.engine.drivers.cupy_driver import CupyDriver
from poot.engine.drivers.cupy_launch import signatures
from poot.engine.models.synthetic import synthetic_llama
from poot.engine.plan import fit_plan
from poot.engine.random_stream import random_stream

from .cupy_steps import (
    PLATFORMS,
    TOLERANCE,
    compare_logits,
    cuda_device,
    cupy_on_cpu,
    device_backend,
    greedy_agrees,
    mixed_steps,
    on_an_edge,
    open_all,
    pair,
    worst_relative,
)
from .host_kernels import HostLauncher, build
from .picks import PICKED, host_picks, with_picks


@pytest.fixture(params=sorted(PLATFORMS))
def platform(request):
    """The device the driver is fitted to: a CUDA warp of 32 lanes, a CDNA wavefront of 64, an
    RDNA one of 32. The launches' blocks follow the lane count, and the reference launcher
    checks each against the kernel's launch bounds for that count."""
    return PLATFORMS[request.param]


@pytest.mark.parametrize("seed, sizes", [(0, {}), (5, {}), (7, dict(num_heads=8, num_kv_heads=2, head_dim=32))],
                         ids=["seed0", "seed5", "gqa4-hd32"])
def test_logits_match_the_numpy_drivers_within_fp16(seed, sizes, platform):
    model = synthetic_llama(seed, **sizes)
    cpu, gpu, plan = pair(model, probe=platform)
    assert gpu.wtype == "f16"
    assert compare_logits(cpu, gpu, plan, model.config.vocab_size, seed) < TOLERANCE["f16"]


def test_the_bf16_kernels_match_within_bf16():
    model = synthetic_llama(3)
    cpu, gpu, plan = pair(model, wtype="bf16")
    assert gpu.kernels.launches == [] and gpu.wtype == "bf16"
    assert compare_logits(cpu, gpu, plan, model.config.vocab_size, 3) < TOLERANCE["bf16"]
    assert {n for n in gpu.kernels.launches if n != "add_f32"} <= {n for n in signatures() if n.endswith("_bf16")}


def test_a_weight_past_fp16s_range_makes_the_model_bf16():
    model = synthetic_llama(4)
    model.weights["embed"] = model.weights["embed"].copy()
    model.weights["embed"][0, 0] = 1e5  # token 0's embedding; the steps never feed token 0
    cpu, gpu, plan = pair(model)
    assert gpu.wtype == "bf16"
    assert compare_logits(cpu, gpu, plan, model.config.vocab_size, 4, avoid=[0]) < TOLERANCE["bf16"]


def test_every_kernel_is_loaded_in_prepare_and_a_step_launches_the_programs_ops(platform):
    model = synthetic_llama(5)
    cpu, gpu, plan = pair(model, probe=platform)
    built = gpu.compiles
    assert built == len(gpu.kernels.names()) + 1  # each kernel once, and the recorded step
    tables, steps = mixed_steps(plan, np.random.default_rng(2), model.config.vocab_size)
    open_all((gpu,), tables)
    gpu.kernels.launches.clear()
    gpu.step(StepPlan(steps[-1]))
    layers = model.config.num_layers
    f = "_f16"
    assert gpu.kernels.launches == ["embed" + f] + ["rms_norm" + f, "rope_kv_write" + f, "paged_attention" + f,
                                                     "rms_norm" + f, "silu_mul" + f] * layers + ["final_norm" + f]
    for batch in with_picks(steps):
        gpu.step(StepPlan(batch))
    assert gpu.compiles == built


@pytest.mark.parametrize("family", ["llama", "mamba"])
def test_the_engine_serves_the_same_greedy_tokens_on_it(family, platform):
    """The whole loop on the driver (warm-up, rows opened and closed, chunked prefill beside
    decoding): each request's greedy tokens are the NumPy driver's."""
    from poot.engine import Engine
    from poot.engine.models.synthetic import synthetic_mamba
    from tests.engine.harness import greedy, run_until_idle, submit

    model = synthetic_llama(0) if family == "llama" else synthetic_mamba(1)
    prompts = ["a", "the quick brown fox", "x" * 37, "rows at different lengths " * 3]
    tokens = []
    for driver in (CpuDriver(memory_bytes=1 << 30, compact=False), cupy_on_cpu(platform)):
        engine = Engine.create(model, driver=driver)
        records = [submit(engine, p, greedy(10, ignore_eos=True))[0] for p in prompts]
        run_until_idle(engine)
        tokens.append([r.token_ids for r in records])
    assert tokens[0] == tokens[1]


# ---- picks on the device --------------------------------------------------------------------------

def test_tokens_picked_on_the_device_are_the_host_samplers_from_the_same_logits():
    """Greedy and seeded sampling picked by the pick kernel equal engine/sampler.py's picks
    from the logits the same step returns with picking off (a mismatch only where float32
    rounding may move it: on_an_edge); unmarked rows still come back as logits; the NumPy
    driver, which picks on the host from its own float32 logits, picks the same tokens but
    for such edges and greedy near-ties."""
    model = synthetic_llama(5)
    cpu, gpu, plan = pair(model)
    tables, steps = mixed_steps(plan, np.random.default_rng(4), model.config.vocab_size, n_rows=12)
    steps = with_picks(steps)
    open_all((cpu, gpu), tables)
    gpu.device_picks = False
    full = [gpu.step(StepPlan(batch)).logits for batch in steps]
    gpu.device_picks = True
    picked = differ = edges = 0
    for batch, logits in zip(steps, full, strict=True):
        out, on_cpu = gpu.step(StepPlan(batch)), cpu.step(StepPlan(batch))
        want = host_picks(logits, batch)
        assert out.picked == on_cpu.picked == [w.pick is not None and w.num_logits > 0 for w in batch]
        host = np.array(want) < 0
        np.testing.assert_array_equal(out.logits, logits[host])
        flat = [(w, j) for w in batch for j in range(w.num_logits)]
        for i, (w, j) in enumerate(flat):
            if host[i]:
                assert out.token_ids[i] == -1
                continue
            picked += 1
            if out.token_ids[i] != want[i]:
                assert on_an_edge(logits[i], w.pick.params, w.pick.uniform(j)), (w.pick.params, i)
                edges += 1
            differ += int(on_cpu.token_ids[i] != out.token_ids[i])
    assert picked > 30 and edges <= 1
    assert differ <= max(1, picked // 20)


def test_many_seeded_draws_are_the_host_samplers():
    """Every sampling rule, several counters and streams, every row decoding: each draw the
    pick kernel makes is engine/sampler.py's from the same logits and uniform."""
    model = synthetic_llama(5)
    _, gpu, plan = pair(model)
    tables, steps = mixed_steps(plan, np.random.default_rng(6), model.config.vocab_size, n_rows=8)
    open_all((gpu,), tables)
    for batch in steps[:-1]:
        gpu.step(StepPlan(batch))
    last = steps[-1]
    gpu.device_picks = False
    logits = gpu.step(StepPlan(last)).logits
    gpu.device_picks = True
    draws = mismatched = 0
    for params in PICKED[1:]:
        for k in range(8):
            batch = [RowWork(w.row, w.tokens, w.start, w.block_table, w.num_logits,
                             Pick(params, random_stream(1000 * k + w.row, k % 2), k)) for w in last]
            got, want = gpu.step(StepPlan(batch)).token_ids.tolist(), host_picks(logits, batch)
            draws += len(want)
            for i, (a, b) in enumerate(zip(got, want, strict=True)):
                if a != b:
                    w, j = _logit_row(batch, i)
                    assert on_an_edge(logits[i], params, w.pick.uniform(j)), (params, k, i)
                    mismatched += 1
    assert draws >= 5 * 8 * 8 and mismatched <= 1


def _logit_row(batch, i):
    """The row and the index within it of logit index i."""
    for w in batch:
        if i < w.num_logits:
            return w, i
        i -= w.num_logits
    raise IndexError(i)


def test_a_step_picked_whole_reads_back_no_logits():
    model = synthetic_llama(5)
    _, gpu, plan = pair(model)
    tables, steps = mixed_steps(plan, np.random.default_rng(5), model.config.vocab_size)
    open_all((gpu,), tables)
    for batch in with_picks(steps, host_every=10**6):
        out = gpu.step(StepPlan(batch))
        assert out.logits.shape == (0, model.config.vocab_size)
        if not any(w.num_logits for w in batch):  # a mid-prefill chunk: nothing to pick
            assert out.token_ids is None
            continue
        assert len(out.token_ids) == sum(w.num_logits for w in batch) and (out.token_ids >= 0).all()


def test_mamba_logits_match_the_numpy_drivers_within_fp16():
    """The recurrent family: conv and scan over per-row state, rows in chunks and decoding
    side by side, a row reopened by a new sequence starting from zero state."""
    from poot.engine.models.synthetic import synthetic_mamba

    model = synthetic_mamba(1)
    gpu = cupy_on_cpu()
    plan = fit_plan(gpu.device(), model.config, gpu.weight_bytes(model), model.name)
    gpu.prepare(plan, model)
    cpu = CpuDriver(memory_bytes=1 << 30, compact=False)
    cpu.prepare(plan, model)
    assert gpu.layout.half["xs/w"] and not gpu.layout.half["dbc"]  # dt's product runs in fp32
    rng = np.random.default_rng(2)
    p = [rng.integers(0, 256, int(rng.integers(6, 30))).astype(np.int32) for _ in range(5)]
    steps = [[RowWork(0, p[0][:3], 0, [], 0), RowWork(1, p[1], 0, [], 1)],
             [RowWork(0, p[0][3:], 3, [], 1), RowWork(2, p[2], 0, [], 2), RowWork(3, p[3][:1], 0, [], 1)],
             [RowWork(3, p[3][1:], 1, [], 1), RowWork(0, p[1][:1], len(p[0]), [], 1),
              RowWork(1, p[2][:3], len(p[1]), [], 3)],
             "reopen 2",
             [RowWork(2, p[4], 0, [], 1), RowWork(1, p[0][:1], len(p[1]) + 3, [], 1)]]
    open_all((cpu, gpu), [[]] * 4)
    worst = 0.0
    for batch in steps:
        if isinstance(batch, str):
            for d in (cpu, gpu):
                d.step(StepPlan.closing([2]))
                d.step(StepPlan.opening({2: []}))
            continue
        a, b = cpu.step(StepPlan(batch)).logits, gpu.step(StepPlan(batch)).logits
        assert a.shape == b.shape
        worst = max(worst, worst_relative(a, b))
        assert greedy_agrees(a, b, TOLERANCE["f16"])
    assert worst < TOLERANCE["f16"]


# ---- the kernels themselves, built for the CPU, behind the driver ------------------------------------


def host_kernels(folder, lanes, sources=None):
    lib = build(folder, lanes, sources)
    return lambda wtype, lanes_: HostLauncher(wtype, lanes_, lib)


def test_with_the_kernels_built_for_each_lane_count_the_logits_match(platform, tmp_path_factory):
    """The driver's packing and launch geometry over the kernels' own code (cuda/*.cu built for
    the CPU at the platform's lane count, its warp shuffles and lane layouts included) instead
    of their references: a mixed step's logits within fp16 of the NumPy driver's."""
    model = synthetic_llama(0)
    kernels = host_kernels(tmp_path_factory.getbasetemp(), platform.lanes)
    cpu, gpu, plan = pair(model, probe=platform, kernels=kernels)
    assert compare_logits(cpu, gpu, plan, model.config.vocab_size, 0) < TOLERANCE["f16"]
    assert any(n.startswith("paged_attention") for n in gpu.kernels.launches)


def warp_sum_of_32_lanes(code: str) -> str:
    """kernels.cu with its warp reduction written for 32 lanes (the butterfly starts at 16):
    right on a CUDA warp, wrong on a 64-lane wavefront, where it sums each half apart."""
    variant = code.replace("for (int s = LANES / 2; s > 0; s >>= 1)", "for (int s = 16; s > 0; s >>= 1)")
    assert variant != code
    return variant


def test_a_reduction_that_assumes_32_lanes_fails_on_a_64_lane_wavefront(tmp_path_factory):
    from poot.engine.drivers.cuda import compile as cc

    model = synthetic_llama(0)
    variant = {"kernels.cu": warp_sum_of_32_lanes(cc.source("kernels.cu"))}
    base = tmp_path_factory.getbasetemp()
    cpu, gpu, plan = pair(model, probe=PLATFORMS["cuda"], kernels=host_kernels(base, 32, variant))
    assert compare_logits(cpu, gpu, plan, model.config.vocab_size, 0) < TOLERANCE["f16"]
    cpu, gpu, plan = pair(model, probe=PLATFORMS["cdna"], kernels=host_kernels(base, 64, variant))
    with pytest.raises(AssertionError):
        assert compare_logits(cpu, gpu, plan, model.config.vocab_size, 0) < TOLERANCE["f16"]


# ---- on a GPU (CUDA or ROCm) ---------------------------------------------------------------------------


on_a_device = pytest.mark.skipif(not cuda_device(), reason="CuPy sees no GPU here")


@on_a_device
@pytest.mark.parametrize("seed, sizes, wtype", [(0, {}, None), (7, dict(num_heads=8, num_kv_heads=2, head_dim=32), None),
                                                (3, {}, "bf16")], ids=["seed0", "gqa4-hd32", "bf16"])
def test_on_the_device_logits_and_picks_match(seed, sizes, wtype):
    """The kernels and cuBLAS on the device: logits within the word type's tolerance of the
    NumPy driver's, greedy the same, and the pick kernel's tokens the host sampler's from
    the logits the same step returns (but for float32 edges)."""
    model = synthetic_llama(seed, **sizes)
    gpu = CupyDriver(device_backend(), memory_bytes=1 << 30, wtype=wtype)
    plan = fit_plan(gpu.device(), model.config, gpu.weight_bytes(model), model.name,
                    kv_bytes_per_token=gpu.kv_bytes_per_token(model.config))
    gpu.prepare(plan, model)
    cpu = CpuDriver(memory_bytes=1 << 30, compact=False)
    cpu.prepare(plan, model)
    worst = compare_logits(cpu, gpu, plan, model.config.vocab_size, seed)
    print(f"device {gpu.wtype} seed {seed}: worst |logit diff| / max |logit| = {worst:.2e}")
    assert worst < TOLERANCE[gpu.wtype]
    tables, steps = mixed_steps(plan, np.random.default_rng(9), model.config.vocab_size, n_rows=12)
    steps = with_picks(steps)
    open_all((gpu,), tables)
    same = total = 0
    for batch in steps:
        gpu.device_picks = False
        logits = gpu.step(StepPlan(batch)).logits
        gpu.device_picks = True
        out = gpu.step(StepPlan(batch))
        if out.token_ids is None:
            continue
        want = host_picks(logits, batch)
        same += int((np.array(want) == out.token_ids).sum())
        total += len(want)
    assert total > 30 and same >= total - 1, (same, total)


@on_a_device
def test_on_the_device_mamba_matches_the_numpy_driver():
    from poot.engine.models.synthetic import synthetic_mamba

    model = synthetic_mamba(1)
    gpu = CupyDriver(device_backend(), memory_bytes=1 << 30)
    plan = fit_plan(gpu.device(), model.config, gpu.weight_bytes(model), model.name)
    gpu.prepare(plan, model)
    cpu = CpuDriver(memory_bytes=1 << 30, compact=False)
    cpu.prepare(plan, model)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 256, int(rng.integers(6, 40))).astype(np.int32) for _ in range(6)]
    open_all((cpu, gpu), [[]] * len(prompts))
    worst = 0.0
    for batch in ([RowWork(r, p, 0, [], 1) for r, p in enumerate(prompts)],
                  [RowWork(r, p[:2], len(p), [], 2) for r, p in enumerate(prompts)]):
        a, b = cpu.step(StepPlan(batch)).logits, gpu.step(StepPlan(batch)).logits
        worst = max(worst, worst_relative(a, b))
        assert greedy_agrees(a, b, TOLERANCE["f16"])
    print(f"device mamba: worst |logit diff| / max |logit| = {worst:.2e}")
    assert worst < TOLERANCE["f16"]
