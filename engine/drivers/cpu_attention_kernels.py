"""Paged attention on the CPU: every fed token attends its own row's keys in place, block by
block through the row's block table, with an online softmax (no gathered copy, no per-row
Python loop). `paged_attention` splits the queries into tasks of one kv head each: a lone
query (decode) alone, a row's several consecutive tokens in tiles of up to LANES query vectors.

The inner steps are 16-lane float vectors written as LLVM IR in numba intrinsics: numba's own
loops over 16 lanes of an array came out scalar. Portable IR: LLVM splits the vectors into
whatever the CPU has. They live in this file with every kernel that calls them because numba's
disk cache is checked against the calling function's own source file only.

tile_block: one block of keys against a tile of query vectors. Lane x of every vector is one
query vector (a query head of one of the row's tokens), so the scores of a key against the
whole tile are one vector: e^x, the running maximum, the masks and the value product all run
across lanes, with no horizontal sum.

    tile_block(qt, cache, block, ahead, h, base, used, limit, s, acc, top, den)

qt (hd, 16): the tile's queries, pre-scaled, transposed; cache: one layer's paged KV
(2, kv_heads, blocks, block_size, hd), float32 or float16 bits (uint16: numba has no float16;
widened as they load, 16 with one instruction); `block`: the physical block, `ahead` a later one of the row
(its keys and values are prefetched), `h` its kv head, `base` the position of its first key,
`used` how many of its keys to read; limit (16,) int32: lane x sees positions below limit[x];
s (block_size, 16): scratch; acc (hd, 16), top (16,), den (16,): the online softmax's running
value sum, maximum and denominator, updated in place.

query_block: one decode query against a block of 16 keys, lane t being key t (see there).

Both ask for the row's block AHEAD blocks on, into L2, while computing this one (`_prefetch`):
a row's blocks sit anywhere in the pool, where the hardware's prefetchers do not follow. A
layer's attention over 8 rows of 256 keys, its KV not in cache: 351 -> 271 us best, 388 -> 298
median (blocks scattered; one block ahead into L1), then 1.3x more at 32 rows into L2 and 5-10%
more two blocks ahead; interleaved in one run each.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .cpu_kernels_numba import ERRORS, FASTMATH, exp

LANES = 16
AHEAD = 2  # blocks prefetched ahead (into L2): 5-10% faster than 1, no different from 4
FIXED_HEAD = 64  # the head size query_block has compiled with constant offsets (SmolLM2's, Llama-class 64)
# Group sizes (query heads a kv head serves) query_block has compiled to read each key and value
# once for the whole group (SmolLM2: 3; Llama-class: 2-8); other groups read them once a head.
# SmolLM2's decode attention, 30 layers of 32 rows x 128-256 keys in float16: 6.9 against 7.8 ms
# with the KV in cache, 11.7 against 12.4 out of it (separate processes, alternated).
SHARED_GROUPS = (2, 3, 4)
WAYS = 4  # keys (then features) a loop step: independent FMA chains hide the FMA's latency

_F32, _I32 = ir.FloatType(), ir.IntType(32)
_VF, _VI = ir.VectorType(_F32, LANES), ir.VectorType(_I32, LANES)
_ZERO_MASK = ir.Constant(_VI, [0] * LANES)


def _splat(builder, value, vector):
    one = builder.insert_element(ir.Constant(vector, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, ir.Constant(vector, ir.Undefined), _ZERO_MASK)


def _const(value: float):
    return ir.Constant(_VF, [value] * LANES)


def _same(x):
    return x


def _elements(builder, data, cache_type):
    """The cache's elements as LLVM sees them, and how one (or a vector of them) becomes
    float32: float16 bits (a uint16 array; numba has no float16) are widened as they load
    (one vcvtph2ps for 16 lanes), float32 is used as it is."""
    if cache_type.dtype != types.uint16:
        return data, _same
    data = builder.bitcast(data, ir.HalfType().as_pointer())

    def widen(x):
        wide = ir.VectorType(_F32, x.type.count) if isinstance(x.type, ir.VectorType) else _F32
        return builder.fpext(x, wide)

    return data, widen


def _widened(builder, keys, values, count, staged, widen):
    """The first `count` float16 keys and values of a block widened to float32 into staged
    (2 * block_size * hd floats), 16 an instruction then one at a time; returns where."""
    out = builder.bitcast(staged, _F32.as_pointer())
    whole = builder.mul(builder.sdiv(count, ir.Constant(count.type, LANES)), ir.Constant(count.type, LANES))
    half16 = ir.VectorType(keys.type.pointee, LANES).as_pointer()
    targets = (out, builder.gep(out, [count]))
    for source, to in zip((keys, values), targets, strict=True):
        with cgutils.for_range_slice(builder, ir.Constant(count.type, 0), whole, ir.Constant(count.type, LANES)) as (i, _):
            x = builder.load(builder.bitcast(builder.gep(source, [i]), half16), align=2)
            builder.store(widen(x), builder.bitcast(builder.gep(to, [i]), _VF.as_pointer()), align=4)
        with cgutils.for_range_slice(builder, whole, count, ir.Constant(count.type, 1)) as (i, _):
            builder.store(widen(builder.load(builder.gep(source, [i]))), builder.gep(to, [i]))
    return targets


@intrinsic
def as_float32(typingctx, x):
    """A KV cache element as float32: float16 bits (uint16) widened, float32 as it is."""
    def codegen(context, builder, signature, args):
        if signature.args[0] == types.uint16:
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), _F32)
        return args[0]

    return types.float32(x), codegen


def _exp(builder, module, x):
    """e^x per lane, the same range reduction and polynomial as cpu_kernels_numba.exp."""
    floor = cgutils.get_or_insert_function(module, ir.FunctionType(_VF, [_VF]), "llvm.floor.v16f32")
    fma = cgutils.get_or_insert_function(module, ir.FunctionType(_VF, [_VF] * 3), "llvm.fma.v16f32")
    x = builder.select(builder.fcmp_ordered(">", x, _const(-87.0)), x, _const(-87.0))
    x = builder.select(builder.fcmp_ordered("<", x, _const(88.0)), x, _const(88.0))
    n = builder.call(floor, [builder.call(fma, [x, _const(1.44269504), _const(0.5)])])
    r = builder.fadd(builder.fsub(x, builder.fmul(n, _const(0.693359375))), builder.fmul(n, _const(2.12194440e-4)))
    p = _const(1.9875691500e-4)
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = builder.call(fma, [p, r, _const(c)])
    p = builder.fadd(builder.call(fma, [builder.fmul(p, r), r, r]), _const(1.0))
    scale = builder.shl(builder.add(builder.fptosi(n, _VI), ir.Constant(_VI, [127] * LANES)),
                        ir.Constant(_VI, [23] * LANES))
    return builder.fmul(p, builder.bitcast(scale, _VF))


@intrinsic
def tile_block(typingctx, qt, cache, block, ahead, h, base, used, limit, s, acc, top, den, staged):
    sig = types.void(qt, cache, types.intp, types.intp, types.intp, types.intp, types.intp, limit, s, acc, top, den,
                     staged)

    def codegen(context, builder, signature, args):
        kinds = signature.args
        qt_a, cache_a = (context.make_array(k)(context, builder, a) for k, a in zip(kinds[:2], args[:2], strict=True))
        block, ahead, h, base, used = args[2:7]
        limit_a, s_a, acc_a, top_a, den_a, staged_a = (context.make_array(k)(context, builder, a)
                                                       for k, a in zip(kinds[7:], args[7:], strict=True))
        module = builder.module
        fma = cgutils.get_or_insert_function(module, ir.FunctionType(_VF, [_VF] * 3), "llvm.fma.v16f32")
        kv_heads, blocks, block_size, hd = (builder.extract_value(cache_a.shape, i) for i in range(1, 5))
        data, widen = _elements(builder, cache_a.data, kinds[1])
        span = builder.mul(block_size, hd)
        keys = builder.gep(data, [builder.mul(builder.add(builder.mul(h, blocks), block), span)])
        head_v = builder.add(kv_heads, h)
        values = builder.gep(data, [builder.mul(builder.add(builder.mul(head_v, blocks), block), span)])
        _prefetch(builder, data, [builder.mul(builder.add(builder.mul(h, blocks), ahead), span),
                                  builder.mul(builder.add(builder.mul(head_v, blocks), ahead), span)], span)
        if data.type.pointee != _F32:
            # Each key and value element is broadcast to a whole vector of queries: widened
            # there, it took a load, a conversion and a broadcast where a float32 one folds
            # into the FMA (1.4-1.5x slower). Widened once into `staged` instead.
            keys, values = _widened(builder, keys, values, builder.mul(used, hd), staged_a.data, widen)
            widen = _same
        qt_v = builder.bitcast(qt_a.data, _VF.as_pointer())
        s_v = builder.bitcast(s_a.data, _VF.as_pointer())
        acc_v = builder.bitcast(acc_a.data, _VF.as_pointer())
        top_v = builder.bitcast(top_a.data, _VF.as_pointer())
        den_v = builder.bitcast(den_a.data, _VF.as_pointer())
        limit = builder.load(builder.bitcast(limit_a.data, _VI.as_pointer()), align=4)
        minus_inf = _const(float("-inf"))
        zero, one, ways = (ir.Constant(used.type, k) for k in (0, 1, WAYS))

        def clamp(i, top):
            return builder.select(builder.icmp_signed("<", i, top), i, top)

        def visible(t):
            pos = builder.trunc(builder.add(base, t), _I32)
            return builder.icmp_signed("<", _splat(builder, pos, _VI), limit)

        # Scores: s[t] = sum_e qt[e] * k[t, e], one vector per key, WAYS keys at a time (each qt[e]
        # load serves them all, and their sums are independent chains); keys a lane may not see: -inf.
        last = builder.sub(used, one)
        with cgutils.for_range_slice(builder, zero, used, ways) as (t0, _):
            ts = [clamp(builder.add(t0, ir.Constant(t0.type, k)), last) for k in range(WAYS)]
            rows = [builder.gep(keys, [builder.mul(t, hd)]) for t in ts]
            scores = [cgutils.alloca_once_value(builder, _const(0.0)) for _ in ts]
            with cgutils.for_range(builder, hd) as e_loop:
                e = e_loop.index
                q = builder.load(builder.gep(qt_v, [e]), align=4)
                for row, score in zip(rows, scores, strict=True):
                    k = _splat(builder, widen(builder.load(builder.gep(row, [e]))), _VF)
                    builder.store(builder.call(fma, [q, k, builder.load(score)]), score)
            for t, score in zip(ts, scores, strict=True):  # a clamped duplicate stores the same value
                builder.store(builder.select(visible(t), builder.load(score), minus_inf), builder.gep(s_v, [t]), align=4)
        # The running maximum, and the rescale of what was summed under the old one.
        old = builder.load(top_v, align=4)
        top = cgutils.alloca_once_value(builder, old)
        with cgutils.for_range(builder, used) as t_loop:
            v = builder.load(builder.gep(s_v, [t_loop.index]), align=4)
            m = builder.load(top)
            builder.store(builder.select(builder.fcmp_ordered(">", v, m), v, m), top)
        new = builder.load(top)
        builder.store(new, top_v, align=4)
        rescale = _exp(builder, module, builder.fsub(old, new))
        den = cgutils.alloca_once_value(builder, builder.fmul(builder.load(den_v, align=4), rescale))
        with cgutils.for_range(builder, used) as t_loop:
            t = t_loop.index
            at = builder.gep(s_v, [t])
            p = _exp(builder, module, builder.fsub(builder.load(at, align=4), new))
            p = builder.select(visible(t), p, _const(0.0))  # e^-inf saturates at ~1e-38: an exact 0
            builder.store(p, at, align=4)
            builder.store(builder.fadd(builder.load(den), p), den)
        builder.store(builder.load(den), den_v, align=4)
        # Values: acc[e] = acc[e] * rescale + sum_t p[t] * v[t, e], WAYS features at a time.
        last_e = builder.sub(hd, one)
        with cgutils.for_range_slice(builder, zero, hd, ways) as (e0, _):
            es = [clamp(builder.add(e0, ir.Constant(e0.type, k)), last_e) for k in range(WAYS)]
            ats = [builder.gep(acc_v, [e]) for e in es]
            totals = [cgutils.alloca_once_value(builder, builder.fmul(builder.load(at, align=4), rescale)) for at in ats]
            with cgutils.for_range(builder, used) as t_loop:
                t = t_loop.index
                p = builder.load(builder.gep(s_v, [t]), align=4)
                row = builder.gep(values, [builder.mul(t, hd)])
                for e, total in zip(es, totals, strict=True):
                    v = _splat(builder, widen(builder.load(builder.gep(row, [e]))), _VF)
                    builder.store(builder.call(fma, [p, v, builder.load(total)]), total)
            for at, total in zip(ats, totals, strict=True):
                builder.store(builder.load(total), at, align=4)
        return context.get_dummy_value()

    return sig, codegen


def _prefetch(builder, base, offsets, count):
    """Ask for the cache lines of base[offset : offset + count] for each offset: a
    row's next block, fetched while this one is computed (its blocks sit anywhere in the pool,
    so the hardware's prefetchers do not see them coming)."""
    fetch = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [
        ir.IntType(8).as_pointer(), _I32, _I32, _I32]), "llvm.prefetch.p0i8")
    line = ir.Constant(count.type, 32 if isinstance(base.type.pointee, ir.HalfType) else 16)  # elements a 64-byte line
    for offset in offsets:
        start = builder.gep(base, [offset])
        with cgutils.for_range_slice(builder, ir.Constant(count.type, 0), count, line) as (i, _):
            at = builder.bitcast(builder.gep(start, [i]), ir.IntType(8).as_pointer())
            builder.call(fetch, [at, ir.Constant(_I32, 0), ir.Constant(_I32, 2), ir.Constant(_I32, 1)])  # to L2


def _lanes_sum(builder, vectors):
    """Sixteen 16-lane vectors -> one whose lane t is the sum of vectors[t]'s lanes: four
    rounds of pairing halves, quarters, eighths and neighbours (30 shuffles and 15 adds, where
    one horizontal sum per vector would take 16 of those trees)."""
    def pair(x, y, lo, hi):
        mask_lo = ir.Constant(ir.VectorType(_I32, LANES), lo)
        mask_hi = ir.Constant(ir.VectorType(_I32, LANES), hi)
        return builder.fadd(builder.shuffle_vector(x, y, mask_lo), builder.shuffle_vector(x, y, mask_hi))

    for width in (8, 4, 2, 1):  # each round halves how many lanes hold one vector's partial sums
        lo = [i for i in range(LANES) if (i // width) % 2 == 0]
        hi = [i for i in range(LANES) if (i // width) % 2 == 1]
        lo, hi = lo + [LANES + i for i in lo], hi + [LANES + i for i in hi]
        vectors = [pair(vectors[i], vectors[i + 1], lo, hi) for i in range(0, len(vectors), 2)]
    return vectors[0]


def _sum(builder, v):
    """The sum of a vector's lanes, as a tree (an in-order reduction would chain 16 adds)."""
    width = LANES
    while width > 1:
        width //= 2
        mask = ir.Constant(ir.VectorType(_I32, LANES), [(i + width) % LANES for i in range(LANES)])
        v = builder.fadd(v, builder.shuffle_vector(v, ir.Constant(_VF, ir.Undefined), mask))
    return builder.extract_element(v, ir.Constant(_I32, 0))


@intrinsic
def query_block(typingctx, q, cache, n, block, ahead, h, used, acc, top, den):
    """One query's group of query heads against one block of exactly LANES keys (block_size
    16, hd a multiple of 16): the scores of the block's keys for a head are one vector (dot
    products summed across lanes by _lanes_sum), so e^x and the softmax run across keys, and
    the value product keeps hd / 16 vector accumulators per head. Keys past `used` are read
    as the last used key (in the block, finite) and weigh exactly 0. q (Q, heads, hd);
    acc (group, hd), top (group,), den (group,) float32: the online softmax's state."""
    sig = types.void(q, cache, types.intp, types.intp, types.intp, types.intp, types.intp, acc, top, den)

    def codegen(context, builder, signature, args):
        kinds = signature.args
        q_a, cache_a = (context.make_array(k)(context, builder, a) for k, a in zip(kinds[:2], args[:2], strict=True))
        n, block, ahead, h, used = args[2:7]
        acc_a, top_a, den_a = (context.make_array(k)(context, builder, a) for k, a in zip(kinds[7:], args[7:], strict=True))
        module = builder.module
        fma = cgutils.get_or_insert_function(module, ir.FunctionType(_VF, [_VF] * 3), "llvm.fma.v16f32")
        vmax = cgutils.get_or_insert_function(module, ir.FunctionType(_F32, [_VF]), "llvm.vector.reduce.fmax.v16f32")
        heads, hd = builder.extract_value(q_a.shape, 1), builder.extract_value(q_a.shape, 2)
        kv_heads, blocks = builder.extract_value(cache_a.shape, 1), builder.extract_value(cache_a.shape, 2)
        group = builder.sdiv(heads, kv_heads)
        data, widen = _elements(builder, cache_a.data, kinds[1])
        span = builder.mul(ir.Constant(hd.type, LANES), hd)
        keys = builder.gep(data, [builder.mul(builder.add(builder.mul(h, blocks), block), span)])
        values = builder.gep(data, [builder.mul(builder.add(builder.mul(builder.add(kv_heads, h), blocks),
                                                                                block), span)])
        _prefetch(builder, data, [builder.mul(builder.add(builder.mul(h, blocks), ahead), span),
                                  builder.mul(builder.add(builder.mul(builder.add(kv_heads, h), blocks), ahead), span)],
                  span)
        as_vector = _VF.as_pointer()
        as_kv_vector = ir.VectorType(data.type.pointee, LANES).as_pointer()
        weights_at = cgutils.alloca_once(builder, _VF)
        weight = builder.bitcast(weights_at, _F32.as_pointer())
        partial = [cgutils.alloca_once(builder, _VF) for _ in range(LANES)]
        intp = hd.type

        def online_softmax(g, scores, seen):
            """Head g's running maximum and denominator updated with a block's scores (lane t:
            key t; `seen`: the lanes that are keys, None for all); returns the keys' weights
            and the factor what was summed under the old maximum takes."""
            if seen is not None:
                scores = builder.select(seen, scores, _const(float("-inf")))
            top_at = builder.gep(top_a.data, [g])
            old = builder.load(top_at)
            big = builder.call(vmax, [scores])
            new = builder.select(builder.fcmp_ordered(">", big, old), big, old)
            builder.store(new, top_at)
            rescale = _exp(builder, module, _splat(builder, builder.fsub(old, new), _VF))
            p = _exp(builder, module, builder.fsub(scores, _splat(builder, new, _VF)))
            if seen is not None:
                p = builder.select(seen, p, _const(0.0))
            den_at = builder.gep(den_a.data, [g])
            total = _sum(builder, p)
            scale = builder.extract_element(rescale, ir.Constant(_I32, 0))
            builder.store(builder.fadd(builder.fmul(builder.load(den_at), scale), total), den_at)
            return p, rescale

        def emit_shared(size):
            """A whole block of head size FIXED_HEAD for a group of `size` heads: each key and
            value loaded (and widened) once for the group, where emit() does so once a head.
            Each head's sums are the same operations in the same order as emit()'s, so its
            result is bit for bit the same."""
            chunks = range(0, FIXED_HEAD, LANES)
            fixed = ir.Constant(intp, FIXED_HEAD)

            def vector(row, off, kind=as_vector, align=4):
                return builder.load(builder.bitcast(builder.gep(row, [ir.Constant(intp, off)]), kind), align=align)

            heads_g = [builder.add(builder.mul(h, group), ir.Constant(intp, g)) for g in range(size)]
            qrows = [builder.gep(q_a.data, [builder.mul(builder.add(builder.mul(n, heads), head), fixed)])
                     for head in heads_g]
            qv = [[vector(row, c) for c in chunks] for row in qrows]
            partials = [[None] * LANES for _ in range(size)]
            for t in range(LANES):
                kv = [widen(vector(keys, t * FIXED_HEAD + c, as_kv_vector, 2)) for c in chunks]
                for g in range(size):
                    total = _const(0.0)
                    for q_c, k_c in zip(qv[g], kv, strict=True):
                        total = builder.call(fma, [q_c, k_c, total])
                    partials[g][t] = total
            weights_all = cgutils.alloca_once(builder, _VF, size=size)
            rescales = []
            for g in range(size):
                p, rescale = online_softmax(ir.Constant(intp, g), _lanes_sum(builder, partials[g]), None)
                builder.store(p, builder.gep(weights_all, [ir.Constant(_I32, g)]), align=4)
                rescales.append(rescale)
            flat = builder.bitcast(weights_all, _F32.as_pointer())
            weights = [[_splat(builder, builder.load(builder.gep(flat, [ir.Constant(_I32, g * LANES + t)])), _VF)
                        for t in range(LANES)] for g in range(size)]
            arows = [builder.gep(acc_a.data, [ir.Constant(intp, g * FIXED_HEAD)]) for g in range(size)]
            for c in chunks:
                ats = [builder.bitcast(builder.gep(row, [ir.Constant(intp, c)]), as_vector) for row in arows]
                sums = [[builder.fmul(builder.load(at, align=4), rescale)] + [_const(0.0)] * 3
                        for at, rescale in zip(ats, rescales, strict=True)]
                for t in range(LANES):  # four chains a head, for the FMA's latency
                    vv = widen(vector(values, t * FIXED_HEAD + c, as_kv_vector, 2))
                    for g in range(size):
                        sums[g][t % 4] = builder.call(fma, [weights[g][t], vv, sums[g][t % 4]])
                for at, s in zip(ats, sums, strict=True):
                    builder.store(builder.fadd(builder.fadd(s[0], s[1]), builder.fadd(s[2], s[3])), at, align=4)

        def emit_fixed(choices):
            """emit_shared for the group sizes in `choices`, emit(FIXED_HEAD) for any other."""
            if not choices:
                emit(FIXED_HEAD)
                return
            with builder.if_else(builder.icmp_signed("==", group, ir.Constant(group.type, choices[0]))) as (yes, no):
                with yes:
                    emit_shared(choices[0])
                with no:
                    emit_fixed(choices[1:])

        def emit(fixed):
            """The block's code: for a whole block of head size `fixed`, every key's offset a
            constant (no address arithmetic or register spills in the inner loops; 3x faster
            on SmolLM2's head size 64); for fixed=None, any head size and a partial block."""
            size = ir.Constant(intp, fixed) if fixed else hd

            def each_chunk(step):
                if fixed:
                    for c in range(fixed // LANES):
                        step(ir.Constant(intp, c * LANES))
                    return
                with cgutils.for_range(builder, builder.sdiv(hd, ir.Constant(intp, LANES))) as c_loop:
                    step(builder.mul(c_loop.index, ir.Constant(intp, LANES)))

            if fixed:
                starts = [ir.Constant(intp, t * fixed) for t in range(LANES)]
                seen = None
            else:  # key t's offset in its block, clamped to the last used key
                last = builder.sub(used, ir.Constant(used.type, 1))
                starts = [builder.mul(builder.select(builder.icmp_signed("<", ir.Constant(intp, t), used),
                                                     ir.Constant(intp, t), last), hd) for t in range(LANES)]
                seen = builder.icmp_signed("<", ir.Constant(_VI, list(range(LANES))),
                                           _splat(builder, builder.trunc(used, _I32), _VI))
            rows = [builder.gep(keys, [k]) for k in starts]
            vrows = [builder.gep(values, [k]) for k in starts]
            with cgutils.for_range(builder, group) as g_loop:
                g = g_loop.index
                head = builder.add(builder.mul(h, group), g)
                qrow = builder.gep(q_a.data, [builder.mul(builder.add(builder.mul(n, heads), head), size)])
                for p in partial:
                    builder.store(_const(0.0), p)

                def scores_step(off):
                    qv = builder.load(builder.bitcast(builder.gep(qrow, [off]), as_vector), align=4)
                    for t in range(LANES):
                        kv = widen(builder.load(builder.bitcast(builder.gep(rows[t], [off]), as_kv_vector), align=2))
                        builder.store(builder.call(fma, [qv, kv, builder.load(partial[t])]), partial[t])

                each_chunk(scores_step)
                scores = _lanes_sum(builder, [builder.load(p) for p in partial])
                p, rescale = online_softmax(g, scores, seen)
                # The weights go through memory: a broadcast from memory folds into the FMA, where
                # a lane extracted from a register costs three instructions.
                builder.store(p, weights_at, align=4)
                weights = [_splat(builder, builder.load(builder.gep(weight, [ir.Constant(_I32, t)])), _VF)
                           for t in range(LANES)]
                arow = builder.gep(acc_a.data, [builder.mul(g, size)])

                def values_step(off):
                    at = builder.bitcast(builder.gep(arow, [off]), as_vector)
                    sums = [builder.fmul(builder.load(at, align=4), rescale)] + [_const(0.0)] * 3
                    for t in range(LANES):  # four chains, for the FMA's latency
                        vv = widen(builder.load(builder.bitcast(builder.gep(vrows[t], [off]), as_kv_vector), align=2))
                        sums[t % 4] = builder.call(fma, [weights[t], vv, sums[t % 4]])
                    builder.store(builder.fadd(builder.fadd(sums[0], sums[1]), builder.fadd(sums[2], sums[3])), at,
                                  align=4)

                each_chunk(values_step)

        whole = builder.and_(builder.icmp_signed("==", used, ir.Constant(used.type, LANES)),
                             builder.icmp_signed("==", hd, ir.Constant(intp, FIXED_HEAD)))
        with builder.if_else(whole) as (fixed, other):
            with fixed:
                emit_fixed(SHARED_GROUPS)
            with other:
                emit(None)
        return context.get_dummy_value()

    return sig, codegen


@njit(nogil=True, fastmath=FASTMATH, cache=True, boundscheck=False, error_model=ERRORS)
def query_task(q, cache, table, length, out, n, h):
    """Query n's heads of kv head h against its row's keys 0 .. length - 1. Blocks of LANES
    keys with head sizes a multiple of LANES go a block at a time (query_block); others one
    key at a time for the group of query heads that share it."""
    heads, hd = q.shape[1], q.shape[2]
    kv_heads, block_size = cache.shape[1], cache.shape[3]
    group = heads // kv_heads
    lanes = block_size == LANES and hd % LANES == 0
    qg = q[n, h * group : (h + 1) * group]
    top = np.full(group, -np.inf, dtype=np.float32)  # running max of the scores
    den = np.zeros(group, dtype=np.float32)
    acc = np.zeros((group, hd), dtype=np.float32)
    p = np.empty((group, block_size), dtype=np.float32)
    for j in range((length + block_size - 1) // block_size):
        used = min(block_size, length - j * block_size)
        if lanes:
            ahead = table[min(j + AHEAD, (length - 1) // block_size)]
            query_block(q, cache, n, table[j], ahead, h, used, acc, top, den)
            continue
        keys, values = cache[0, h, table[j]], cache[1, h, table[j]]
        for t in range(used):  # each key is loaded once for the whole group
            for g in range(group):
                s = np.float32(0)
                for e in range(hd):
                    s += qg[g, e] * as_float32(keys[t, e])
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
                p[g, t] = exp(p[g, t] - m)
                total += p[g, t]
            den[g] = total
        for t in range(used):
            for g in range(group):
                pt = p[g, t]
                for e in range(hd):
                    acc[g, e] += pt * as_float32(values[t, e])
    for g in range(group):
        inv = np.float32(1) / den[g]
        base = (h * group + g) * hd
        for e in range(hd):
            out[n, base + e] = acc[g, e] * inv


@njit(nogil=True, fastmath=FASTMATH, cache=True, boundscheck=False, error_model=ERRORS)
def tile_task(q, cache, table, lengths, out, n0, count, h):
    """Queries n0 .. n0 + count - 1 of one row (count * group <= LANES query vectors, one a
    lane) against the row's keys, a block at a time (tile_block)."""
    heads, hd = q.shape[1], q.shape[2]
    kv_heads, block_size = cache.shape[1], cache.shape[3]
    group = heads // kv_heads
    qt = np.zeros((hd, LANES), dtype=np.float32)
    limit = np.ones(LANES, dtype=np.int32)  # unused lanes see key 0 only, and are not written out
    length = 0
    for i in range(count):
        length = max(length, lengths[n0 + i])
        for g in range(group):
            lane = i * group + g
            limit[lane] = lengths[n0 + i]
            for e in range(hd):
                qt[e, lane] = q[n0 + i, h * group + g, e]
    top = np.full(LANES, -np.inf, dtype=np.float32)
    den = np.zeros(LANES, dtype=np.float32)
    acc = np.zeros((hd, LANES), dtype=np.float32)
    scratch = np.empty((block_size, LANES), dtype=np.float32)
    # A float16 block's keys and values, widened (tile_block); a float32 cache needs none.
    staged = np.empty(2 * block_size * hd if cache.itemsize == 2 else 1, dtype=np.float32)
    for j in range((length + block_size - 1) // block_size):
        ahead = table[min(j + AHEAD, (length - 1) // block_size)]
        tile_block(qt, cache, table[j], ahead, h, j * block_size, min(block_size, length - j * block_size), limit,
                   scratch, acc, top, den, staged)
    for i in range(count):
        for g in range(group):
            lane = i * group + g
            inv = np.float32(1) / den[lane]
            base = (h * group + g) * hd
            for e in range(hd):
                out[n0 + i, base + e] = acc[e, lane] * inv


@njit(parallel=True, nogil=True, fastmath=FASTMATH, cache=True, boundscheck=False, error_model=ERRORS)
def paged_attention(q, cache, tables, table_of, lengths, out):
    """q (Q, heads, hd) pre-scaled; cache (2, kv_heads, blocks, block_size, hd); query n
    attends keys 0 .. lengths[n] - 1 of the blocks tables[table_of[n]]; out (Q, heads * hd).
    A row's consecutive queries (several tokens fed) go in tiles of up to LANES query vectors,
    which read each key once for the tile; a lone query (decode) goes on its own."""
    queries, heads = q.shape[0], q.shape[1]
    kv_heads = cache.shape[1]
    per = LANES // (heads // kv_heads)  # a tile's most tokens
    first = np.empty(queries, np.int64)
    count = np.empty(queries, np.int64)
    tiles, n = 0, 0
    while n < queries:
        run = 1
        while n + run < queries and table_of[n + run] == table_of[n]:
            run += 1
        parts = (run + per - 1) // per if per > 1 else run
        size = (run + parts - 1) // parts  # tiles of even size: more of them to share out
        while run > 0:
            first[tiles], count[tiles] = n, min(size, run)
            n += count[tiles]
            run -= count[tiles]
            tiles += 1
    for task in prange(tiles * kv_heads):
        k, h = task // kv_heads, task % kv_heads
        n0, table = first[k], tables[table_of[first[k]]]
        if count[k] == 1:
            query_task(q, cache, table, lengths[n0], out, n0, h)
        else:
            tile_task(q, cache, table, lengths, out, n0, count[k], h)
