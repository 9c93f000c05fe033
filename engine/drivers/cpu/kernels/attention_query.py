"""query_block: one decode query against a block of 16 keys, lane t being key t (attention.py's
query_task, a lone token)."""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .attention_ir import (
    F32,
    FIXED_HEAD,
    I32,
    LANES,
    SHARED_GROUPS,
    VF,
    VI,
    const,
    elements,
    lane_sum,
    lanes_sum,
    prefetch,
    splat,
    vector_exp,
)


@intrinsic
def query_block(typingctx, q, cache, n, block, ahead, h, used, acc, top, den):
    """One query's group of query heads against one block of exactly LANES keys (block_size
    16, hd a multiple of 16): the scores of the block's keys for a head are one vector (dot
    products summed across lanes by lanes_sum), so e^x and the softmax run across keys, and
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
        fma = cgutils.get_or_insert_function(module, ir.FunctionType(VF, [VF] * 3), "llvm.fma.v16f32")
        vmax = cgutils.get_or_insert_function(module, ir.FunctionType(F32, [VF]), "llvm.vector.reduce.fmax.v16f32")
        heads, hd = builder.extract_value(q_a.shape, 1), builder.extract_value(q_a.shape, 2)
        kv_heads, blocks = builder.extract_value(cache_a.shape, 1), builder.extract_value(cache_a.shape, 2)
        group = builder.sdiv(heads, kv_heads)
        data, widen = elements(builder, cache_a.data, kinds[1])
        span = builder.mul(ir.Constant(hd.type, LANES), hd)
        keys = builder.gep(data, [builder.mul(builder.add(builder.mul(h, blocks), block), span)])
        values = builder.gep(data, [builder.mul(builder.add(builder.mul(builder.add(kv_heads, h), blocks),
                                                                                block), span)])
        prefetch(builder, data, [builder.mul(builder.add(builder.mul(h, blocks), ahead), span),
                                  builder.mul(builder.add(builder.mul(builder.add(kv_heads, h), blocks), ahead), span)],
                  span)
        as_vector = VF.as_pointer()
        as_kv_vector = ir.VectorType(data.type.pointee, LANES).as_pointer()
        weights_at = cgutils.alloca_once(builder, VF)
        weight = builder.bitcast(weights_at, F32.as_pointer())
        partial = [cgutils.alloca_once(builder, VF) for _ in range(LANES)]
        intp = hd.type

        def online_softmax(g, scores, seen):
            """Head g's running maximum and denominator updated with a block's scores (lane t:
            key t; `seen`: the lanes that are keys, None for all); returns the keys' weights
            and the factor what was summed under the old maximum takes."""
            if seen is not None:
                scores = builder.select(seen, scores, const(float("-inf")))
            top_at = builder.gep(top_a.data, [g])
            old = builder.load(top_at)
            big = builder.call(vmax, [scores])
            new = builder.select(builder.fcmp_ordered(">", big, old), big, old)
            builder.store(new, top_at)
            rescale = vector_exp(builder, module, splat(builder, builder.fsub(old, new), VF))
            p = vector_exp(builder, module, builder.fsub(scores, splat(builder, new, VF)))
            if seen is not None:
                p = builder.select(seen, p, const(0.0))
            den_at = builder.gep(den_a.data, [g])
            total = lane_sum(builder, p)
            scale = builder.extract_element(rescale, ir.Constant(I32, 0))
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
                    total = const(0.0)
                    for q_c, k_c in zip(qv[g], kv, strict=True):
                        total = builder.call(fma, [q_c, k_c, total])
                    partials[g][t] = total
            weights_all = cgutils.alloca_once(builder, VF, size=size)
            rescales = []
            for g in range(size):
                p, rescale = online_softmax(ir.Constant(intp, g), lanes_sum(builder, partials[g]), None)
                builder.store(p, builder.gep(weights_all, [ir.Constant(I32, g)]), align=4)
                rescales.append(rescale)
            flat = builder.bitcast(weights_all, F32.as_pointer())
            weights = [[splat(builder, builder.load(builder.gep(flat, [ir.Constant(I32, g * LANES + t)])), VF)
                        for t in range(LANES)] for g in range(size)]
            arows = [builder.gep(acc_a.data, [ir.Constant(intp, g * FIXED_HEAD)]) for g in range(size)]
            for c in chunks:
                ats = [builder.bitcast(builder.gep(row, [ir.Constant(intp, c)]), as_vector) for row in arows]
                sums = [[builder.fmul(builder.load(at, align=4), rescale)] + [const(0.0)] * 3
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
                seen = builder.icmp_signed("<", ir.Constant(VI, list(range(LANES))),
                                           splat(builder, builder.trunc(used, I32), VI))
            rows = [builder.gep(keys, [k]) for k in starts]
            vrows = [builder.gep(values, [k]) for k in starts]
            with cgutils.for_range(builder, group) as g_loop:
                g = g_loop.index
                head = builder.add(builder.mul(h, group), g)
                qrow = builder.gep(q_a.data, [builder.mul(builder.add(builder.mul(n, heads), head), size)])
                for p in partial:
                    builder.store(const(0.0), p)

                def scores_step(off):
                    qv = builder.load(builder.bitcast(builder.gep(qrow, [off]), as_vector), align=4)
                    for t in range(LANES):
                        kv = widen(builder.load(builder.bitcast(builder.gep(rows[t], [off]), as_kv_vector), align=2))
                        builder.store(builder.call(fma, [qv, kv, builder.load(partial[t])]), partial[t])

                each_chunk(scores_step)
                scores = lanes_sum(builder, [builder.load(p) for p in partial])
                p, rescale = online_softmax(g, scores, seen)
                # The weights go through memory: a broadcast from memory folds into the FMA, where
                # a lane extracted from a register costs three instructions.
                builder.store(p, weights_at, align=4)
                weights = [splat(builder, builder.load(builder.gep(weight, [ir.Constant(I32, t)])), VF)
                           for t in range(LANES)]
                arow = builder.gep(acc_a.data, [builder.mul(g, size)])

                def values_step(off):
                    at = builder.bitcast(builder.gep(arow, [off]), as_vector)
                    sums = [builder.fmul(builder.load(at, align=4), rescale)] + [const(0.0)] * 3
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
