"""The glue between a step's products, one compiled call each: the norm (rms_run, rms_scale),
SiLU times up (silu_rows, silu_mul), and rotary with the K/V write (rope_run, rope_store);
cpu/glue.py says when each runs and on how many threads.

Each thread takes runs of tokens (cpu/glue.py's run_length), the inner loops along contiguous
tokens. They index from a run's start with unsigned integers: with a
signed index numba adds a negative-index fix-up that stops LLVM from vectorizing
(measured: 3-4x slower), and a serial helper keeps the loops out of the parallel
region's body, where they did not vectorize either. The helpers are also the serial
entry points: a small step calls them on the calling thread, without changing the
thread team's size (flipping it between products cost a one-row step about 2 ms).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .numeric import ERRORS, FASTMATH, ROWS_PER_TASK, exp, kv_element


@njit(nogil=True, fastmath=FASTMATH, cache=True, boundscheck=False, error_model=ERRORS)
def rms_run(x, eps, out, t0, n):
    features = x.shape[0]
    base = np.uint64(t0)
    acc = np.zeros(n, np.float32)
    for f in range(features):
        for t in range(n):
            v = x[f, base + np.uint64(t)]
            acc[t] += v * v
    for t in range(n):
        acc[t] = np.float32(1) / np.float32(math.sqrt(acc[t] / features + eps))
    if n == 1:  # a lone token: one loop along the features vectorizes (the sum above keeps its order)
        scale = acc[0]
        for f in range(features):
            out[f, base] = x[f, base] * scale
        return
    for f in range(features):
        for t in range(n):
            out[f, base + np.uint64(t)] = x[f, base + np.uint64(t)] * acc[t]


@njit(parallel=True, nogil=True, fastmath=FASTMATH, cache=True, boundscheck=False, error_model=ERRORS)
def rms_scale(x, eps, out, size):
    """out = x / rms(x) per token of a feature-major x (features, T)."""
    tokens = x.shape[1]
    for run in prange((tokens + size - 1) // size):
        rms_run(x, eps, out, run * size, min(size, tokens - run * size))


@njit(nogil=True, fastmath=FASTMATH, cache=True, boundscheck=False, error_model=ERRORS)
def silu_rows(gate_up, out, f0, n):
    inter, tokens = out.shape
    base = np.uint64(f0)
    if tokens == 1:  # a lone token: one loop along the features vectorizes (the nested one stayed scalar)
        for f in range(n):
            u = base + np.uint64(f)
            g = gate_up[u, 0]
            out[u, 0] = g / (np.float32(1) + exp(-g)) * gate_up[np.uint64(inter) + u, 0]
        return
    for f in range(n):
        u = base + np.uint64(f)
        for t in range(tokens):
            g = gate_up[u, t]
            out[u, t] = g / (np.float32(1) + exp(-g)) * gate_up[np.uint64(inter) + u, t]


@njit(parallel=True, nogil=True, fastmath=FASTMATH, cache=True, boundscheck=False, error_model=ERRORS)
def silu_mul(gate_up, out):
    """out = silu(gate) * up, gate_up (2 inter, T) feature-major."""
    inter = out.shape[0]
    for run in prange((inter + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        silu_rows(gate_up, out, run * ROWS_PER_TASK, min(ROWS_PER_TASK, inter - run * ROWS_PER_TASK))


@njit(nogil=True, fastmath=FASTMATH, cache=True, boundscheck=False, error_model=ERRORS)
def rope_run(qkv, rope, block, offset, cache, q_out, t0, n):
    heads, hd = q_out.shape[1], q_out.shape[2]
    kv_heads = cache.shape[1]
    base = np.uint64(t0)
    for h in range(heads + kv_heads):
        for j in range(0, hd, 2):
            for t in range(n):
                u = base + np.uint64(t)
                c, s = rope[u, j], rope[u, j + 1]
                re, im = qkv[h * hd + j, u], qkv[h * hd + j + 1, u]
                r0, r1 = re * c - im * s, re * s + im * c
                if h < heads:
                    q_out[u, h, j], q_out[u, h, j + 1] = r0, r1
                else:
                    b, o = block[u], offset[u]
                    cache[0, h - heads, b, o, j] = kv_element(r0, cache)
                    cache[0, h - heads, b, o, j + 1] = kv_element(r1, cache)
    vbase = (heads + kv_heads) * hd
    for h in range(kv_heads):
        for e in range(hd):
            for t in range(n):
                u = base + np.uint64(t)
                cache[1, h, block[u], offset[u], e] = kv_element(qkv[vbase + h * hd + e, u], cache)


@njit(parallel=True, nogil=True, fastmath=FASTMATH, cache=True, boundscheck=False, error_model=ERRORS)
def rope_store(qkv, rope, block, offset, cache, q_out, size):
    """Rotates each token's Q and K heads (adjacent pairs are one complex number; rope
    (T, hd) holds cos, sin interleaved for each token's position), writes K and V into
    the paged cache at (block, offset), and Q token-major into q_out (T, heads, hd).
    Runs of tokens go to threads independently: no two tokens of a step share a slot."""
    tokens = q_out.shape[0]
    for run in prange((tokens + size - 1) // size):
        rope_run(qkv, rope, block, offset, cache, q_out, run * size, min(size, tokens - run * size))
