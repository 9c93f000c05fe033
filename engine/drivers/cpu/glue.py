"""The glue between a step's products as the op walk calls it: the norm, rotary with the K/V
write, SiLU times up (kernels/glue.py), and paged attention in place (kernels/attention.py),
one compiled call each instead of a handful of NumPy passes. Each runs serially on the calling
thread below GLUE_PARALLEL_MIN elements, across numba's threads above (the runtime decides
how many).

Paged attention: every fed token attends its own row's keys in place, block by block through
the row's block table, with an online softmax: no gathered copy of the context (the copy was
most of a many-row step's attention), no per-row Python loop. A decode token scores a block's
16 keys as one vector per head. A row fed several tokens (a prompt chunk, the few uncached
tokens of a prefix-cache hit, speculative verification) goes in tiles of 16 query vectors
that read each key once: 2-4x the one-query-at-a-time loop, and 1.3-2x causal tiles of MKL
products over a gathered copy, at 2 to 512 tokens against 16 to 2,048 keys.
"""

from __future__ import annotations

import numpy as np

from .kernels.sizes import GLUE_PARALLEL_MIN, TOKEN_RUN
from .products.few_tokens import FEW_TOKENS
from .runtime import Runtime


class Glue:
    """The glue kernels on `runtime`'s threads. `shared_pool`: the step's products run on the
    pool numba's kernels use (MKL on OpenMP), so attention may take the whole pool at any
    token count."""

    def __init__(self, runtime: Runtime, shared_pool: bool = False):
        runtime.compile()
        self.runtime, self.shared_pool = runtime, shared_pool
        self.k = runtime.kernels

    def rms_scale(self, x: np.ndarray, eps: float) -> np.ndarray:
        """x / rms(x) per token of a feature-major (features, T) float32 array."""
        out = np.empty_like(x)
        if x.size >= GLUE_PARALLEL_MIN:
            self.runtime.set_threads(True)
            self.k.glue.rms_scale(x, np.float32(eps), out, run_length(x.shape[1], self.runtime.threads()))
        else:
            self.k.glue.rms_run(x, np.float32(eps), out, 0, x.shape[1])
        return out

    def silu_mul(self, gate_up: np.ndarray) -> np.ndarray:
        """silu(gate) * up for a feature-major (2 inter, T) array of gate rows then up rows."""
        out = np.empty((gate_up.shape[0] // 2, gate_up.shape[1]), np.float32)
        if gate_up.size >= GLUE_PARALLEL_MIN:
            self.runtime.set_threads(True)
            self.k.glue.silu_mul(rows_of(gate_up), out)
        else:
            self.k.glue.silu_rows(rows_of(gate_up), out, 0, out.shape[0])
        return out

    def rope_store(self, qkv, rope, block, offset, cache, heads: int) -> np.ndarray:
        """Rotary on Q and K, K and V written to the paged cache; returns Q (T, heads, hd)."""
        q = np.empty((qkv.shape[1], heads, cache.shape[4]), np.float32)
        if qkv.size >= GLUE_PARALLEL_MIN:
            self.runtime.set_threads(True)
            self.k.glue.rope_store(rows_of(qkv), rope, block, offset, cache, q,
                                   run_length(q.shape[0], self.runtime.threads()))
        else:
            self.k.glue.rope_run(rows_of(qkv), rope, block, offset, cache, q, 0, q.shape[0])
        return q

    def paged_attention(self, q, cache, tables, table_of, lengths, out, tokens: int = 1) -> None:
        """q (Q, heads, hd) pre-scaled; query n attends keys 0 .. lengths[n] - 1 of the blocks
        tables[table_of[n]] of cache (2, kv_heads, blocks, block_size, hd); out (Q, heads * hd).
        Every array must already have the step's types (float32, int64). `tokens`: the step's
        fed tokens. A few-token step runs entirely on numba's threads; so does a larger one
        whose products run on the same pool (`shared_pool`); otherwise the second core is left
        to OpenBLAS, whose threads spin between products. A short context's attention still
        runs on the whole pool: switching numba's thread count down and back around it, twice
        a layer, cost a one-row step more (7.69 against 8.05 ms, steps interleaved in one run,
        contexts of 10-160 tokens)."""
        self.runtime.set_threads(self.shared_pool or tokens in FEW_TOKENS)
        self.k.attention.paged_attention(q, cache, tables, table_of, lengths, out)


def run_length(tokens: int, threads: int) -> int:
    """Tokens per run of the parallel glue kernels: the runs come in a multiple of the thread
    count, at most TOKEN_RUN each (runs of a flat 64 gave one of two threads 128 of a
    176-token chunk's tokens and the other 48)."""
    runs = threads * -(-tokens // (threads * TOKEN_RUN))
    return -(-tokens // runs)


def rows_of(a: np.ndarray) -> np.ndarray:
    """A C-contiguous array whose leading columns are `a`, for kernels that read only the
    columns they are told: `a` itself, or the array it is the leading columns of (MKL's
    products return such a view of their padded result). Passing views would make numba
    build a second, strided version of the kernel in the middle of serving."""
    if a.flags.c_contiguous:
        return a
    base = a.base
    if (isinstance(base, np.ndarray) and base.flags.c_contiguous and base.ndim == 2 and base.dtype == a.dtype
            and base.shape[0] == a.shape[0] and base.shape[1] >= a.shape[1] and a.strides == base.strides
            and a.ctypes.data == base.ctypes.data):
        return base
    return np.ascontiguousarray(a)
