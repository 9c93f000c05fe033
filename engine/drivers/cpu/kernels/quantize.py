"""The activations as every product on block codes takes them: quantized to 16 bits per block
of 32, v = round(x * colscale / dx) in -LEVELS..LEVELS, dx = max |x * colscale| / LEVELS
per block (integer.py says why 16 bits). `quantize_words` gives the integer kernel's layout
(integer_layout.py); `quantize` the plain one, and `dequantize` its values for the float paths.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .integer_layout import BLOCK, GROUP
from .numeric import ERRORS, FASTMATH

LEVELS = 127 * 256 + 127  # an activation's most magnitude: 256 qh + ql with qh, ql signed bytes
SERIAL_QUANTIZE = 1 << 13  # activations up to this many are quantized on the calling thread
# Quantizing, tokens a task takes (16: a vector of float32 lanes), and below how many a step's
# tokens are taken one by one: on a 2-core Xeon, 32 tokens of 576 features took 18 us across
# tokens against 45 one by one; 1 token 1.7 us one by one against 3.8.
QUANTIZE_TOKENS, FEW_TOKENS = 16, 4
# The quantizing kernels' float flags (their inlined helpers take the kernel's): no
# reassociation or reciprocals, so each value is round(x * colscale * (LEVELS / top)) as written,
# whether quantize_words takes a token alone or in vector lanes beside others (with them, 1 in
# some 10^4 values rounded the other way), and whichever path's quantizer (quantize) took it.
QUANTIZE_MATH = {"nsz", "contract", "afn"}


@njit(inline="always", fastmath=FASTMATH, boundscheck=False, error_model=ERRORS)
def _block_scale(x, colscale, lo, t):
    """(dx, 1 / dx) of token t's block from feature lo: dx = max |x * colscale| / LEVELS."""
    top = np.float32(0)
    for j in range(BLOCK):
        top = max(top, abs(x[lo + j, t] * colscale[lo + j]))
    return top / np.float32(LEVELS), (np.float32(LEVELS) / top if top > 0 else np.float32(0))


@njit(inline="always", fastmath=FASTMATH, boundscheck=False, error_model=ERRORS)
def _quantize_token(x, colscale, qh, ql, dx, c, t):
    for b in range(x.shape[0] // BLOCK):
        lo = b * BLOCK
        scale, inv = _block_scale(x, colscale, lo, t)
        total = 0
        for j in range(BLOCK):
            v = np.int32(np.rint(x[lo + j, t] * colscale[lo + j] * inv))
            high = (v + 128) >> 8
            qh[t, lo + j] = high
            ql[t, lo + j] = v - (high << 8)
            total += v
        dx[t, b] = scale
        c[t, b] = scale * np.float32(total)


@njit(inline="always", boundscheck=False, error_model=ERRORS)
def _lanes_of(b, grouped):
    """(first lane, lanes) of block b in lane layout: a lane each in the runs of GROUP, then
    runs of 2 blocks, 8 lanes each."""
    if b < grouped:
        return b, 1
    return grouped + (b - grouped) // 2 * 16 + (b - grouped) % 2 * 8, 8


@njit(inline="always", boundscheck=False, error_model=ERRORS)
def _quantize_token_words(x, colscale, order, v, dx, c, t):
    """One token's v, dx and c as _quantize_words gives them, a block's values one by one: a
    step of few tokens is quicker so than in _quantize_words' loops over tokens. The same
    operations in the same order (no reassociation: QUANTIZE_MATH), so the same bits."""
    grouped = x.shape[0] // BLOCK // GROUP * GROUP
    for b in range(x.shape[0] // BLOCK):
        lo = b * BLOCK
        scale, inv = _block_scale(x, colscale, lo, t)
        total = 0
        for j in range(BLOCK):
            q = np.int32(np.rint(x[lo + j, t] * colscale[lo + j] * inv))
            v[t, order[lo + j]] = q
            total += q
        lane, lanes = _lanes_of(b, grouped)
        for e in range(lanes):
            dx[t, lane + e] = scale
            c[t, lane + e] = 0
        c[t, lane] = scale * np.float32(total)


@njit(inline="always", boundscheck=False, error_model=ERRORS)
def _quantize_words(x, colscale, order, v, dx, c, t0, t1):
    """_quantize_token's v for tokens t0 .. t1 as one int16 each, in kernel order; dx and c in
    lane layout (lane_scales: c on a block's first lane, 0 on the others). x is feature-major,
    so the innermost loops run over tokens, contiguous in x: several tokens' blocks a vector."""
    grouped = x.shape[0] // BLOCK // GROUP * GROUP  # blocks in runs of GROUP
    count = t1 - t0
    top = np.empty(count, np.float32)
    inv = np.empty(count, np.float32)
    total = np.empty(count, np.int32)
    for b in range(x.shape[0] // BLOCK):
        lo = b * BLOCK
        for k in range(count):  # loops, not slices: in a parallel kernel a slice becomes a parallel loop
            top[k] = 0
            total[k] = 0
        for j in range(BLOCK):
            s = colscale[lo + j]
            for k in range(count):
                top[k] = max(top[k], abs(x[lo + j, t0 + k] * s))
        for k in range(count):
            inv[k] = np.float32(LEVELS) / top[k] if top[k] > 0 else np.float32(0)
        for j in range(BLOCK):
            s, at = colscale[lo + j], order[lo + j]
            for k in range(count):
                q = np.int32(np.rint(x[lo + j, t0 + k] * s * inv[k]))
                v[t0 + k, at] = q
                total[k] += q
        lane, lanes = _lanes_of(b, grouped)
        for k in range(count):
            scale = top[k] / np.float32(LEVELS)
            for e in range(lanes):
                dx[t0 + k, lane + e] = scale
                c[t0 + k, lane + e] = 0
            c[t0 + k, lane] = scale * np.float32(total[k])


@njit(parallel=True, nogil=True, fastmath=QUANTIZE_MATH, cache=True, boundscheck=False, error_model=ERRORS)
def quantize_words(x, colscale, order, v, dx, c):
    """x (i, T) -> v (T, i) int16 in kernel order, dx and c (T, lane_width(i / BLOCK)) as
    quantize() gives them, in lane layout."""
    tokens = x.shape[1]
    if tokens < FEW_TOKENS:
        for t in range(tokens):
            _quantize_token_words(x, colscale, order, v, dx, c, t)
        return
    if tokens * x.shape[0] <= SERIAL_QUANTIZE:  # waking the pool costs more
        _quantize_words(x, colscale, order, v, dx, c, 0, tokens)
        return
    for task in prange((tokens + QUANTIZE_TOKENS - 1) // QUANTIZE_TOKENS):
        t0 = task * QUANTIZE_TOKENS
        _quantize_words(x, colscale, order, v, dx, c, t0, min(tokens, t0 + QUANTIZE_TOKENS))


@njit(parallel=True, nogil=True, fastmath=QUANTIZE_MATH, cache=True, boundscheck=False, error_model=ERRORS)
def quantize(x, colscale, qh, ql, dx, c):
    """x (i, T) feature-major float32 -> v = round(x * colscale / dx) in -LEVELS..LEVELS per
    block, kept as v = 256 qh + ql, two signed bytes (T, i) each; dx (T, i / BLOCK) the block
    scales; c (T, i / BLOCK) = dx * sum(v) per block (the term the codes' offsets multiply)."""
    for t in prange(x.shape[1]):
        _quantize_token(x, colscale, qh, ql, dx, c, t)


@njit(parallel=True, nogil=True, fastmath=FASTMATH, cache=True, boundscheck=False, error_model=ERRORS)
def dequantize(qh, ql, dx, out):
    """out (i, T) = (256 qh + ql) * dx: the quantized activations as float32, for the float
    products that must give what the integer ones give."""
    tokens, i = qh.shape
    for t in prange(tokens):
        for e in range(i):
            out[e, t] = np.float32((np.int32(qh[t, e]) << 8) + np.int32(ql[t, e])) * dx[t, e // BLOCK]
