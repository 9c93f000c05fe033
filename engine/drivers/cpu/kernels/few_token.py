"""W @ X for a few tokens in float32 (the float32 weights' products of 1 to 12 tokens,
products/few_tokens.py): each weight row read once and dotted with every token while it
sits in L1."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .numeric import ERRORS, FASTMATH, ROWS_PER_TASK


@njit(parallel=True, nogil=True, fastmath=FASTMATH, cache=True, boundscheck=False, error_model=ERRORS)
def few_token_matmul(w, xt, out):
    """out (o, T) = w (o, i) @ xt.T, xt (T, i) contiguous. Register blocks of four weight
    rows by two tokens: each load of w serves two tokens, each load of xt four rows."""
    o, i = w.shape
    tokens = xt.shape[0]
    for task in prange((o + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        r, end = task * ROWS_PER_TASK, min(o, (task + 1) * ROWS_PER_TASK)
        while r + 4 <= end:
            w0, w1, w2, w3 = w[r], w[r + 1], w[r + 2], w[r + 3]
            t = 0
            while t + 2 <= tokens:
                x0, x1 = xt[t], xt[t + 1]
                a00 = a01 = a10 = a11 = a20 = a21 = a30 = a31 = np.float32(0)
                for e in range(i):
                    u0, u1 = x0[e], x1[e]
                    a00 += w0[e] * u0
                    a01 += w0[e] * u1
                    a10 += w1[e] * u0
                    a11 += w1[e] * u1
                    a20 += w2[e] * u0
                    a21 += w2[e] * u1
                    a30 += w3[e] * u0
                    a31 += w3[e] * u1
                out[r, t], out[r + 1, t], out[r + 2, t], out[r + 3, t] = a00, a10, a20, a30
                out[r, t + 1], out[r + 1, t + 1], out[r + 2, t + 1], out[r + 3, t + 1] = a01, a11, a21, a31
                t += 2
            if t < tokens:  # an odd token count: the last token alone
                x0 = xt[t]
                a00 = a10 = a20 = a30 = np.float32(0)
                for e in range(i):
                    u0 = x0[e]
                    a00 += w0[e] * u0
                    a10 += w1[e] * u0
                    a20 += w2[e] * u0
                    a30 += w3[e] * u0
                out[r, t], out[r + 1, t], out[r + 2, t], out[r + 3, t] = a00, a10, a20, a30
            r += 4
        while r < end:  # rows left over when o is not a multiple of four
            for t in range(tokens):
                a = np.float32(0)
                for e in range(i):
                    a += w[r, e] * xt[t, e]
                out[r, t] = a
            r += 1
