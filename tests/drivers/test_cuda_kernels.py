"""The CuPy driver's kernels (engine/drivers/cuda): compiled with the driver's own NVRTC
options on every run (no GPU needed: the architecture is named), ptxas's resource report
checked against Hopper's limits, the NumPy references checked against independent
computations over mixed steps, and every kernel launched and compared with its reference:
built for the CPU at 32 and 64 lanes a warp on every run, and where CuPy sees a GPU (CUDA or
ROCm), on it. (The HIP builds' compile checks are in test_hip_kernels.py.)"""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.drivers.cuda import compile as cc
from engine.drivers.cuda import reference as ref
from engine.models.llama import pair_rows, rope_table
from engine.models.synthetic import synthetic_config
from engine.params import SamplingParams
from engine.random_stream import M32, RandomStream
from engine.sampler import probabilities, sample

from .kernel_runners import device_runner

WTYPES = ("f16", "bf16")


# ---- compile checks -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compiled():
    return cc.compile_all()


def test_every_kernel_compiles_to_sm90_cubin_and_ptx(compiled):
    names = cc.kernel_names()
    assert {"embed_f16", "paged_attention_bf16", "pick", "add_f32"} <= set(names)
    for unit in compiled.values():
        assert unit.cubin[:4] == b"\x7fELF"
        assert ".target sm_90" in unit.ptx
    ptx = "".join(u.ptx for u in compiled.values())
    for name in names:
        assert f".entry {name}(" in ptx, name
    assert len(re.findall(r"\.entry (\w+)\(", ptx)) == len(names)


def test_ptxas_report_within_hopper_limits_and_no_spills(compiled):
    usage = {}
    for unit in compiled.values():
        usage |= cc.ptxas_usage(unit.log)
    assert set(usage) == set(cc.kernel_names())
    for name, u in usage.items():
        threads = cc.block_threads(name)
        assert u.registers <= 255, name
        assert u.registers * threads <= 65536, (name, u.registers, threads)
        assert u.shared <= 227 * 1024, name
        assert (u.spill_stores, u.spill_loads, u.stack) == (0, 0, 0), (name, u)


@pytest.mark.parametrize("lanes", [32, 64])
def test_the_launch_geometry_is_each_kernels_launch_bounds(lanes):
    """The blocks the driver launches (compile.block_threads) are what each kernel's
    __launch_bounds__ states for that lane count; the attention kernel's grow with the lanes."""
    bounds = cc.launch_bounds(lanes)
    assert set(bounds) == set(cc.kernel_names())
    assert {k: cc.block_threads(k, lanes) for k in bounds} == bounds
    assert bounds["paged_attention_f16"] == 4 * lanes and bounds["rms_norm_f16"] == 256


def test_the_report_check_sees_local_memory():
    code = """extern "C" __global__ void local(float* o, int n) {
      float a[512];
      for (int i = 0; i < 512; i++) a[i] = o[i * n + threadIdx.x];
      float s = 0;
      for (int i = 0; i < 512; i++) s += a[(i * n) & 511] * a[i];
      o[threadIdx.x] = s;
    }"""
    usage = cc.ptxas_usage(cc.compile_source(code, "local.cu").log)
    assert usage["local"].stack > 0


def test_a_syntax_error_fails_naming_the_file():
    broken = cc.source("kernels.cu").replace("const int half = head_dim >> 1;", "const int half = head_dim >> ;")
    with pytest.raises(cc.CompileError, match=r"kernels\.cu"):
        cc.compile_source(broken, "kernels.cu")


# ---- a mixed step: several rows, decode tokens and prefill chunks, shuffled blocks ---------------

HEADS, KVH, HD, BS = 4, 2, 16, 4
ROW_SLOTS = 6
SEGMENTS = [(4, 0, 7), (0, 9, 1), (2, 5, 6), (5, 12, 1), (1, 3, 1)]  # (row slot, start, tokens)


def mixed_step(seed: int, wtype: str):
    """Each row's whole K/V history in a paged cache (blocks shuffled, last blocks partial,
    NaN wherever no valid key lies), plus the step's flat arrays."""
    rng = np.random.default_rng(seed)
    lengths = {r: s + n for r, s, n in SEGMENTS}
    max_blocks = -(-max(lengths.values()) // BS) + 1
    needed = sum(-(-n // BS) for n in lengths.values())
    num_blocks = needed + 5
    free = iter(rng.permutation(num_blocks))
    tables = np.full((ROW_SLOTS, max_blocks), -1, np.int32)
    for r, n in lengths.items():
        tables[r, : -(-n // BS)] = [next(free) for _ in range(-(-n // BS))]
    nan = np.float32(np.nan)
    k_cache = ref.to_w(np.full((num_blocks * BS, KVH, HD), nan), wtype)
    v_cache = k_cache.copy()
    keys = {r: ref.w_to_f32(ref.to_w(rng.standard_normal((n, KVH, HD), np.float32), wtype)) for r, n in lengths.items()}
    values = {r: ref.w_to_f32(ref.to_w(rng.standard_normal((n, KVH, HD), np.float32), wtype)) for r, n in lengths.items()}
    for r, n in lengths.items():
        slots = tables[r, np.arange(n) // BS] * BS + np.arange(n) % BS
        k_cache[slots], v_cache[slots] = ref.to_w(keys[r], wtype), ref.to_w(values[r], wtype)
    row_slot = np.concatenate([np.full(n, r) for r, _, n in SEGMENTS]).astype(np.int32)
    positions = np.concatenate([np.arange(s, s + n) for _, s, n in SEGMENTS]).astype(np.int32)
    kv_slots = (tables[row_slot, positions // BS] * BS + positions % BS).astype(np.int32)
    q = (rng.standard_normal((len(positions), HEADS * HD)) / np.sqrt(HD)).astype(np.float32)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, positions=positions, row_slot=row_slot, tables=tables,
                kv_slots=kv_slots, keys=keys, values=values, max_blocks=max_blocks)


def dense_attention(step) -> np.ndarray:
    """Causal attention over each row's contiguous K/V, in float64."""
    q = step["q"].reshape(-1, HEADS, HD).astype(np.float64)
    out = np.zeros_like(q)
    for t, (r, p) in enumerate(zip(step["row_slot"], step["positions"], strict=True)):
        for h in range(HEADS):
            k, v = step["keys"][r][: p + 1, h // (HEADS // KVH)], step["values"][r][: p + 1, h // (HEADS // KVH)]
            s = k @ q[t, h]
            e = np.exp(s - s.max())
            out[t, h] = e @ v / e.sum()
    return out.reshape(len(q), HEADS * HD)


TOL = {"f16": dict(rtol=2e-3, atol=2e-3), "bf16": dict(rtol=1e-2, atol=1e-2)}


@pytest.mark.parametrize("wtype", WTYPES)
def test_paged_attention_reference_is_dense_causal_attention_per_row(wtype):
    step = mixed_step(1, wtype)
    out = ref.paged_attention(step["q"], step["k_cache"], step["v_cache"], step["positions"], step["row_slot"],
                              step["tables"], HEADS, KVH, HD, BS)
    got = ref.w_to_f32(out)
    assert np.isfinite(got).all()  # never a key past the row's position (those are NaN)
    np.testing.assert_allclose(got, dense_attention(step), **TOL[wtype])


def rope_inputs(seed: int, wtype: str):
    step = mixed_step(seed, wtype)
    config = synthetic_config(num_heads=HEADS, num_kv_heads=KVH, head_dim=HD)
    rope = rope_table(config, 64).view(np.float32).reshape(64, HD // 2, 2)
    rng = np.random.default_rng(seed)
    qkv = rng.standard_normal((len(step["positions"]), (HEADS + 2 * KVH) * HD)).astype(np.float32)
    return step, config, rope, qkv


@pytest.mark.parametrize("wtype", WTYPES)
def test_rope_reference_is_rotate_half_rotary_in_pair_layout(wtype):
    step, config, rope, qkv = rope_inputs(2, wtype)
    k_cache, v_cache = step["k_cache"].copy(), step["v_cache"].copy()
    q = ref.rope_kv_write(qkv, rope, step["positions"], step["kv_slots"], k_cache, v_cache, HEADS, KVH, HD)
    # The model's rotary, written directly on unpaired (rotate_half) rows.
    half = HD // 2
    unpair = np.argsort(np.stack([np.arange(half), np.arange(half) + half], axis=1).reshape(-1))
    theta = config.rope_theta ** (-np.arange(half) / half)
    for t, p in enumerate(step["positions"]):
        ang = np.concatenate([p * theta, p * theta])
        for head in range(HEADS + KVH):
            x = qkv[t, head * HD : (head + 1) * HD][unpair].astype(np.float64)  # back to rotate_half
            want = x * np.cos(ang) + np.concatenate([-x[half:], x[:half]]) * np.sin(ang)
            want = pair_rows(want[:, None], 1, HD)[:, 0]
            got = q[t, head * HD : (head + 1) * HD] if head < HEADS else ref.w_to_f32(k_cache[step["kv_slots"][t], head - HEADS])
            np.testing.assert_allclose(got, want, **(TOL[wtype] if head >= HEADS else dict(rtol=1e-5, atol=1e-5)))
        v = ref.w_to_f32(v_cache[step["kv_slots"][t]]).reshape(-1)
        np.testing.assert_array_equal(v, ref.w_to_f32(ref.to_w(qkv[t, (HEADS + KVH) * HD :], wtype)))
    untouched = np.setdiff1d(np.arange(len(k_cache)), step["kv_slots"])
    np.testing.assert_array_equal(k_cache[untouched], step["k_cache"][untouched])


@pytest.mark.parametrize("wtype", WTYPES)
def test_norm_embed_silu_references(wtype):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 96)).astype(np.float32)
    x64 = x.astype(np.float64)
    normed = x64 / np.sqrt((x64**2).mean(axis=1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(ref.w_to_f32(ref.rms_norm(x, 1e-5, wtype)), normed, **TOL[wtype])
    w = ref.to_w(rng.standard_normal(96), wtype)
    rows = np.array([4, 1], np.int32)
    np.testing.assert_allclose(ref.w_to_f32(ref.rms_norm(x, 1e-5, wtype, rows, w)),
                               normed[rows] * ref.w_to_f32(w), **TOL[wtype])
    table = ref.to_w(rng.standard_normal((10, 8)), wtype)
    np.testing.assert_array_equal(ref.embed(table, np.array([3, 3, 0])), ref.w_to_f32(table)[[3, 3, 0]])
    gu = rng.standard_normal((3, 2 * 24)).astype(np.float32)
    g, u = gu[:, :24].astype(np.float64), gu[:, 24:]
    np.testing.assert_allclose(ref.w_to_f32(ref.silu_mul(gu, wtype)), g / (1 + np.exp(-g)) * u, **TOL[wtype])
    assert ref.wtype_of(ref.to_w(x, wtype)) == wtype
    np.testing.assert_array_equal(ref.f32_to_bf16(np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8], np.float32)),
                                  [0x3F80, 0x3F80, 0x3F82])  # ties to even


# ---- pick ----------------------------------------------------------------------------------------


def words_of(params: SamplingParams, key: int, choice: int, k: int) -> np.ndarray:
    """One row of engine/drivers/base.py pick_words."""
    f32 = np.array([max(params.temperature, 1e-6), params.top_p], np.float32).view(np.uint32)
    return np.array([1 if params.greedy else 2, key & M32, key >> 32, choice, k & M32, f32[0],
                     min(params.top_k, M32), f32[1]], np.uint32)


def on_an_edge(logits: np.ndarray, params: SamplingParams, u: float) -> bool:
    """Whether float32 rounding may move the pick: u near a CDF step, or a top-p level's
    mass near top_p."""
    p = probabilities(logits, params)
    if np.min(np.abs(np.cumsum(p) - u)) < 1e-5:
        return True
    q = probabilities(logits, SamplingParams(temperature=params.temperature, top_k=params.top_k))
    levels = np.unique(q)[::-1]
    ahead = np.array([q[q > v].sum() for v in levels])
    return params.top_p < 1 and bool(np.min(np.abs(ahead - params.top_p)) < 1e-5)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(vocab=st.integers(2, 3000), seed=st.integers(0, 2**64 - 1), k=st.integers(0, 2**32 - 1),
       choice=st.integers(0, 7), temperature=st.sampled_from([0.0, 0.05, 0.7, 1.0, 1.9]),
       top_k=st.sampled_from([0, 1, 2, 5, 50, 2999, 4000]), top_p=st.sampled_from([1.0, 0.95, 0.5, 0.1]),
       ties=st.booleans(), data_seed=st.integers(0, 2**32 - 1))
def test_pick_reference_is_the_samplers_token(vocab, seed, k, choice, temperature, top_k, top_p, ties, data_seed):
    rng = np.random.default_rng(data_seed)
    logits = (rng.integers(-4, 4, vocab) if ties else rng.standard_normal(vocab) * 3).astype(np.float32)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    words = words_of(params, seed, choice, k)[None]
    u = RandomStream(seed, choice).uniform(k)
    assert ref.pick_uniform(words)[0] == np.float32(u)  # bit for bit; u is exact in float32
    ids, _ = ref.pick(logits[None], words)
    want = sample(logits, params, u)
    assert ids[0] == want or (not params.greedy and on_an_edge(logits, params, u))


def test_pick_reference_host_rows_and_greedy_ties():
    logits = np.array([[1, 5, 5, 2], [0, 0, 0, 0]], np.float32)
    words = np.stack([words_of(SamplingParams(temperature=0), 1, 0, 0), words_of(SamplingParams(), 1, 0, 0)])
    words[1, 0] = 0  # the host picks this row
    ids, out = ref.pick(logits, words)
    assert ids.tolist() == [1, -1]  # greedy: the first of tied maxima
    np.testing.assert_array_equal(out, logits)


# ---- every kernel launched, against its reference: on a GPU, and on the CPU at 32 and 64 lanes ----


@pytest.fixture(scope="module")
def device(tmp_path_factory):
    return device_runner(tmp_path_factory.mktemp("device"))


@pytest.mark.parametrize("wtype", WTYPES)
def test_step_kernels_match_the_references(runner, wtype):
    cp, launch = runner
    i32, f32 = np.int32, np.float32
    step, _, rope, qkv = rope_inputs(4, wtype)
    t = len(step["positions"])
    d = {k: cp.asarray(v) for k, v in step.items() if isinstance(v, np.ndarray)}
    q = cp.zeros((t, HEADS * HD), cp.float32)
    kc, vc = d["k_cache"].copy(), d["v_cache"].copy()
    launch(f"rope_kv_write_{wtype}", (t,), cp.asarray(qkv), cp.asarray(rope), d["positions"], d["kv_slots"], q, kc, vc,
           i32(HEADS), i32(KVH), i32(HD))
    k_ref, v_ref = step["k_cache"].copy(), step["v_cache"].copy()
    q_ref = ref.rope_kv_write(qkv, rope, step["positions"], step["kv_slots"], k_ref, v_ref, HEADS, KVH, HD)
    np.testing.assert_allclose(q.get(), q_ref, rtol=1e-5, atol=1e-5)
    for got, want in ((kc, k_ref), (vc, v_ref)):
        np.testing.assert_allclose(ref.w_to_f32(got.get()), ref.w_to_f32(want), **TOL[wtype], equal_nan=True)
    out = cp.zeros((t, HEADS * HD), kc.dtype)
    launch(f"paged_attention_{wtype}", (t, HEADS), q, kc, vc, d["positions"], d["row_slot"], d["tables"], out,
           i32(HEADS), i32(KVH), i32(HD), i32(BS), i32(step["max_blocks"]))
    want = ref.paged_attention(q.get(), kc.get(), vc.get(), step["positions"], step["row_slot"], step["tables"], HEADS, KVH,
                               HD, BS)
    np.testing.assert_allclose(ref.w_to_f32(out.get()), ref.w_to_f32(want), **TOL[wtype])

    rng = np.random.default_rng(5)
    dim, vocab, inter = 200, 50, 72
    table = ref.to_w(rng.standard_normal((vocab, dim)), wtype)
    tokens = rng.integers(0, vocab, t).astype(i32)
    x = cp.zeros((t, dim), cp.float32)
    launch(f"embed_{wtype}", (t,), cp.asarray(table), cp.asarray(tokens), x, i32(dim))
    np.testing.assert_array_equal(x.get(), ref.embed(table, tokens))
    h = cp.zeros((t, dim), kc.dtype)
    launch(f"rms_norm_{wtype}", (t,), x, h, i32(dim), f32(1e-5))
    np.testing.assert_allclose(ref.w_to_f32(h.get()), ref.w_to_f32(ref.rms_norm(x.get(), 1e-5, wtype)), **TOL[wtype])
    rows, w = np.array([6, 0, 15], i32), ref.to_w(rng.standard_normal(dim), wtype)
    h = cp.zeros((3, dim), kc.dtype)
    launch(f"final_norm_{wtype}", (3,), x, cp.asarray(rows), cp.asarray(w), h, i32(dim), f32(1e-5))
    np.testing.assert_allclose(ref.w_to_f32(h.get()), ref.w_to_f32(ref.rms_norm(x.get(), 1e-5, wtype, rows, w)),
                               **TOL[wtype])
    gu = rng.standard_normal((t, 2 * inter)).astype(f32)
    act = cp.zeros((t, inter), kc.dtype)
    launch(f"silu_mul_{wtype}", (-(-t * inter // 256),), cp.asarray(gu), act, i32(t), i32(inter))
    np.testing.assert_allclose(ref.w_to_f32(act.get()), ref.w_to_f32(ref.silu_mul(gu, wtype)), **TOL[wtype])
    y = cp.asarray(rng.standard_normal((t, dim)).astype(f32))
    want = x.get() + y.get()
    launch("add_f32", (-(-t * dim // 256),), x, y, np.int64(t * dim))
    np.testing.assert_array_equal(x.get(), want)


def test_pick_matches_the_reference(runner):
    check_pick(*runner, 3000)


PICK_ELSEWHERE = r"""
import ctypes, pathlib, subprocess, sys
from tests.drivers.host_kernels import CXX
from tests.drivers.kernel_runners import host_runner
from tests.drivers.test_cuda_kernels import check_pick
folder = pathlib.Path(sys.argv[1])
(folder / "other.cc").write_text('extern "C" void pick(void) {}')
subprocess.run([CXX, "-shared", "-fPIC", str(folder / "other.cc"), "-o", str(folder / "other.so")], check=True)
ctypes.CDLL(str(folder / "other.so"), mode=ctypes.RTLD_GLOBAL)  # as MKL's core is, with its own pick
for lanes in (32, 64):
    check_pick(*host_runner(folder, lanes), 3000)
print("picked")
"""


def test_the_host_build_runs_its_own_kernels_beside_a_library_of_the_same_names(tmp_path):
    """A library loaded into the process before the host build, exporting a function named as
    a kernel (MKL's core exports `pick`), must not take that kernel's place: the host build
    binds its own symbols (a launch of the other `pick` did nothing and left every id 0)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-c", PICK_ELSEWHERE, str(tmp_path)], cwd=root, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0 and "picked" in run.stdout, run.stderr[-3000:]


def test_pick_over_a_large_vocabulary_on_the_device_matches_the_reference(device):
    check_pick(*device, 151936)


def check_pick(cp, launch, vocab: int):
    rng = np.random.default_rng(vocab)
    rows = []
    for i in range(24):
        params = SamplingParams(temperature=[0.0, 0.6, 1.0, 1.5][i % 4], top_k=[0, 3, 40, 0][i // 4 % 4],
                                top_p=[1.0, 0.9, 0.3][i % 3])
        rows.append(words_of(params, int(rng.integers(0, 2**63)), i % 3, int(rng.integers(0, 2**32))))
    words = np.stack(rows)
    words[5, 0] = 0  # a host row
    logits = (rng.standard_normal((len(words), vocab)) * 4).astype(np.float32)
    logits[1, [7, 9]] = logits[1].max() + 1  # a tie at the top
    u = cp.zeros(len(words), cp.float32)
    launch("pick_uniform", (1,), cp.asarray(words), u, np.int32(len(words)))
    np.testing.assert_array_equal(u.get(), ref.pick_uniform(words))
    z, ids = cp.asarray(logits), cp.zeros(len(words), cp.int32)
    launch("pick", (len(words),), z, cp.asarray(words), ids, np.int32(vocab))
    want, weights = ref.pick(logits, words)
    assert (ids.get() == want).mean() >= 23 / 24, (ids.get(), want)  # ulps of expf may move an edge pick
    np.testing.assert_allclose(z.get(), weights, rtol=1e-6, atol=1e-30)
