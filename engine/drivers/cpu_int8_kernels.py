"""Integer products on block codes (engine/models/block_codes.py): the activations quantized to
16 bits per block of 32, each block's dot product computed exactly in int32 by AVX-512 VNNI's
vpdpwssd (32 products of two 16-bit words an instruction), then scaled in float32:

    out[r, t] = sum_b dx[t, b] * (d[r, b] * (u[r, b] . v[t, b]) + m'[r, b] * sum(v[t, b]))

u: the codes as unsigned bytes (a Q4_1 code as it is; a Q8_0 code plus 128, so m' = m - 128 d),
widened to words in registers; v: round(x * colscale / dx) in -LEVELS..LEVELS, dx = max |x *
colscale| / LEVELS per block, one int16 each. One byte (v in -127..127, as llama.cpp's Q8
activations) moved SmolLM2's logits by up to 7% of the largest and changed 19 of 64 greedy
continuations (12 tokens each); 16 bits, 6e-4 and none.

Why not numba alone: LLVM vectorizes a long int8 reduction into VNNI but left the per-block
one (32 terms, then a float scale) scalar, at a quarter of the float kernel's speed. So the
inner loop is written here as LLVM IR (`tile`): for a tile of rows by tokens it keeps one
16-lane float accumulator per (row, token). The codes and the activations are stored in the
kernel's own order (`kernel_order`): for 4-bit codes, a run of GROUP blocks (512 codes) puts
block x's words on lane x, so the run's eight chunks of 64 codes sum exactly into one int32
vector, converted and scaled once (by the 16 blocks' scales, one a lane) where blocks taken in
pairs needed that for every 64 codes: 1.3-1.6x the speed on 2-16 tokens. No horizontal sum
happens until the end of the row. A (row, token)'s sum is computed in the same order whatever
the tile or the token count, so a token's result does not depend on what else is in the step.

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
GROUP = 16  # 4-bit blocks whose exact sums share one int32 vector (one conversion, one scale)
LEVELS = 127 * 256 + 127  # an activation's most magnitude: 256 qh + ql with qh, ql signed bytes
ROWS_PER_TASK = 32
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
# Tiles by token count, measured on SmolLM2's shapes (2-core Zen 4, products of 1-24 tokens
# interleaved in one run): a lone token's rows two at a time (below), 2 x 2 tiles for two or
# three, 4 x 4 (16 sums, 4 rows' codes and a token's within the 32 vector registers) from four,
# the tokens left over in pairs. 4 x 4 tiles reach 90-100 G multiply-adds/s on the two cores.
# A lone token takes 4-bit rows two at a time (COLUMN; byte codes one): one row's sum is a chain of dependent
# steps (dot products, scale, horizontal sum) that left the core idle between rows; two in
# flight ran a one-token product 2.3x faster with the codes in cache (576 x 576 on one thread:
# 10.9 against 25.2 us), a step's 120 layer products out of cache 1.03-1.1x faster (separate
# processes, alternated). Four rows: no faster. Byte codes (a Q8_0 head) stay one row a tile:
# two were slower there (1.10 against 0.75 ms for SmolLM2's head).
PAIR, WIDE = 2, 4
COLUMN = 2
PAIR_TOKENS, WIDE_TOKENS = 2, 4
FEATURES = ("+avx512bw", "+avx512vnni")
CHAINS = 4  # a dot product's latency over its throughput: a lone (row, token) splits its sum
# Codes are asked for this many rows ahead of the tile, into L2 (llvm.prefetch locality 2): 16
# rows into L1 ran a step's one-token products in 3.55-3.75 ms, 32 into L2 in 3.18-3.31 (48 and
# 64: no better); 48 or 128 rows into L1 were 1.5x slower (L1 holds 32 KiB, fewer lines than that).
PREFETCH_ROWS = 32
L1_WAYS = 8  # lines a level-1 data cache set holds (8 or more on x86-64 CPUs since 2008)

_I32, _F32 = ir.IntType(32), ir.FloatType()
_I8P = ir.IntType(8).as_pointer()
_V32B = ir.VectorType(ir.IntType(8), 32)
_V16I, _V16F = ir.VectorType(_I32, 16), ir.VectorType(_F32, 16)
_V32W = ir.VectorType(ir.IntType(16), 32)


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


def lane_width(blocks: int) -> int:
    """Scales a row (or token) holds in lane layout: 16 a run (see kernel_order)."""
    return 16 * (blocks // GROUP + blocks % GROUP // 2)


def lane_scales(s: np.ndarray, lone: bool = False) -> np.ndarray:
    """Per-block scales (rows, blocks) in lane layout: each run's 16 lanes as the kernel's
    accumulators hold its blocks, a block's scale on each of its lanes (`lone`: on its first
    lane only, the others 0). A run of 2 blocks is a run of 16 lanes all the same: laid out
    once here, its scales load as one vector, where spreading them in registers made SmolLM2's
    576-wide products 2-5% slower at 32 tokens (interleaved in one process, either first)."""
    rows, blocks = s.shape
    out = np.zeros((rows, lane_width(blocks)), s.dtype)
    first = 0
    for run in range(out.shape[1] // 16):
        size = GROUP if run < blocks // GROUP else 2
        lanes = 16 // size
        spread = out[:, 16 * run : 16 * run + 16].reshape(rows, size, lanes)
        if lone:
            spread[:, :, 0] = s[:, first : first + size]
        else:
            spread[...] = s[:, first : first + size, None]
        first += size
    return out


def _make_tile(rows: int, tokens: int, nibbles: bool, lane_weights: bool):
    """An intrinsic adding a rows x tokens tile's products to out: for each (r, t) of the tile,
    out[(r0 + r - first) * rs + (t0 + t) * ts] += sum over blocks of d dx (u . v) + m' c, codes and
    activations in kernel order (see `kernel_order`), dx and c in lane layout (lane_scales).
    `first`: the product's row that out's row 0 holds (0, or a task's first row when it
    writes a scratch of its own). `nibbles`: the codes are 4-bit, two a byte (pack_nibbles),
    unpacked in registers. `lane_weights`: d and m in lane layout too (several tokens' tiles,
    where each run's scales serve many products); else as the file has them, a block a
    scale (a lone token's tiles, which bandwidth bounds: fewer bytes). The same values in the
    same lanes either way, so a sum's result does not depend on which tile took it."""
    group = GROUP
    chains = max(1, CHAINS // (rows * tokens))  # independent sums a tile keeps in flight
    # Codes asked for PREFETCH_ROWS ahead: a step's one-token products (2 x 1 tiles) ran in
    # 2.7-3.1 ms with, 3.2-3.3 without; 1.0-1.3x faster at 2-8 tokens. A 1 x 1 tile (a lone
    # token's last row) is left to the hardware's prefetchers, which follow one ordered stream.
    prefetching = rows * tokens > 1

    @intrinsic
    def tile(typingctx, codes, d, m, v, dx, c, out, r0, t0, rs, ts, first):
        sig = types.void(codes, d, m, v, dx, c, out, types.intp, types.intp, types.intp, types.intp, types.intp)

        def codegen(context, builder, signature, args):
            kinds = signature.args
            r0, t0, rs, ts, first = args[7:]
            codes_s, d_s, m_s, v_s, dx_s, c_s, out_s = (context.make_array(k)(context, builder, a)
                                                        for k, a in zip(kinds[:7], args[:7], strict=True))
            width = builder.extract_value(v_s.shape, 1)  # activations a token (codes a row)
            stride = builder.extract_value(codes_s.shape, 1)  # bytes a row of codes
            blocks = builder.udiv(width, ir.Constant(width.type, BLOCK))
            groups = builder.udiv(blocks, ir.Constant(width.type, group))
            pairs = builder.udiv(builder.sub(blocks, builder.mul(groups, ir.Constant(width.type, group))),
                                 ir.Constant(width.type, 2))

            def at(k: int, base):
                return builder.add(base, ir.Constant(base.type, k))

            def row(data, index, stride, kind):
                return builder.gep(builder.bitcast(data, kind.as_pointer()), [builder.mul(index, stride)])

            code_rows = [row(codes_s.data, at(k, r0), stride, ir.IntType(8)) for k in range(rows)]
            half = kinds[1].dtype == types.uint16  # the scales as float16 bits (half_scales)
            scale_kind = ir.HalfType() if half else _F32
            d_stride = builder.extract_value(d_s.shape, 1)  # blocks, or lane_width(blocks)
            d_rows = [row(d_s.data, at(k, r0), d_stride, scale_kind) for k in range(rows)]
            m_rows = [row(m_s.data, at(k, r0), d_stride, scale_kind) for k in range(rows)]
            v_rows = [row(v_s.data, at(k, t0), width, ir.IntType(16)) for k in range(tokens)]
            lanes_a_token = builder.extract_value(dx_s.shape, 1)
            dx_rows = [row(dx_s.data, at(k, t0), lanes_a_token, _F32) for k in range(tokens)]
            c_rows = [row(c_s.data, at(k, t0), lanes_a_token, _F32) for k in range(tokens)]
            module = builder.module
            dot = cgutils.get_or_insert_function(module, ir.FunctionType(_V16I, [_V16I] * 3),
                                                 "llvm.x86.avx512.vpdpwssd.512")
            fma = cgutils.get_or_insert_function(module, ir.FunctionType(_V16F, [_V16F] * 3), "llvm.fma.v16f32")
            acc = [[cgutils.alloca_once_value(builder, ir.Constant(_V16F, None)) for _ in range(tokens)]
                   for _ in range(rows)]
            zero = ir.Constant(_V16I, None)
            prefetch = cgutils.get_or_insert_function(
                module, ir.FunctionType(ir.VoidType(), [_I8P, _I32, _I32, _I32]), "llvm.prefetch.p0")
            ahead = builder.mul(stride, ir.Constant(stride.type, PREFETCH_ROWS))  # bytes
            chunk_bytes = ir.Constant(width.type, 32 if nibbles else 64)  # a chunk: 64 codes

            def words(b):
                """32 codes as 16 int32 lanes of two 16-bit words (vpdpwssd's operand)."""
                return builder.bitcast(builder.zext(b, _V32W), _V16I)

            def codes_at(c, chunk):
                """A chunk's 64 codes as two word vectors: codes 0-31 and 32-63 (a byte each, or
                the low and high nibbles of 32 bytes)."""
                at_c = builder.gep(c, [builder.mul(chunk, chunk_bytes)])
                if nibbles:
                    # Widened as it loads (one shuffle, where widening each nibble took two): 5% faster.
                    w = builder.zext(builder.load(builder.bitcast(at_c, _V32B.as_pointer()), align=1), _V32W)
                    low = builder.and_(w, ir.Constant(_V32W, [15] * 32))
                    return builder.bitcast(low, _V16I), builder.bitcast(builder.lshr(w, ir.Constant(_V32W, [4] * 32)), _V16I)
                first = builder.load(builder.bitcast(at_c, _V32B.as_pointer()), align=1)
                second = builder.load(builder.bitcast(builder.gep(at_c, [ir.Constant(chunk.type, 32)]),
                                                      _V32B.as_pointer()), align=1)
                return words(first), words(second)

            def activations_at(vr, chunk):
                base = builder.gep(vr, [builder.mul(chunk, ir.Constant(chunk.type, 64))])
                return [builder.load(builder.bitcast(builder.gep(base, [ir.Constant(chunk.type, k)]),
                                                     _V16I.as_pointer()), align=2) for k in (0, 32)]

            def scales_at(data, first, count, kind, lone=False):
                """count scales from block `first`, each spread over 16 / count lanes (`lone`:
                on the first of them only, the others 0)."""
                vector = ir.VectorType(kind, count)
                s = builder.load(builder.bitcast(builder.gep(data, [first]), vector.as_pointer()),
                                 align=2 if kind is not _F32 else 4)
                if kind is not _F32:
                    s = builder.fpext(s, ir.VectorType(_F32, count))
                if count == 16:
                    return s
                lanes = 16 // count
                picks = [lane // lanes if not lone or lane % lanes == 0 else count for lane in range(16)]
                return builder.shuffle_vector(s, ir.Constant(s.type, None), ir.Constant(ir.VectorType(_I32, 16), picks))

            def span(count, first_block, first_chunk, first_run, size):
                """`count` runs of `size` blocks from block first_block (chunk first_chunk, run
                first_run): each run's products summed exactly in int32, then scaled once."""
                with cgutils.for_range(builder, count) as loop:
                    k = loop.index
                    chunk0 = builder.add(first_chunk, builder.mul(k, ir.Constant(k.type, size // 2)))
                    block0 = builder.add(first_block, builder.mul(k, ir.Constant(k.type, size)))
                    lane0 = builder.mul(builder.add(first_run, k), ir.Constant(k.type, 16))
                    sums = [[[zero] * chains for _ in range(tokens)] for _ in range(rows)]
                    for j in range(size // 2):
                        chunk = at(j, chunk0)
                        for c in code_rows if prefetching else ():  # the rows a few tiles on, at the same place
                            where = builder.gep(c, [builder.add(builder.mul(chunk, chunk_bytes), ahead)])
                            builder.call(prefetch, [where, ir.Constant(_I32, 0), ir.Constant(_I32, 2),
                                                    ir.Constant(_I32, 1)])
                        u = [codes_at(c, chunk) for c in code_rows]
                        for t in range(tokens):
                            a = activations_at(v_rows[t], chunk)
                            for r in range(rows):
                                for half_ in range(2):
                                    chain = (2 * j + half_) % chains
                                    sums[r][t][chain] = builder.call(dot, [sums[r][t][chain], u[r][half_], a[half_]])
                    # The offsets' term m' * c, a block a lane (one lane of a block spread over several).
                    if lane_weights:
                        ds = [scales_at(s, lane0, 16, scale_kind) for s in d_rows]
                        ms = [scales_at(s, lane0, 16, scale_kind) for s in m_rows]
                    else:
                        ds = [scales_at(s, block0, size, scale_kind) for s in d_rows]
                        ms = [scales_at(s, block0, size, scale_kind, lone=True) for s in m_rows]
                    xs = [scales_at(s, lane0, 16, _F32) for s in dx_rows]
                    cs = [scales_at(s, lane0, 16, _F32) for s in c_rows]
                    for r in range(rows):
                        for t in range(tokens):
                            scale = builder.fmul(ds[r], xs[t])
                            exact = sums[r][t][0]
                            for chain in range(1, chains):
                                exact = builder.add(exact, sums[r][t][chain])
                            total = builder.call(fma, [builder.sitofp(exact, _V16F), scale,
                                                       builder.load(acc[r][t])])
                            builder.store(builder.call(fma, [ms[r], cs[t], total]), acc[r][t])

            origin = ir.Constant(width.type, 0)
            span(groups, origin, origin, origin, group)
            tail = builder.mul(groups, ir.Constant(width.type, group))
            span(pairs, tail, builder.udiv(tail, ir.Constant(width.type, 2)), groups, 2)
            total = cgutils.get_or_insert_function(module, ir.FunctionType(_F32, [_F32, _V16F]),
                                                   "llvm.vector.reduce.fadd.v16f32")
            for r in range(rows):
                for t in range(tokens):
                    index = builder.add(builder.mul(builder.sub(at(r, r0), first), rs), builder.mul(at(t, t0), ts))
                    ptr = builder.gep(out_s.data, [index])
                    builder.store(builder.call(total, [builder.load(ptr), builder.load(acc[r][t])]), ptr)
            return context.get_dummy_value()

        return sig, codegen

    return tile


tile_wide = _make_tile(WIDE, WIDE, False, True)
tile_pair = _make_tile(PAIR, PAIR, False, True)
tile_one = _make_tile(1, 1, False, False)
tile_wide_4 = _make_tile(WIDE, WIDE, True, True)
tile_pair_4 = _make_tile(PAIR, PAIR, True, True)
tile_one_4 = _make_tile(1, 1, True, False)
tile_column_4 = _make_tile(COLUMN, 1, True, False)


def pack_nibbles(u: np.ndarray) -> np.ndarray:
    """Codes of 0..15 (o, i), two a byte (o, i / 2): in each chunk of 64 codes, byte j holds
    code j in its low nibble and code 32 + j in its high one."""
    o, i = u.shape
    pairs = u.reshape(o, i // 64, 2, 32)
    return np.ascontiguousarray(pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(o, i // 2)


def kernel_order(width: int) -> np.ndarray:
    """Where the kernel keeps each of a row's `width` features (codes and activations alike).
    Chunks of 64 are two vectors of 32 words; vpdpwssd sums two words into each of 16 int32
    lanes. A run of G blocks (GROUP; the blocks left after the last group go in runs of 2)
    gives each block 16 / G lanes, so after the run's G / 2 chunks lane x holds the exact sum
    of block x * G / 16 alone (at most 32 x 255 x LEVELS: no overflow), and one conversion and
    one scale serve the run."""
    blocks = width // BLOCK
    order = np.empty(width, np.int64)
    first = 0
    for size, runs in ((GROUP, blocks // GROUP), (2, blocks % GROUP // 2)):
        lanes = 16 // size  # a block's lanes
        for _ in range(runs):
            e = np.arange(size * BLOCK)
            block, q = e // BLOCK, e % BLOCK
            chunk, lane = q // (2 * lanes), block * lanes + q % (2 * lanes) // 2
            order[first + e] = first + chunk * 32 + lane * 2 + q % 2
            first += size * BLOCK
    return order


def arrange_codes(u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A matrix's unsigned codes (o, i) as the integer kernel reads them (codes of 0..15 two a
    byte, others a byte each) and the order its activations take (kernel_order)."""
    order = kernel_order(u.shape[1])
    arranged = np.empty_like(u)
    arranged[:, order] = u
    return (pack_nibbles(arranged) if u.max(initial=0) <= 15 else arranged), order


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


@njit(parallel=True, nogil=True, fastmath=FASTMATH, cache=True, boundscheck=False, error_model=ERRORS)
def int8_matmul(codes, d, m, dw, mw, v, dx, c, out, token_major, add):
    """out = the product for every (row, token): (o, T), or (T, o) when token_major; added to
    what out holds when `add`. codes (arrange_codes): a byte a code (o, i), or two (o, i / 2);
    d, m the block scales, dw, mw the same in lane layout (lane_scales; mw lone); v (T, i) the
    activations in the codes' order, dx and c (quantize_words) in lane layout. Tasks of
    ROWS_PER_TASK rows; in each, the products tile by tile."""
    o = codes.shape[0]
    nibbles = codes.shape[1] != v.shape[1]
    tokens = v.shape[0]
    tasks = (o + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    flat = out.reshape(out.size)
    if token_major and tokens > L1_WAYS:
        # Token-major, the tiles would write lines o floats apart: for SmolLM2's head (49152)
        # and most widths a multiple of 4 KiB, all in one L1 set. Past L1's ways, each task's
        # sums go to a (rows, tokens) scratch, then out a token at a time: the head at 32
        # tokens ran at 82-86 G multiply-adds/s written directly, 97-102 so (16 tokens: 4% faster).
        for task in prange(tasks):
            r0, r1 = task * ROWS_PER_TASK, min(o, (task + 1) * ROWS_PER_TASK)
            scratch = np.zeros((r1 - r0) * tokens, np.float32)
            _task_tiles(codes, d, m, dw, mw, v, dx, c, scratch, r0, r1, tokens, 1, r0, nibbles)
            for t in range(tokens):
                for r in range(r0, r1):
                    total = scratch[(r - r0) * tokens + t]
                    flat[t * o + r] = flat[t * o + r] + total if add else total
        return
    rs, ts = (1, o) if token_major else (tokens, 1)
    for task in prange(tasks):
        r0, r1 = task * ROWS_PER_TASK, min(o, (task + 1) * ROWS_PER_TASK)
        if not add:  # the tiles add to what out holds
            for r in range(r0, r1):
                for t in range(tokens):
                    flat[r * rs + t * ts] = 0
        _task_tiles(codes, d, m, dw, mw, v, dx, c, flat, r0, r1, rs, ts, 0, nibbles)


@njit(inline="always", fastmath=FASTMATH, boundscheck=False, error_model=ERRORS)
def _task_tiles(codes, d, m, dw, mw, v, dx, c, out, r0, r1, rs, ts, first, nibbles):
    """Rows r0 .. r1 of the product for every token, tile by tile, into out (see _make_tile
    for rs, ts and first). The tiles differ in how many sums they keep in flight, not in how a
    sum is taken: a (row, token)'s result is the same in any of them."""
    tokens = v.shape[0]
    side = WIDE if tokens >= WIDE_TOKENS else PAIR if tokens >= PAIR_TOKENS else 1
    r = r0
    while nibbles and tokens == 1 and r + COLUMN <= r1:  # a lone token: COLUMN rows a tile
        tile_column_4(codes, d, m, v, dx, c, out, r, 0, rs, ts, first)
        r += COLUMN
    while side > 1 and r + side <= r1:  # side x side tiles, the tokens left in pairs, then one by one
        t = 0
        while t + side <= tokens:
            _tile(codes, d, m, dw, mw, v, dx, c, out, r, t, rs, ts, first, side, nibbles)
            t += side
        while t + PAIR <= tokens and side > PAIR:
            for rr in range(r, r + side, PAIR):
                _tile(codes, d, m, dw, mw, v, dx, c, out, rr, t, rs, ts, first, PAIR, nibbles)
            t += PAIR
        for rr in range(r, r + side):
            for tt in range(t, tokens):
                _tile(codes, d, m, dw, mw, v, dx, c, out, rr, tt, rs, ts, first, 1, nibbles)
        r += side
    for rr in range(r, r1):  # the rows left
        for t in range(tokens):
            _tile(codes, d, m, dw, mw, v, dx, c, out, rr, t, rs, ts, first, 1, nibbles)


@njit(inline="always", fastmath=FASTMATH, boundscheck=False, error_model=ERRORS)
def _tile(codes, d, m, dw, mw, v, dx, c, flat, r, t, rs, ts, first, side, nibbles):
    if nibbles:
        if side == WIDE:
            tile_wide_4(codes, dw, mw, v, dx, c, flat, r, t, rs, ts, first)
        elif side == PAIR:
            tile_pair_4(codes, dw, mw, v, dx, c, flat, r, t, rs, ts, first)
        else:
            tile_one_4(codes, d, m, v, dx, c, flat, r, t, rs, ts, first)
    elif side == WIDE:
        tile_wide(codes, dw, mw, v, dx, c, flat, r, t, rs, ts, first)
    elif side == PAIR:
        tile_pair(codes, dw, mw, v, dx, c, flat, r, t, rs, ts, first)
    else:
        tile_one(codes, d, m, v, dx, c, flat, r, t, rs, ts, first)


@njit(nogil=True, fastmath=FASTMATH, cache=True, boundscheck=False, error_model=ERRORS)
def int8_product(codes, d, m, dw, mw, order, x, colscale, out, token_major, add):
    """quantize_words() then int8_matmul() in one call (a step makes some 150 products; each
    call from Python costs microseconds). order: the codes' kernel_order."""
    i, tokens = x.shape
    v = np.empty((tokens, i), np.int16)
    dx = np.empty((tokens, dw.shape[1]), np.float32)
    c = np.empty((tokens, dw.shape[1]), np.float32)
    quantize_words(x, colscale, order, v, dx, c)
    int8_matmul(codes, d, m, dw, mw, v, dx, c, out, token_major, add)


KERNELS = (quantize, dequantize, quantize_words, int8_matmul, int8_product)
