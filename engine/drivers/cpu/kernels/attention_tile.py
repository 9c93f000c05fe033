"""tile_block: one block of keys against a tile of query vectors (attention.py's tile_task, a
row's several tokens). Lane x of every vector is one query vector (a query head of one of the
row's tokens), so the scores of a key against the whole tile are one vector: e^x, the running
maximum, the masks and the value product all run across lanes, with no horizontal sum.

    tile_block(qt, cache, block, ahead, h, base, used, limit, s, acc, top, den, staged)

qt (hd, 16): the tile's queries, pre-scaled, transposed; cache: one layer's paged KV
(2, kv_heads, blocks, block_size, hd), float32 or float16 bits (uint16: numba has no float16;
widened as they load, 16 with one instruction); `block`: the physical block, `ahead` a later one
of the row (its keys and values are prefetched), `h` its kv head, `base` the position of its
first key, `used` how many of its keys to read; limit (16,) int32: lane x sees positions below
limit[x]; s (block_size, 16): scratch; acc (hd, 16), top (16,), den (16,): the online softmax's
running value sum, maximum and denominator, updated in place; staged: room for a float16
block's keys and values widened.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .attention_ir import F32, I32, VF, VI, WAYS, const, elements, prefetch, same, splat, vector_exp, widened


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
        fma = cgutils.get_or_insert_function(module, ir.FunctionType(VF, [VF] * 3), "llvm.fma.v16f32")
        kv_heads, blocks, block_size, hd = (builder.extract_value(cache_a.shape, i) for i in range(1, 5))
        data, widen = elements(builder, cache_a.data, kinds[1])
        span = builder.mul(block_size, hd)
        keys = builder.gep(data, [builder.mul(builder.add(builder.mul(h, blocks), block), span)])
        head_v = builder.add(kv_heads, h)
        values = builder.gep(data, [builder.mul(builder.add(builder.mul(head_v, blocks), block), span)])
        prefetch(builder, data, [builder.mul(builder.add(builder.mul(h, blocks), ahead), span),
                                  builder.mul(builder.add(builder.mul(head_v, blocks), ahead), span)], span)
        if data.type.pointee != F32:
            # Each key and value element is broadcast to a whole vector of queries: widened
            # there, it took a load, a conversion and a broadcast where a float32 one folds
            # into the FMA (1.4-1.5x slower). Widened once into `staged` instead.
            keys, values = widened(builder, keys, values, builder.mul(used, hd), staged_a.data, widen)
            widen = same
        qt_v = builder.bitcast(qt_a.data, VF.as_pointer())
        s_v = builder.bitcast(s_a.data, VF.as_pointer())
        acc_v = builder.bitcast(acc_a.data, VF.as_pointer())
        top_v = builder.bitcast(top_a.data, VF.as_pointer())
        den_v = builder.bitcast(den_a.data, VF.as_pointer())
        limit = builder.load(builder.bitcast(limit_a.data, VI.as_pointer()), align=4)
        minus_inf = const(float("-inf"))
        zero, one, ways = (ir.Constant(used.type, k) for k in (0, 1, WAYS))

        def clamp(i, top):
            return builder.select(builder.icmp_signed("<", i, top), i, top)

        def visible(t):
            pos = builder.trunc(builder.add(base, t), I32)
            return builder.icmp_signed("<", splat(builder, pos, VI), limit)

        # Scores: s[t] = sum_e qt[e] * k[t, e], one vector per key, WAYS keys at a time (each qt[e]
        # load serves them all, and their sums are independent chains); keys a lane may not see: -inf.
        last = builder.sub(used, one)
        with cgutils.for_range_slice(builder, zero, used, ways) as (t0, _):
            ts = [clamp(builder.add(t0, ir.Constant(t0.type, k)), last) for k in range(WAYS)]
            rows = [builder.gep(keys, [builder.mul(t, hd)]) for t in ts]
            scores = [cgutils.alloca_once_value(builder, const(0.0)) for _ in ts]
            with cgutils.for_range(builder, hd) as e_loop:
                e = e_loop.index
                q = builder.load(builder.gep(qt_v, [e]), align=4)
                for row, score in zip(rows, scores, strict=True):
                    k = splat(builder, widen(builder.load(builder.gep(row, [e]))), VF)
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
        rescale = vector_exp(builder, module, builder.fsub(old, new))
        den = cgutils.alloca_once_value(builder, builder.fmul(builder.load(den_v, align=4), rescale))
        with cgutils.for_range(builder, used) as t_loop:
            t = t_loop.index
            at = builder.gep(s_v, [t])
            p = vector_exp(builder, module, builder.fsub(builder.load(at, align=4), new))
            p = builder.select(visible(t), p, const(0.0))  # e^-inf saturates at ~1e-38: an exact 0
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
                    v = splat(builder, widen(builder.load(builder.gep(row, [e]))), VF)
                    builder.store(builder.call(fma, [p, v, builder.load(total)]), total)
            for at, total in zip(ats, totals, strict=True):
                builder.store(builder.load(total), at, align=4)
        return context.get_dummy_value()

    return sig, codegen
