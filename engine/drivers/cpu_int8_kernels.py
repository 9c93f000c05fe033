"""Integer products on block codes (engine/models/block_codes.py): the activations quantized to
16 bits per block of 32, each block's dot product computed exactly in int32 by AVX-512 VNNI's
vpdpbusd (64 byte products an instruction), then scaled in float32:

    out[r, t] = sum_b dx[t, b] * (d[r, b] * (u[r, b] . v[t, b]) + m'[r, b] * sum(v[t, b]))

u: the codes as unsigned bytes (a Q4_1 code as it is; a Q8_0 code plus 128, so m' = m - 128 d),
v: round(x * colscale / dx) in -LEVELS..LEVELS, dx = max |x * colscale| / LEVELS per block,
held as v = 256 qh + ql in two signed bytes, so u . v = 256 (u . qh) + (u . ql): two vpdpbusd.
One byte (v in -127..127, as llama.cpp's Q8 activations) moved SmolLM2's logits by up to 7% of
the largest and changed 19 of 64 greedy continuations (12 tokens each); 16 bits, 6e-4 and none.

Why not numba alone: LLVM vectorizes a long int8 reduction into VNNI but left the per-block
one (32 terms, then a float scale) scalar, at a quarter of the float kernel's speed. So the
inner loop is written here as LLVM IR (`tile`): for a tile of rows by tokens it keeps one
16-lane float accumulator per (row, token), and each step of the loop takes two blocks (64
codes) of each row: per (row, token) the two vpdpbusd, their 16 int32 lanes combined,
converted and multiplied by the two blocks' scales spread over 8 lanes each, so no horizontal
sum happens until the end of the row. A (row, token)'s sum is computed in the same order
whatever the tile or the token count, so a token's result does not depend on what else is in
the step.

Needs avx512bw and avx512vnni (`supported()`); the kernels are compiled only where it says so.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .cpu_kernels_numba import ERRORS, FASTMATH

BLOCK = 32
LEVELS = 127 * 256 + 127  # an activation's most magnitude: 256 qh + ql with qh, ql signed bytes
ROWS_PER_TASK = 32
SERIAL_QUANTIZE = 1 << 13  # activations up to this many are quantized on the calling thread
# Tiles by token count, measured on SmolLM2's shapes (2-core Zen 4): below PAIR_TOKENS one
# (row, token) at a time streams the codes fastest (4-row tiles ran at half the bandwidth);
# from WIDE_TOKENS on, 4 x 4 tiles (16 accumulators, 4 rows' codes and a token's within the 32
# vector registers) reach about 110 G multiply-adds/s, against 70 one at a time.
PAIR, WIDE = 2, 4
PAIR_TOKENS, WIDE_TOKENS = 4, 16
FEATURES = ("+avx512bw", "+avx512vnni")
PREFETCH_ROWS = 16  # codes fetched this many rows ahead of the tile

_I32, _F32 = ir.IntType(32), ir.FloatType()
_I8P = ir.IntType(8).as_pointer()
_V32B = ir.VectorType(ir.IntType(8), 32)
_V16I, _V16F, _V2F = ir.VectorType(_I32, 16), ir.VectorType(_F32, 16), ir.VectorType(_F32, 2)
_V2H = ir.VectorType(ir.IntType(16), 2)


def supported(features: str) -> bool:
    """Whether LLVM's host feature string (llvmlite's get_host_cpu_features) has what the
    kernels need."""
    have = set(features.split(","))
    return all(f in have for f in FEATURES)


def half_scales(d: np.ndarray, m: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """d and m as float16 bits (uint16), when float16 holds every one exactly (a GGUF's own
    block scales are float16): a 4-bit block is then 20 bytes instead of 24. None otherwise."""
    with np.errstate(over="ignore"):
        d16, m16 = d.astype(np.float16), m.astype(np.float16)
    if not (np.array_equal(d16.astype(np.float32), d) and np.array_equal(m16.astype(np.float32), m)):
        return None
    return np.ascontiguousarray(d16.view(np.uint16)), np.ascontiguousarray(m16.view(np.uint16))


@intrinsic
def as_float32(typingctx, x):
    """A scale as float32: itself, or float16 bits (uint16) widened (numba has no float16)."""
    if x == types.uint16:
        def codegen(context, builder, signature, args):
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), _F32)
    elif x == types.float32:
        def codegen(context, builder, signature, args):
            return args[0]
    else:
        return None
    return types.float32(x), codegen


def _make_tile(rows: int, tokens: int, nibbles: bool):
    """An intrinsic adding the code part of a rows x tokens tile to out: for each (r, t) of the
    tile, out[(r0 + r) * rs + (t0 + t) * ts] += sum over blocks of d * dx * (u . v).
    `nibbles`: the codes are 4-bit, two a byte (pack_nibbles), unpacked in registers."""

    @intrinsic
    def tile(typingctx, codes, d, qh, ql, dx, out, r0, t0, rs, ts):
        sig = types.void(codes, d, qh, ql, dx, out, types.intp, types.intp, types.intp, types.intp)

        def codegen(context, builder, signature, args):
            kinds = signature.args
            r0, t0, rs, ts = args[6:]
            arrays = [context.make_array(k)(context, builder, a) for k, a in zip(kinds[:6], args[:6], strict=True)]
            codes_s, d_s, qh_s, ql_s, dx_s, out_s = arrays
            width = builder.extract_value(qh_s.shape, 1)  # activations a token (codes a row)
            stride = builder.extract_value(codes_s.shape, 1)  # bytes a row of codes
            blocks = builder.udiv(width, ir.Constant(width.type, BLOCK))
            pairs = builder.udiv(blocks, ir.Constant(width.type, 2))

            def at(k: int, base):
                return builder.add(base, ir.Constant(base.type, k))

            def row(data, index, stride, vector):
                return builder.bitcast(builder.gep(data, [builder.mul(index, stride)]), vector.as_pointer())

            code_rows = [row(codes_s.data, at(k, r0), stride, _V32B if nibbles else _V16I) for k in range(rows)]
            half = kinds[1].dtype == types.uint16  # the scales as float16 bits (half_scales)
            d_rows = [row(d_s.data, at(k, r0), blocks, _V2H if half else _V2F) for k in range(rows)]
            qh_rows = [row(qh_s.data, at(k, t0), width, _V16I) for k in range(tokens)]
            ql_rows = [row(ql_s.data, at(k, t0), width, _V16I) for k in range(tokens)]
            dx_rows = [row(dx_s.data, at(k, t0), blocks, _V2F) for k in range(tokens)]
            module = builder.module
            dot = cgutils.get_or_insert_function(module, ir.FunctionType(_V16I, [_V16I] * 3),
                                                 "llvm.x86.avx512.vpdpbusd.512")
            fma = cgutils.get_or_insert_function(module, ir.FunctionType(_V16F, [_V16F] * 3), "llvm.fma.v16f32")
            acc = [[cgutils.alloca_once_value(builder, ir.Constant(_V16F, None)) for _ in range(tokens)]
                   for _ in range(rows)]
            spread = ir.Constant(ir.VectorType(_I32, 16), [0] * 8 + [1] * 8)  # block b's scale on lanes 0-7
            zero = ir.Constant(_V16I, None)
            eight = ir.Constant(_V16I, [8] * 16)
            prefetch = cgutils.get_or_insert_function(
                module, ir.FunctionType(ir.VoidType(), [_I8P, _I32, _I32, _I32]), "llvm.prefetch.p0")
            ahead = builder.mul(stride, ir.Constant(stride.type, PREFETCH_ROWS))  # bytes
            low_nibble = ir.Constant(_V32B, [15] * 32)
            four = ir.Constant(_V32B, [4] * 32)
            both = ir.Constant(ir.VectorType(_I32, 64), list(range(64)))

            def codes_at(c, p):
                """The pair's 64 codes as 16 int32 lanes: a byte each, or unpacked from 32 bytes
                whose low nibbles are the first block's codes and high nibbles the second's."""
                v = builder.load(builder.gep(c, [p]), align=1)
                if not nibbles:
                    return v
                first = builder.and_(v, low_nibble)
                second = builder.lshr(v, four)
                return builder.bitcast(builder.shuffle_vector(first, second, both), _V16I)

            with cgutils.for_range(builder, pairs) as loop:
                p = loop.index
                for c in code_rows:  # the rows a few tiles on, at the same place
                    at_p = builder.bitcast(builder.gep(c, [p]), _I8P)
                    builder.call(prefetch, [builder.gep(at_p, [ahead]), ir.Constant(_I32, 0), ir.Constant(_I32, 3),
                                            ir.Constant(_I32, 1)])
                u = [codes_at(c, p) for c in code_rows]
                ds = [builder.load(builder.gep(s, [p]), align=2 if half else 4) for s in d_rows]
                if half:
                    ds = [builder.fpext(builder.bitcast(s, ir.VectorType(ir.HalfType(), 2)), _V2F) for s in ds]
                ds = [builder.shuffle_vector(s, s, spread) for s in ds]
                for t in range(tokens):
                    high = builder.load(builder.gep(qh_rows[t], [p]), align=1)
                    low = builder.load(builder.gep(ql_rows[t], [p]), align=1)
                    xs = builder.load(builder.gep(dx_rows[t], [p]), align=4)
                    xs = builder.shuffle_vector(xs, xs, spread)
                    for r in range(rows):
                        exact = builder.add(builder.shl(builder.call(dot, [zero, u[r], high]), eight),
                                            builder.call(dot, [zero, u[r], low]))
                        exact = builder.sitofp(exact, _V16F)
                        scale = builder.fmul(ds[r], xs)
                        builder.store(builder.call(fma, [exact, scale, builder.load(acc[r][t])]), acc[r][t])
            total = cgutils.get_or_insert_function(module, ir.FunctionType(_F32, [_F32, _V16F]),
                                                   "llvm.vector.reduce.fadd.v16f32")
            for r in range(rows):
                for t in range(tokens):
                    index = builder.add(builder.mul(at(r, r0), rs), builder.mul(at(t, t0), ts))
                    ptr = builder.gep(out_s.data, [index])
                    builder.store(builder.call(total, [builder.load(ptr), builder.load(acc[r][t])]), ptr)
            return context.get_dummy_value()

        return sig, codegen

    return tile


tile_wide = _make_tile(WIDE, WIDE, False)
tile_pair = _make_tile(PAIR, PAIR, False)
tile_one = _make_tile(1, 1, False)
tile_wide_4 = _make_tile(WIDE, WIDE, True)
tile_pair_4 = _make_tile(PAIR, PAIR, True)
tile_one_4 = _make_tile(1, 1, True)


def pack_nibbles(u: np.ndarray) -> np.ndarray:
    """Codes of 0..15 (o, i), two a byte (o, i / 2): in each pair of blocks (64 codes), byte j
    holds code j in its low nibble and code 32 + j in its high one."""
    o, i = u.shape
    pairs = u.reshape(o, i // 64, 2, 32)
    return np.ascontiguousarray(pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(o, i // 2)


@njit(inline="always", fastmath=FASTMATH, boundscheck=False, error_model=ERRORS)
def _quantize_token(x, colscale, qh, ql, dx, c, t):
    for b in range(x.shape[0] // BLOCK):
        lo = b * BLOCK
        top = np.float32(0)
        for j in range(BLOCK):
            top = max(top, abs(x[lo + j, t] * colscale[lo + j]))
        scale = top / np.float32(LEVELS)
        inv = np.float32(LEVELS) / top if top > 0 else np.float32(0)
        total = 0
        for j in range(BLOCK):
            v = np.int32(np.rint(x[lo + j, t] * colscale[lo + j] * inv))
            high = (v + 128) >> 8
            qh[t, lo + j] = high
            ql[t, lo + j] = v - (high << 8)
            total += v
        dx[t, b] = scale
        c[t, b] = scale * np.float32(total)


@njit(parallel=True, nogil=True, fastmath=FASTMATH, cache=True, boundscheck=False, error_model=ERRORS)
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


@njit(parallel=True, nogil=True, fastmath=FASTMATH, cache=True, boundscheck=False, error_model=ERRORS)
def int8_matmul(codes, d, m, qh, ql, dx, c, out, token_major, add):
    """out = the product for every (row, token): (o, T), or (T, o) when token_major; added to
    what out holds when `add`. codes: a byte a code (o, i), or two (o, i / 2, pack_nibbles).
    Tasks of ROWS_PER_TASK rows; in each, the offset terms first, then the code terms tile by
    tile."""
    o = codes.shape[0]
    i = qh.shape[1]
    nibbles = codes.shape[1] != i
    nb = i // BLOCK
    tokens = qh.shape[0]
    rs, ts = (1, o) if token_major else (tokens, 1)
    side = WIDE if tokens >= WIDE_TOKENS else PAIR if tokens >= PAIR_TOKENS else 1
    flat = out.reshape(out.size)
    for task in prange((o + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        r0, r1 = task * ROWS_PER_TASK, min(o, (task + 1) * ROWS_PER_TASK)
        for r in range(r0, r1):
            for t in range(tokens):
                s = np.float32(0)
                for b in range(nb):
                    s += as_float32(m[r, b]) * c[t, b]
                k = r * rs + t * ts
                flat[k] = flat[k] + s if add else s
        r = r0
        while r + side <= r1:  # side x side tiles; then the tokens left, one at a time
            t = 0
            while t + side <= tokens and side > 1:
                _tile(codes, d, qh, ql, dx, flat, r, t, rs, ts, side, nibbles)
                t += side
            for rr in range(r, r + side):
                for tt in range(t, tokens):
                    _tile(codes, d, qh, ql, dx, flat, rr, tt, rs, ts, 1, nibbles)
            r += side
        for rr in range(r, r1):  # the rows left
            for t in range(tokens):
                _tile(codes, d, qh, ql, dx, flat, rr, t, rs, ts, 1, nibbles)


@njit(inline="always", fastmath=FASTMATH, boundscheck=False, error_model=ERRORS)
def _tile(codes, d, qh, ql, dx, flat, r, t, rs, ts, side, nibbles):
    if nibbles:
        if side == WIDE:
            tile_wide_4(codes, d, qh, ql, dx, flat, r, t, rs, ts)
        elif side == PAIR:
            tile_pair_4(codes, d, qh, ql, dx, flat, r, t, rs, ts)
        else:
            tile_one_4(codes, d, qh, ql, dx, flat, r, t, rs, ts)
    elif side == WIDE:
        tile_wide(codes, d, qh, ql, dx, flat, r, t, rs, ts)
    elif side == PAIR:
        tile_pair(codes, d, qh, ql, dx, flat, r, t, rs, ts)
    else:
        tile_one(codes, d, qh, ql, dx, flat, r, t, rs, ts)


@njit(nogil=True, fastmath=FASTMATH, cache=True, boundscheck=False, error_model=ERRORS)
def quantize_serial(x, colscale, qh, ql, dx, c):
    """quantize() on the calling thread: for a few tokens, waking the pool costs more."""
    for t in range(x.shape[1]):
        _quantize_token(x, colscale, qh, ql, dx, c, t)


@njit(nogil=True, fastmath=FASTMATH, cache=True, boundscheck=False, error_model=ERRORS)
def int8_product(codes, d, m, x, colscale, out, token_major, add):
    """quantize() then int8_matmul() in one call (a step makes some 150 products; each call
    from Python costs microseconds)."""
    i, tokens = x.shape
    qh = np.empty((tokens, i), np.int8)
    ql = np.empty((tokens, i), np.int8)
    dx = np.empty((tokens, i // BLOCK), np.float32)
    c = np.empty((tokens, i // BLOCK), np.float32)
    if tokens * i <= SERIAL_QUANTIZE:
        quantize_serial(x, colscale, qh, ql, dx, c)
    else:
        quantize(x, colscale, qh, ql, dx, c)
    int8_matmul(codes, d, m, qh, ql, dx, c, out, token_major, add)


KERNELS = (quantize, dequantize, int8_matmul, quantize_serial, int8_product)
