"""Compiled CPU kernels (numba) for the places where NumPy and OpenBLAS leave the most time
on the table in a decode step:

- few_token_matmul: W @ X for 1 to 12 tokens. OpenBLAS runs 2- to 12-token products at a
  third to a half of memory speed (on SmolLM2 the products of a 2-token step took 1.9x
  those of a 1-token step); this kernel reads each weight row once and dots it with every
  token while it sits in L1 (1.25x).
  Speculative verification and small batches live in this range. One-token products use it
  too, so that a few-token step runs on one thread pool: numba's and OpenBLAS's threads
  each spin for a while after their work, and alternating between them on two cores made a
  one-row step several times slower.
- paged_attention: each query attends its own row's keys in place, block by block through
  the row's block table, with an online softmax: no gathered copy of the context (the copy
  was most of a many-row step's attention), no per-row Python loop, one pass over the KV.
- rms_scale, rope_store, silu_mul: the glue between a few-token step's products (norm,
  rotary with the KV write, SiLU times up), one call each instead of several NumPy passes.

All are compiled once, when the driver prepares (`compile()`; the driver counts each
build), for the only types a step uses (float32 values, int64 indices), and cached on disk
by numba. Without numba (or without a thread-safe threading layer) `available()` is False
and the driver keeps its NumPy path: same results, slower.
"""

from __future__ import annotations

import math
import time

import numpy as np

from . import mkl_products

FEW_TOKENS = range(1, 13)  # token counts few_token_matmul takes over from BLAS (measured crossover)
_ROWS_PER_TASK = 32  # weight rows per parallel task: enough work to hide the task's start-up
# Multiply-adds below which a kernel runs on the calling thread alone: waking numba's
# workers costs more than it saves, and a woken worker spins on a core for a while after
# (a tiny model's steps would keep a second core busy for nothing).
PARALLEL_MIN_WORK = 1 << 17
# OpenBLAS's worker threads spin for about this long after a product (2^28 cycles, its
# default THREAD_TIMEOUT). A numba team started meanwhile shares a core with the spinner
# and waits for it at every barrier: measured on SmolLM2, the one-token step right after a
# prefill chunk took 2.7x its usual time that way, 1.7x on the calling thread alone.
BLAS_SPIN_S = 0.1

# No nnan/ninf: the running maximum of the softmax starts at -inf.
_FASTMATH = {"nsz", "arcp", "contract", "afn", "reassoc"}

_kernels = None
_error: str | None = None
_numba = None  # the numba module, once the kernels are built
_last_blas = 0.0  # time.monotonic() of the last product left to OpenBLAS


def _build():
    global _numba
    import numba
    from numba import njit, prange

    _numba = numba
    _prefer_wide_vectors(numba)
    # The engine thread and test threads may launch kernels concurrently: the default
    # workqueue layer aborts on that, so ask for a thread-safe one, OpenMP first: MKL's
    # products run on GNU OpenMP too (mkl_products), and one pool never waits for the other.
    numba.config.THREADING_LAYER = "threadsafe"
    numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]

    @njit(parallel=True, fastmath=_FASTMATH, cache=True, boundscheck=False)
    def few_token_matmul(w, xt, out):
        """out (o, T) = w (o, i) @ xt.T, xt (T, i) contiguous. Register blocks of four weight
        rows by two tokens: each load of w serves two tokens, each load of xt four rows."""
        o, i = w.shape
        tokens = xt.shape[0]
        for task in prange((o + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK):
            r, end = task * _ROWS_PER_TASK, min(o, (task + 1) * _ROWS_PER_TASK)
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

    @njit(parallel=True, fastmath=_FASTMATH, cache=True, boundscheck=False)
    def paged_attention(q, cache, tables, table_of, lengths, out):
        """q (Q, heads, hd) pre-scaled; cache (2, kv_heads, blocks, block_size, hd); query n
        attends keys 0 .. lengths[n] - 1 of the blocks tables[table_of[n]]; out (Q, heads * hd)."""
        queries, heads, hd = q.shape
        kv_heads, block_size = cache.shape[1], cache.shape[3]
        group = heads // kv_heads
        for task in prange(queries * kv_heads):
            n, h = task // kv_heads, task % kv_heads
            length = lengths[n]
            table = tables[table_of[n]]
            qg = q[n, h * group : (h + 1) * group]
            top = np.full(group, -np.inf, dtype=np.float32)  # running max of the scores
            den = np.zeros(group, dtype=np.float32)
            acc = np.zeros((group, hd), dtype=np.float32)
            p = np.empty((group, block_size), dtype=np.float32)
            for j in range((length + block_size - 1) // block_size):
                keys, values = cache[0, h, table[j]], cache[1, h, table[j]]
                used = min(block_size, length - j * block_size)
                for t in range(used):  # each key is loaded once for the whole group
                    for g in range(group):
                        s = np.float32(0)
                        for e in range(hd):
                            s += qg[g, e] * keys[t, e]
                        p[g, t] = s
                for g in range(group):
                    m = top[g]
                    for t in range(used):
                        m = max(m, p[g, t])
                    rescale = np.float32(math.exp(top[g] - m))
                    top[g] = m
                    total = den[g] * rescale
                    for e in range(hd):
                        acc[g, e] *= rescale
                    for t in range(used):
                        p[g, t] = np.float32(math.exp(p[g, t] - m))
                        total += p[g, t]
                    den[g] = total
                for t in range(used):
                    for g in range(group):
                        pt = p[g, t]
                        for e in range(hd):
                            acc[g, e] += pt * values[t, e]
            for g in range(group):
                inv = np.float32(1) / den[g]
                base = (h * group + g) * hd
                for e in range(hd):
                    out[n, base + e] = acc[g, e] * inv

    @njit(fastmath=_FASTMATH, cache=True, boundscheck=False)
    def rms_scale(x, eps, out):
        """out = x / rms(x) per token of a feature-major x (features, T)."""
        features, tokens = x.shape
        for t in range(tokens):
            acc = np.float32(0)
            for f in range(features):
                acc += x[f, t] * x[f, t]
            inv = np.float32(1) / np.float32(math.sqrt(acc / features + eps))
            for f in range(features):
                out[f, t] = x[f, t] * inv

    @njit(fastmath=_FASTMATH, cache=True, boundscheck=False)
    def silu_mul(gate_up, out):
        """out = silu(gate) * up, gate_up (2 inter, T) feature-major."""
        inter, tokens = out.shape
        for f in range(inter):
            for t in range(tokens):
                g = gate_up[f, t]
                out[f, t] = g / (np.float32(1) + np.float32(math.exp(-g))) * gate_up[inter + f, t]

    @njit(fastmath=_FASTMATH, cache=True, boundscheck=False)
    def rope_store(qkv, rope, block, offset, cache, q_out):
        """Rotates each token's Q and K heads (adjacent pairs are one complex number; rope
        (T, hd) holds cos, sin interleaved for each token's position), writes K and V into
        the paged cache at (block, offset), and Q token-major into q_out (T, heads, hd)."""
        tokens, heads, hd = q_out.shape
        kv_heads = cache.shape[1]
        for t in range(tokens):
            b, o = block[t], offset[t]
            for h in range(heads + kv_heads):
                base = h * hd
                for j in range(0, hd, 2):
                    c, s = rope[t, j], rope[t, j + 1]
                    re, im = qkv[base + j, t], qkv[base + j + 1, t]
                    r0, r1 = re * c - im * s, re * s + im * c
                    if h < heads:
                        q_out[t, h, j], q_out[t, h, j + 1] = r0, r1
                    else:
                        cache[0, h - heads, b, o, j], cache[0, h - heads, b, o, j + 1] = r0, r1
            vbase = (heads + kv_heads) * hd
            for h in range(kv_heads):
                for e in range(hd):
                    cache[1, h, b, o, e] = qkv[vbase + h * hd + e, t]

    return few_token_matmul, paged_attention, rms_scale, silu_mul, rope_store


def _prefer_wide_vectors(numba) -> None:
    """Lets LLVM use the host's widest vectors. For AVX-512 hosts it prefers 256-bit ones by
    default (older chips slowed their clock for 512-bit work); here the few-token products
    ran 1.3-1.7x faster with 512-bit vectors and single-threaded paged attention 1.4x.
    Applies only if nothing in the process compiled with numba before (the target is set
    up once); numba's on-disk cache keys its entries by these features."""
    if numba.config.CPU_NAME is None and numba.config.CPU_FEATURES is None:
        import llvmlite.binding as llvm

        features = llvm.get_host_cpu_features().flatten()
        if "+avx512f" in features.split(","):
            numba.config.CPU_NAME = llvm.get_host_cpu_name()
            numba.config.CPU_FEATURES = features + ",-prefer-256-bit"


def compile() -> int:
    """Builds (or loads from numba's cache) every kernel, once per process, and runs each on
    a tiny input of the step's types; returns how many kernels there are. Raises
    RuntimeError when they cannot be built here."""
    global _kernels, _error
    if _kernels is None and _error is None:
        try:
            kernels = _build()
            _smoke(*kernels)
            _kernels = kernels
        except Exception as exc:  # no numba, no thread-safe layer, a compiler failure
            _error = f"{type(exc).__name__}: {exc}".splitlines()[0]
    if _kernels is None:
        raise RuntimeError(f"the CPU kernels are unavailable ({_error})")
    return len(_kernels)


def _smoke(few_token_matmul, paged_attention, rms_scale, silu_mul, rope_store) -> None:
    w = np.ones((3, 2), np.float32)
    out = np.empty((3, 2), np.float32)
    few_token_matmul(w, np.ones((2, 2), np.float32), out)
    cache = np.ones((2, 1, 1, 2, 2), np.float32)
    att = np.empty((1, 2), np.float32)
    paged_attention(np.ones((1, 1, 2), np.float32), cache, np.zeros((1, 1), np.int64), np.zeros(1, np.int64),
                    np.ones(1, np.int64), att)
    norm = np.empty((2, 1), np.float32)
    rms_scale(np.full((2, 1), 2, np.float32), np.float32(0), norm)
    act = np.empty((1, 1), np.float32)
    silu_mul(np.zeros((2, 1), np.float32), act)
    q = np.empty((1, 1, 2), np.float32)
    rope_store(np.ones((6, 1), np.float32), np.array([[0, 1]], np.float32), np.zeros(1, np.int64),
               np.zeros(1, np.int64), cache, q)
    if not (np.all(out == 2) and np.allclose(att, 1) and np.allclose(norm, 1) and act[0, 0] == 0
            and np.allclose(q, [[[-1, 1]]])):
        raise RuntimeError("the compiled kernels gave wrong results on a known input")


def specializations() -> int:
    """Machine-code versions built so far, over every kernel: numba builds one per argument
    type signature, so a step passing an unexpected type (a read-only or strided array)
    would compile again. The driver reports any growth as a compile."""
    return sum(len(k.signatures) for k in _kernels) if _kernels is not None else 0


def available() -> bool:
    try:
        compile()
    except RuntimeError:
        return False
    return True


def unavailable_reason() -> str:
    return "" if available() else f"CPU kernels unavailable: {_error}"


def matmul(w: np.ndarray, x: np.ndarray, packed=None) -> np.ndarray:
    """w (o, i) @ x (i, T), feature-major like every product of the forward. `packed`: w in
    MKL's packed layout (mkl_products.PackedWeight), used for more than FEW_TOKENS tokens."""
    global _last_blas
    tokens = x.shape[1]
    large = w.size * tokens >= PARALLEL_MIN_WORK
    if tokens not in FEW_TOKENS or _kernels is None:
        if packed is not None:
            return mkl_products.matmul(packed, x)
        if large:  # OpenBLAS runs it on its threads, which then spin for a while
            _last_blas = time.monotonic()
        return w @ x
    out = np.empty((w.shape[0], tokens), dtype=np.float32)
    _set_threads(large)
    _kernels[0](w, np.ascontiguousarray(x.T), out)
    return out


def rms_scale(x: np.ndarray, eps: float) -> np.ndarray:
    """x / rms(x) per token of a feature-major (features, T) float32 array."""
    out = np.empty_like(x)
    _kernels[2](x, np.float32(eps), out)
    return out


def silu_mul(gate_up: np.ndarray) -> np.ndarray:
    """silu(gate) * up for a feature-major (2 inter, T) array of gate rows then up rows."""
    out = np.empty((gate_up.shape[0] // 2, gate_up.shape[1]), np.float32)
    _kernels[3](gate_up, out)
    return out


def rope_store(qkv, rope, block, offset, cache, heads: int) -> np.ndarray:
    """Rotary on Q and K, K and V written to the paged cache; returns Q (T, heads, hd)."""
    q = np.empty((qkv.shape[1], heads, cache.shape[4]), np.float32)
    _kernels[4](qkv, rope, block, offset, cache, q)
    return q


def paged_attention(q, cache, tables, table_of, lengths, out, tokens: int = 1, shared_pool: bool = False) -> None:
    """See _build(); every array must already have the step's types (float32, int64).
    `tokens`: the step's fed tokens. A few-token step runs entirely on numba's threads; so
    does a larger one whose products run on the same pool (`shared_pool`: MKL on OpenMP);
    otherwise the second core is left to OpenBLAS, whose threads spin between products."""
    work = int(lengths.sum()) * q.shape[1] * q.shape[2]
    _set_threads((shared_pool or tokens in FEW_TOKENS) and work >= PARALLEL_MIN_WORK)
    _kernels[1](q, cache, tables, table_of, lengths, out)


def _set_threads(parallel: bool) -> None:
    if parallel and time.monotonic() - _last_blas < BLAS_SPIN_S:
        parallel = False
    _numba.set_num_threads(_numba.config.NUMBA_NUM_THREADS if parallel else 1)


class Kernels:
    """The kernels as one prepared model uses them: the module's functions, with the model's
    large weights packed once for MKL (when it is available) so that every product of more
    than FEW_TOKENS tokens runs there, and every product and kernel of a step on one OpenMP
    pool. Without MKL, those products stay on NumPy's BLAS."""

    FEW_TOKENS = FEW_TOKENS
    rms_scale = staticmethod(rms_scale)
    silu_mul = staticmethod(silu_mul)
    rope_store = staticmethod(rope_store)
    specializations = staticmethod(specializations)

    def __init__(self, weights, use_mkl: bool = True):
        compile()
        self._packed: dict[int, tuple[np.ndarray, mkl_products.PackedWeight]] = {}
        if use_mkl and mkl_products.available():
            for w in weights:
                if w.ndim == 2 and w.size >= mkl_products.MIN_PACKED_WEIGHTS:
                    # Keyed by identity; holding w keeps its id from being reused.
                    self._packed[id(w)] = (w, mkl_products.PackedWeight(w))

    @property
    def packed(self) -> int:
        """How many weight matrices run on MKL's packed products."""
        return len(self._packed)

    def matmul(self, w: np.ndarray, x: np.ndarray) -> np.ndarray:
        entry = self._packed.get(id(w))
        return matmul(w, x, entry[1] if entry is not None and entry[0] is w else None)

    def paged_attention(self, q, cache, tables, table_of, lengths, out, tokens: int = 1) -> None:
        paged_attention(q, cache, tables, table_of, lengths, out, tokens, shared_pool=bool(self._packed))

    def batched_matmul(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """a @ b over stacks (attention tiles): on MKL when the products are, so that no
        OpenBLAS thread spins beside the step's OpenMP pool."""
        return mkl_products.batched_matmul(a, b) if self._packed else np.matmul(a, b)
