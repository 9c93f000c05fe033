"""Few-token products over block codes (engine/models/block_codes.py): a weight is
fl(d * q) + m with one byte q a weight and (d, m) per block of 32 along the row, so a product
reads a quarter of the float32 matrix's bytes, and a few-token step is bound by bytes.

    out[r, t] = sum_b d[r, b] * (q[r, b] . xs[t, b]) + m[r, b] * sum(xs[t, b])
    xs[t, e] = x[e, t] * colscale[e]

colscale: the RMSNorm weight the float32 path folds into the matrix's columns (folding it
into codes would break the blocks), applied to the activation instead. The sums regroup the
float32 product's terms, so results differ from it by rounding only (~1e-6 relative).

The float block path's kernel (products/float_block.py).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .numeric import ERRORS, FASTMATH

BLOCK = 32
ROWS_PER_TASK = 32  # as few_token_matmul: enough work per task to hide its start-up


@njit(nogil=True, fastmath=FASTMATH, cache=True, boundscheck=False, error_model=ERRORS)
def block_inputs(x, colscale, xt, sx):
    """xt (T, i) = (x * colscale[:, None]).T, sx (T, i / BLOCK) its block sums."""
    i, tokens = x.shape
    for e in range(i):
        c = colscale[e]
        for t in range(tokens):
            xt[t, e] = x[e, t] * c
    for t in range(tokens):
        for b in range(i // BLOCK):
            s = np.float32(0)
            for j in range(BLOCK):
                s += xt[t, b * BLOCK + j]
            sx[t, b] = s


@njit(nogil=True, fastmath=FASTMATH, cache=True, boundscheck=False, error_model=ERRORS)
def block_rows(codes, d, m, xt, sx, out, add, r0, r1):
    """Rows r0..r1 of the product, four at a time (each load of xt serves four rows; the
    four rows' codes stay in L1 across the tokens); `add`: accumulate into out (the
    residual adds). Each block is read through slices with a plain range index: so LLVM
    widens 16 codes a vector (indexing the row with a computed offset gave gathers, 3x
    slower)."""
    nb = codes.shape[1] // BLOCK
    tokens = xt.shape[0]
    r = r0
    while r + 4 <= r1:
        for t in range(tokens):
            x = xt[t]
            a0 = a1 = a2 = a3 = np.float32(0)
            for b in range(nb):
                lo = b * BLOCK
                q0, q1 = codes[r, lo : lo + BLOCK], codes[r + 1, lo : lo + BLOCK]
                q2, q3 = codes[r + 2, lo : lo + BLOCK], codes[r + 3, lo : lo + BLOCK]
                xb = x[lo : lo + BLOCK]
                s0 = s1 = s2 = s3 = np.float32(0)
                for j in range(BLOCK):
                    xv = xb[j]
                    s0 += np.float32(q0[j]) * xv
                    s1 += np.float32(q1[j]) * xv
                    s2 += np.float32(q2[j]) * xv
                    s3 += np.float32(q3[j]) * xv
                sb = sx[t, b]
                a0 += d[r, b] * s0 + m[r, b] * sb
                a1 += d[r + 1, b] * s1 + m[r + 1, b] * sb
                a2 += d[r + 2, b] * s2 + m[r + 2, b] * sb
                a3 += d[r + 3, b] * s3 + m[r + 3, b] * sb
            if add:
                a0, a1, a2, a3 = a0 + out[r, t], a1 + out[r + 1, t], a2 + out[r + 2, t], a3 + out[r + 3, t]
            out[r, t], out[r + 1, t], out[r + 2, t], out[r + 3, t] = a0, a1, a2, a3
        r += 4
    while r < r1:  # rows left over when the count is not a multiple of four
        for t in range(tokens):
            x = xt[t]
            a0 = np.float32(0)
            for b in range(nb):
                lo = b * BLOCK
                q0, xb = codes[r, lo : lo + BLOCK], x[lo : lo + BLOCK]
                s0 = np.float32(0)
                for j in range(BLOCK):
                    s0 += np.float32(q0[j]) * xb[j]
                a0 += d[r, b] * s0 + m[r, b] * sx[t, b]
            out[r, t] = a0 + out[r, t] if add else a0
        r += 1


@njit(parallel=True, nogil=True, fastmath=FASTMATH, cache=True, boundscheck=False, error_model=ERRORS)
def block_matmul(codes, d, m, xt, sx, out, add):
    o = codes.shape[0]
    for task in prange((o + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        block_rows(codes, d, m, xt, sx, out, add, task * ROWS_PER_TASK, min(o, (task + 1) * ROWS_PER_TASK))
