"""The CPU driver's compiled kernels agree with plain NumPy on every shape they accept.

Invariants:
- few_token_matmul(W, X) == W @ X for every token count it is used for;
- paged_attention gives each query softmax(q . K[:length]) V[:length] over its own row's
  blocks, read in place through the block table (no gathered copy), for any tables,
  lengths (partial last blocks) and GQA grouping; keys past a query's length never count.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poot.engine.drivers import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason=cpu_kernels.unavailable_reason())


def reference_attention(q, cache, tables, table_of, lengths):
    """float64, one query at a time, keys gathered explicitly."""
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
       group=st.sampled_from([1, 3]), block_size=st.sampled_from([1, 4, 16]), hd=st.sampled_from([8, 64]))
def test_paged_attention_matches_reference(seed, rows, kv_heads, group, block_size, hd):
    rng = np.random.default_rng(seed)
    num_blocks = 64
    cache = rng.standard_normal((2, kv_heads, num_blocks, block_size, hd), dtype=np.float32)
    width = int(rng.integers(1, num_blocks // rows + 1))
    tables = rng.permutation(num_blocks)[: rows * width].reshape(rows, width).astype(np.int64)
    n = int(rng.integers(1, 12))
    table_of = rng.integers(0, rows, n).astype(np.int64)
    lengths = rng.integers(1, width * block_size + 1, n).astype(np.int64)
    q = rng.standard_normal((n, kv_heads * group, hd), dtype=np.float32)
    out = np.empty((n, kv_heads * group * hd), np.float32)
    cpu_kernels.paged_attention(q, cache, tables, table_of, lengths, out)
    np.testing.assert_allclose(out, reference_attention(q, cache, tables, table_of, lengths), atol=2e-5, rtol=1e-4)


def test_paged_attention_ignores_keys_past_the_length():
    rng = np.random.default_rng(1)
    cache = rng.standard_normal((2, 1, 4, 4, 8), dtype=np.float32)
    q = rng.standard_normal((1, 1, 8), dtype=np.float32)
    tables = np.array([[2, 0]], dtype=np.int64)
    args = (tables, np.zeros(1, np.int64), np.array([5], np.int64))
    before = np.empty((1, 8), np.float32)
    cpu_kernels.paged_attention(q, cache, *args, before)
    cache[:, :, 0, 1:] = 1e3  # keys 6.. of the row: past its length
    cache[:, :, 1] = 1e3  # a block that is not the row's
    after = np.empty((1, 8), np.float32)
    cpu_kernels.paged_attention(q, cache, *args, after)
    np.testing.assert_array_equal(before, after)


@pytest.mark.parametrize("tokens", sorted(cpu_kernels.FEW_TOKENS))
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (37, 5)])
def test_few_token_matmul_matches_blas(tokens, shape):
    rng = np.random.default_rng(tokens)
    w = rng.standard_normal(shape, dtype=np.float32)
    x = rng.standard_normal((shape[1], tokens), dtype=np.float32)
    np.testing.assert_allclose(cpu_kernels.matmul(w, x), w.astype(np.float64) @ x, atol=1e-3, rtol=1e-4)


def test_matmul_outside_the_few_token_range_is_blas():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 32), dtype=np.float32)
    for tokens in (max(cpu_kernels.FEW_TOKENS) + 1, 40):
        x = rng.standard_normal((32, tokens), dtype=np.float32)
        np.testing.assert_array_equal(cpu_kernels.matmul(w, x), w @ x)
