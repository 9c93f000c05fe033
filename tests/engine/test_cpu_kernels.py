"""The CPU driver's compiled kernels agree with plain NumPy on every shape they accept.

Invariants:
- few_token_matmul(W, X) == W @ X for every token count it is used for;
- paged_attention gives each query softmax(q . K[:length]) V[:length] over its own row's
  blocks, read in place through the block table (no gathered copy), for any tables,
  lengths (partial last blocks) and GQA grouping; keys past a query's length never count;
- a row fed several tokens (consecutive queries of one table) goes in lane tiles, which
  agree with the same reference for any token count, grouping (tiles of 16 // group tokens,
  or one query at a time past 8 heads a group), block size and head size, and are not
  touched by NaN in keys or values past a query's length;
- all of it alike on a float16 cache (uint16 bits: numba has no float16), against the same
  reference on the float16 values widened; rope_store rounds what it writes there to the
  nearest float16.
"""

from __future__ import annotations

import platform
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poot.engine.drivers.cpu.glue import Glue, run_length
from poot.engine.drivers.cpu.kernels.sizes import TOKEN_RUN
from poot.engine.drivers.cpu.products import float_product
from poot.engine.drivers.cpu.products.few_tokens import FEW_TOKENS
from poot.engine.drivers.cpu.runtime import shared

runtime = shared()
pytestmark = pytest.mark.skipif(not runtime.available(), reason=runtime.unavailable_reason())
glue = Glue(runtime) if runtime.available() else None


def stored(cache: np.ndarray, half: bool) -> np.ndarray:
    """The cache as the kernels take it: float32, or float16 bits as uint16."""
    return cache.astype(np.float16).view(np.uint16) if half else cache


def values_of(cache: np.ndarray) -> np.ndarray:
    """What a stored cache holds, as float32."""
    return cache.view(np.float16).astype(np.float32) if cache.dtype == np.uint16 else cache


def reference_attention(q, cache, tables, table_of, lengths):
    """float64, one query at a time, keys gathered explicitly."""
    cache = values_of(cache)
    n, heads, hd = q.shape
    kvh = cache.shape[1]
    group = heads // kvh
    out = np.zeros((n, heads * hd))
    for i in range(n):
        blocks = tables[table_of[i]]
        keys = cache[0][:, blocks].reshape(kvh, -1, hd)[:, : lengths[i]].astype(np.float64)
        values = cache[1][:, blocks].reshape(kvh, -1, hd)[:, : lengths[i]].astype(np.float64)
        for h in range(heads):
            s = keys[h // group] @ q[i, h].astype(np.float64)
            p = np.exp(s - s.max())
            out[i, h * hd : (h + 1) * hd] = (p / p.sum()) @ values[h // group]
    return out


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 6), kv_heads=st.sampled_from([1, 2, 3]),
       group=st.sampled_from([1, 2, 3, 4, 5]), block_size=st.sampled_from([1, 4, 16]), hd=st.sampled_from([8, 64]),
       half=st.booleans())
def test_paged_attention_matches_reference(seed, rows, kv_heads, group, block_size, hd, half):
    rng = np.random.default_rng(seed)
    num_blocks = 64
    cache = stored(rng.standard_normal((2, kv_heads, num_blocks, block_size, hd), dtype=np.float32), half)
    width = int(rng.integers(1, num_blocks // rows + 1))
    tables = rng.permutation(num_blocks)[: rows * width].reshape(rows, width).astype(np.int64)
    n = int(rng.integers(1, 12))
    table_of = rng.integers(0, rows, n).astype(np.int64)
    lengths = rng.integers(1, width * block_size + 1, n).astype(np.int64)
    q = rng.standard_normal((n, kv_heads * group, hd), dtype=np.float32)
    out = np.empty((n, kv_heads * group * hd), np.float32)
    glue.paged_attention(q, cache, tables, table_of, lengths, out)
    np.testing.assert_allclose(out, reference_attention(q, cache, tables, table_of, lengths), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("half", [False, True], ids=["float32", "float16"])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5])
def test_decode_attention_on_whole_blocks_for_every_group_size(group, half):
    """Blocks of 16 keys at head size 64 take the compiled paths: a key and value read once for
    the group (the group sizes listed in SHARED_GROUPS) or once a head (the others)."""
    rng = np.random.default_rng(group)
    kv_heads, rows, width = 2, 5, 6
    cache = stored(rng.standard_normal((2, kv_heads, 64, 16, 64), dtype=np.float32), half)
    tables = rng.permutation(64)[: rows * width].reshape(rows, width).astype(np.int64)
    table_of = np.arange(rows, dtype=np.int64)
    lengths = np.array([16, 96, 37, 64, 1], np.int64)  # whole blocks, then partial ones
    q = 3 * rng.standard_normal((rows, kv_heads * group, 64), dtype=np.float32)
    out = np.empty((rows, kv_heads * group * 64), np.float32)
    glue.paged_attention(q, cache, tables, table_of, lengths, out)
    np.testing.assert_allclose(out, reference_attention(q, cache, tables, table_of, lengths), atol=2e-5, rtol=1e-4)


def row_queries(rng, rows, kv_heads, group, block_size, hd, num_blocks=96):
    """Each row fed a run of consecutive tokens, as a step lays out a row's tokens."""
    width = num_blocks // rows
    tables = rng.permutation(num_blocks)[: rows * width].reshape(rows, width).astype(np.int64)
    table_of, lengths = [], []
    for r in range(rows):
        fed = int(rng.integers(1, 21))
        start = int(rng.integers(0, width * block_size - fed + 1))
        table_of += [r] * fed
        lengths += range(start + 1, start + fed + 1)  # each token sees up to its own position
    table_of, lengths = np.array(table_of, np.int64), np.array(lengths, np.int64)
    q = rng.standard_normal((len(table_of), kv_heads * group, hd), dtype=np.float32)
    return q, tables, table_of, lengths


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 4), kv_heads=st.sampled_from([1, 3]),
       group=st.sampled_from([1, 3, 4, 8, 20]), block_size=st.sampled_from([1, 4, 16]), hd=st.sampled_from([6, 64]),
       half=st.booleans())
def test_paged_attention_tiles_of_a_rows_tokens(seed, rows, kv_heads, group, block_size, hd, half):
    rng = np.random.default_rng(seed)
    cache = stored(rng.standard_normal((2, kv_heads, 96, block_size, hd), dtype=np.float32), half)
    q, tables, table_of, lengths = row_queries(rng, rows, kv_heads, group, block_size, hd)
    out = np.empty((len(q), kv_heads * group * hd), np.float32)
    glue.paged_attention(q, cache, tables, table_of, lengths, out)
    np.testing.assert_allclose(out, reference_attention(q, cache, tables, table_of, lengths), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("half", [False, True], ids=["float32", "float16"])
def test_paged_attention_tiles_ignore_nan_past_the_length(half):
    rng = np.random.default_rng(2)
    block_size, hd, group = 4, 8, 3
    cache = stored(rng.standard_normal((2, 1, 96, block_size, hd), dtype=np.float32), half)
    nan = np.float16(np.nan).view(np.uint16) if half else np.nan
    tables = rng.permutation(96)[:24][None, :].astype(np.int64)
    lengths = np.arange(76, 83, dtype=np.int64)  # 7 tokens; the last sees 82 keys, half its last block
    table_of = np.zeros(len(lengths), np.int64)
    q = rng.standard_normal((len(lengths), group, hd), dtype=np.float32)
    before = np.empty((len(q), group * hd), np.float32)
    glue.paged_attention(q, cache, tables, table_of, lengths, before)
    cache[:, :, tables[0, 20], 2:] = nan  # the row's keys past its last token's position
    cache[:, :, tables[0, 21:]] = nan
    cache[:, :, np.setdiff1d(np.arange(96), tables[0])] = nan  # blocks that are not the row's
    after = np.empty_like(before)
    glue.paged_attention(q, cache, tables, table_of, lengths, after)
    np.testing.assert_array_equal(before, after)


@pytest.mark.parametrize("half", [False, True], ids=["float32", "float16"])
def test_paged_attention_ignores_keys_past_the_length(half):
    rng = np.random.default_rng(1)
    cache = stored(rng.standard_normal((2, 1, 4, 4, 8), dtype=np.float32), half)
    big = np.float16(1e3).view(np.uint16) if half else 1e3
    q = rng.standard_normal((1, 1, 8), dtype=np.float32)
    tables = np.array([[2, 0]], dtype=np.int64)
    args = (tables, np.zeros(1, np.int64), np.array([5], np.int64))
    before = np.empty((1, 8), np.float32)
    glue.paged_attention(q, cache, *args, before)
    cache[:, :, 0, 1:] = big  # keys 6.. of the row: past its length
    cache[:, :, 1] = big  # a block that is not the row's
    after = np.empty((1, 8), np.float32)
    glue.paged_attention(q, cache, *args, after)
    np.testing.assert_array_equal(before, after)


@pytest.mark.parametrize("tokens", sorted(FEW_TOKENS))
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (37, 5)])
def test_few_token_matmul_matches_blas(tokens, shape):
    rng = np.random.default_rng(tokens)
    w = rng.standard_normal(shape, dtype=np.float32)
    x = rng.standard_normal((shape[1], tokens), dtype=np.float32)
    np.testing.assert_allclose(float_product(w, runtime, use_mkl=False).run(x), w.astype(np.float64) @ x, atol=1e-3, rtol=1e-4)


def test_matmul_outside_the_few_token_range_is_blas():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 32), dtype=np.float32)
    for tokens in (max(FEW_TOKENS) + 1, 40):
        x = rng.standard_normal((32, tokens), dtype=np.float32)
        np.testing.assert_array_equal(float_product(w, runtime, use_mkl=False).run(x), w @ x)


@pytest.mark.parametrize("tokens", [1, 5, 33, 300])
def test_glue_kernels_match_numpy(tokens):
    """rms_scale and silu_mul, serial for a few tokens and split across threads for many
    (SmolLM2's widths: both sides of GLUE_PARALLEL_MIN), agree with NumPy, silu over the whole
    float32 range of its exp (saturating, no inf/nan)."""
    rng = np.random.default_rng(tokens)
    x = (rng.standard_normal((576, tokens)) * 3).astype(np.float32)
    want = x / np.sqrt((x.astype(np.float64) ** 2).mean(axis=0, keepdims=True) + 1e-5)
    np.testing.assert_allclose(glue.rms_scale(x, 1e-5), want, rtol=1e-5, atol=1e-6)
    gate_up = (rng.standard_normal((2 * 1536, tokens)) * 30).astype(np.float32)
    gate_up[0, 0], gate_up[1, 0] = 200.0, -200.0  # exp(-g) past float32's range either way
    g = gate_up[:1536].astype(np.float64)
    want = g / (1 + np.exp(-g)) * gate_up[1536:]
    got = glue.silu_mul(gate_up)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # The leading columns of a wider array (MKL's padded products): same result, and no
    # second version of the kernel for the strided layout.
    built = runtime.specializations()
    wide = np.full((gate_up.shape[0], tokens + 11), np.nan, np.float32)
    wide[:, :tokens] = gate_up
    np.testing.assert_array_equal(glue.silu_mul(wide[:, :tokens]), got)
    assert runtime.specializations() == built


@pytest.mark.parametrize("half", [False, True], ids=["float32", "float16"])
@pytest.mark.parametrize("tokens", [1, 3, 200])
def test_rope_store_rotates_q_and_k_and_writes_the_cache(tokens, half):
    rng = np.random.default_rng(tokens)
    heads, kvh, hd, block_size = 9, 3, 64, 4  # SmolLM2's: 200 tokens take the parallel path
    qkv = rng.standard_normal(((heads + 2 * kvh) * hd, tokens)).astype(np.float32)
    angles = rng.uniform(0, 6.3, (tokens, hd // 2))
    rope = np.stack([np.cos(angles), np.sin(angles)], axis=-1).reshape(tokens, hd).astype(np.float32)
    slots = rng.permutation(64 * block_size)[:tokens]
    block, offset = (slots // block_size).astype(np.int64), (slots % block_size).astype(np.int64)
    cache = np.zeros((2, kvh, 64, block_size, hd), np.uint16 if half else np.float32)
    q = glue.rope_store(qkv, rope, block, offset, cache, heads)
    rot = np.exp(1j * angles)[:, None, :]
    heads_of = np.ascontiguousarray(qkv.T).reshape(tokens, heads + 2 * kvh, hd)
    rotated = (np.ascontiguousarray(heads_of[:, : heads + kvh], np.float64).view(np.complex128) * rot).view(np.float64)
    np.testing.assert_allclose(q, rotated[:, :heads], rtol=1e-5, atol=1e-5)
    keys, values = values_of(cache[0])[:, block, offset], values_of(cache[1])[:, block, offset]
    # float16 keeps 11 significant bits: a rounded key is within half a unit in the last place.
    np.testing.assert_allclose(keys, rotated[:, heads:].transpose(1, 0, 2), rtol=2.0**-11 + 1e-5 if half else 1e-5,
                               atol=1e-5)
    v = heads_of[:, heads + kvh:].transpose(1, 0, 2)
    np.testing.assert_array_equal(values, v.astype(np.float16).astype(np.float32) if half else v)


def test_a_second_process_loads_every_kernel_from_numbas_cache():
    """Every server start prepares the kernels: built from scratch they take about 12 s, from
    numba's on-disk cache well under one. A kernel that calls a helper numba cannot cache
    (a closure variable, for one) is silently rebuilt in every process."""
    import subprocess
    import sys

    probe = ("from poot.engine.drivers.cpu.runtime import shared; r = shared(); r.compile(); "
             "print(sum(len(k.stats.cache_misses) for k in r.cached()))")
    for _ in range(2):  # the first may fill the cache
        run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "0", f"kernels rebuilt in a fresh process: {run.stdout.strip()}"


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="reads x86-64 assembly")
def test_silu_divides_whole_vectors():
    """SiLU's loop has a division. Under Python's error model numba checks every divisor for
    zero and the loop stays scalar (6x slower at a prompt's width); the kernels use NumPy's."""
    import numba

    from poot.engine.drivers.cpu.kernels import glue as nb

    # A fresh build with the kernel's own options: numba shows no assembly for cached code.
    options = {k: v for k, v in nb.silu_rows.targetoptions.items() if k not in ("cache", "nopython")}
    fresh = numba.njit(**options)(nb.silu_rows.py_func)
    fresh(np.ones((8, 40), np.float32), np.empty((4, 40), np.float32), 0, 4)
    asm = "".join(fresh.inspect_asm().values())
    assert re.search(r"\b(vdivps|vrcp14ps|vrcpps)\b", asm), "SiLU's division is not vectorized"


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
@pytest.mark.parametrize("tokens", [1, 63, 64, 80, 176, 200, 512, 2048])
def test_glue_runs_give_every_thread_the_same_number_of_runs(tokens, threads):
    """A 176-token chunk in runs of 64 gave one of two threads 128 tokens and the other 48.
    Runs now come in a multiple of the thread count, as even as whole tokens allow, and
    no longer than TOKEN_RUN."""
    run = run_length(tokens, threads)
    runs = -(-tokens // run)
    assert 1 <= run <= TOKEN_RUN
    assert runs % threads == 0 or runs < threads
    assert runs * run - tokens < runs  # the last run is short by less than one token per run


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), tokens=st.integers(2, 40), scale=st.sampled_from([0.01, 1.0, 30.0]))
def test_a_lone_tokens_norm_and_silu_are_its_bits_among_many(seed, tokens, scale):
    """A lone token takes the glue's own loop along its features (the one along tokens stayed
    scalar: SiLU 7 against 0.5 us a layer of SmolLM2), and gets the same bits as beside others:
    a token's result does not depend on the rest of its step."""
    from poot.engine.drivers.cpu.kernels import glue as kernels

    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((576, tokens)) * scale).astype(np.float32)
    gate_up = (rng.standard_normal((2 * 1536, tokens)) * scale * 10).astype(np.float32)
    norms, acts = np.empty_like(x), np.empty((1536, tokens), np.float32)
    kernels.rms_run(x, np.float32(1e-5), norms, 0, tokens)
    kernels.silu_rows(gate_up, acts, 0, 1536)
    for t in (0, tokens // 2, tokens - 1):
        norm, act = np.empty((576, 1), np.float32), np.empty((1536, 1), np.float32)
        kernels.rms_run(np.ascontiguousarray(x[:, t : t + 1]), np.float32(1e-5), norm, 0, 1)
        kernels.silu_rows(np.ascontiguousarray(gate_up[:, t : t + 1]), act, 0, 1536)
        assert np.array_equal(norm[:, 0], norms[:, t]) and np.array_equal(act[:, 0], acts[:, t])
