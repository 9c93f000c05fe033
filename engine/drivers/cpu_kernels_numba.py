"""The CPU driver's numba kernels themselves; `cpu_kernels` says what each is for, decides
when each runs and on how many threads, and builds them (`cpu_kernels.compile()`).

They live at module level, apart from that policy: numba caches a kernel on disk only when
everything it calls is a module-level global (kernels that called helpers or the exp below
as closure variables were rebuilt in every process, 12 s per start). Importing this module
compiles nothing; `cpu_kernels` imports it only after choosing numba's target CPU and
threading layer.

Every kernel releases the GIL (nogil): the server's event loop, which streams tokens and
answers /health, runs in the same process and would otherwise stop for each kernel's run.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

ROWS_PER_TASK = 32  # weight rows per parallel task: enough work to hide the task's start-up
# No nnan/ninf: the running maximum of the softmax starts at -inf.
FASTMATH = {"nsz", "arcp", "contract", "afn", "reassoc"}
# NumPy's error model: a float division by zero gives inf instead of raising. Python's model
# puts a zero check before every division, which keeps the loop around it scalar (SiLU's
# divide ran 6x slower).
ERRORS = "numpy"


@intrinsic
def float_from_bits(typingctx, bits):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


@intrinsic
def kv_element(typingctx, value, cache):
    """`value` as `cache` holds it: rounded to float16's bits (round to nearest even) for a
    uint16 cache, which numba reads as float16 bits since it has no float16 of its own;
    unchanged for a float32 one."""
    half = cache.dtype == types.uint16

    def codegen(context, builder, signature, args):
        if half:
            return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
        return args[0]

    return (types.uint16 if half else types.float32)(types.float32, cache), codegen


@njit(inline="always", fastmath=FASTMATH, error_model=ERRORS)
def exp(x):
    """float32 e^x, relative error under 1e-6; inputs outside [-87, 88] saturate there
    (so e^-inf is about 1e-38, not 0: callers that need an exact 0 mask explicitly)."""
    x = x if x > np.float32(-87.0) else np.float32(-87.0)  # selects vectorize; min/max do not
    x = x if x < np.float32(88.0) else np.float32(88.0)
    n = np.float32(np.floor(x * np.float32(1.44269504) + np.float32(0.5)))
    r = x - n * np.float32(0.693359375) + n * np.float32(2.12194440e-4)  # x - n ln2, in two parts
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1)
    return p * float_from_bits((np.int32(n) + np.int32(127)) << np.int32(23))  # times 2^n


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


# The glue kernels give each thread runs of tokens (cpu_kernels.run_length) and keep their inner loops
# along contiguous tokens. They index from a run's start with unsigned integers: with a
# signed index numba adds a negative-index fix-up that stops LLVM from vectorizing
# (measured: 3-4x slower), and a serial helper keeps the loops out of the parallel
# region's body, where they did not vectorize either. The helpers are also the serial
# entry points: a small step calls them on the calling thread, without changing the
# thread team's size (flipping it between products cost a one-row step about 2 ms).


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
