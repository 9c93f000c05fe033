"""The building blocks of paged attention's LLVM IR (attention_tile.py, attention_query.py):
16-lane float vectors, numba's own loops over 16 lanes of an array having come out scalar.
Portable IR: LLVM splits the vectors into whatever the CPU has.

Both kernels ask for the row's block AHEAD blocks on, into L2, while computing this one
(`prefetch`): a row's blocks sit anywhere in the pool, where the hardware's prefetchers do not
follow. A layer's attention over 8 rows of 256 keys, its KV not in cache: 351 -> 271 us best,
388 -> 298 median (blocks scattered; one block ahead into L1), then 1.3x more at 32 rows into L2
and 5-10% more two blocks ahead; interleaved in one run each.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

LANES = 16
AHEAD = 2  # blocks prefetched ahead (into L2): 5-10% faster than 1, no different from 4
FIXED_HEAD = 64  # the head size query_block has compiled with constant offsets (SmolLM2's, Llama-class 64)
# Group sizes (query heads a kv head serves) query_block has compiled to read each key and value
# once for the whole group (SmolLM2: 3; Llama-class: 2-8); other groups read them once a head.
# SmolLM2's decode attention, 30 layers of 32 rows x 128-256 keys in float16: 6.9 against 7.8 ms
# with the KV in cache, 11.7 against 12.4 out of it (separate processes, alternated).
SHARED_GROUPS = (2, 3, 4)
WAYS = 4  # keys (then features) a loop step: independent FMA chains hide the FMA's latency

F32, I32 = ir.FloatType(), ir.IntType(32)
VF, VI = ir.VectorType(F32, LANES), ir.VectorType(I32, LANES)
ZERO_MASK = ir.Constant(VI, [0] * LANES)


def splat(builder, value, vector):
    one = builder.insert_element(ir.Constant(vector, ir.Undefined), value, ir.Constant(I32, 0))
    return builder.shuffle_vector(one, ir.Constant(vector, ir.Undefined), ZERO_MASK)


def const(value: float):
    return ir.Constant(VF, [value] * LANES)


def same(x):
    return x


def elements(builder, data, cache_type):
    """The cache's elements as LLVM sees them, and how one (or a vector of them) becomes
    float32: float16 bits (a uint16 array; numba has no float16) are widened as they load
    (one vcvtph2ps for 16 lanes), float32 is used as it is."""
    if cache_type.dtype != types.uint16:
        return data, same
    data = builder.bitcast(data, ir.HalfType().as_pointer())

    def widen(x):
        wide = ir.VectorType(F32, x.type.count) if isinstance(x.type, ir.VectorType) else F32
        return builder.fpext(x, wide)

    return data, widen


def widened(builder, keys, values, count, staged, widen):
    """The first `count` float16 keys and values of a block widened to float32 into staged
    (2 * block_size * hd floats), 16 an instruction then one at a time; returns where."""
    out = builder.bitcast(staged, F32.as_pointer())
    whole = builder.mul(builder.sdiv(count, ir.Constant(count.type, LANES)), ir.Constant(count.type, LANES))
    half16 = ir.VectorType(keys.type.pointee, LANES).as_pointer()
    targets = (out, builder.gep(out, [count]))
    for source, to in zip((keys, values), targets, strict=True):
        with cgutils.for_range_slice(builder, ir.Constant(count.type, 0), whole, ir.Constant(count.type, LANES)) as (i, _):
            x = builder.load(builder.bitcast(builder.gep(source, [i]), half16), align=2)
            builder.store(widen(x), builder.bitcast(builder.gep(to, [i]), VF.as_pointer()), align=4)
        with cgutils.for_range_slice(builder, whole, count, ir.Constant(count.type, 1)) as (i, _):
            builder.store(widen(builder.load(builder.gep(source, [i]))), builder.gep(to, [i]))
    return targets


@intrinsic
def as_float32(typingctx, x):
    """A KV cache element as float32: float16 bits (uint16) widened, float32 as it is."""
    def codegen(context, builder, signature, args):
        if signature.args[0] == types.uint16:
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), F32)
        return args[0]

    return types.float32(x), codegen


def vector_exp(builder, module, x):
    """e^x per lane, the same range reduction and polynomial as numeric.exp."""
    floor = cgutils.get_or_insert_function(module, ir.FunctionType(VF, [VF]), "llvm.floor.v16f32")
    fma = cgutils.get_or_insert_function(module, ir.FunctionType(VF, [VF] * 3), "llvm.fma.v16f32")
    x = builder.select(builder.fcmp_ordered(">", x, const(-87.0)), x, const(-87.0))
    x = builder.select(builder.fcmp_ordered("<", x, const(88.0)), x, const(88.0))
    n = builder.call(floor, [builder.call(fma, [x, const(1.44269504), const(0.5)])])
    r = builder.fadd(builder.fsub(x, builder.fmul(n, const(0.693359375))), builder.fmul(n, const(2.12194440e-4)))
    p = const(1.9875691500e-4)
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = builder.call(fma, [p, r, const(c)])
    p = builder.fadd(builder.call(fma, [builder.fmul(p, r), r, r]), const(1.0))
    scale = builder.shl(builder.add(builder.fptosi(n, VI), ir.Constant(VI, [127] * LANES)),
                        ir.Constant(VI, [23] * LANES))
    return builder.fmul(p, builder.bitcast(scale, VF))


def prefetch(builder, base, offsets, count):
    """Ask for the cache lines of base[offset : offset + count] for each offset: a
    row's next block, fetched while this one is computed (its blocks sit anywhere in the pool,
    so the hardware's prefetchers do not see them coming)."""
    fetch = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [
        ir.IntType(8).as_pointer(), I32, I32, I32]), "llvm.prefetch.p0i8")
    line = ir.Constant(count.type, 32 if isinstance(base.type.pointee, ir.HalfType) else 16)  # elements a 64-byte line
    for offset in offsets:
        start = builder.gep(base, [offset])
        with cgutils.for_range_slice(builder, ir.Constant(count.type, 0), count, line) as (i, _):
            at = builder.bitcast(builder.gep(start, [i]), ir.IntType(8).as_pointer())
            builder.call(fetch, [at, ir.Constant(I32, 0), ir.Constant(I32, 2), ir.Constant(I32, 1)])  # to L2


def lanes_sum(builder, vectors):
    """Sixteen 16-lane vectors -> one whose lane t is the sum of vectors[t]'s lanes: four
    rounds of pairing halves, quarters, eighths and neighbours (30 shuffles and 15 adds, where
    one horizontal sum per vector would take 16 of those trees)."""
    def pair(x, y, lo, hi):
        mask_lo = ir.Constant(ir.VectorType(I32, LANES), lo)
        mask_hi = ir.Constant(ir.VectorType(I32, LANES), hi)
        return builder.fadd(builder.shuffle_vector(x, y, mask_lo), builder.shuffle_vector(x, y, mask_hi))

    for width in (8, 4, 2, 1):  # each round halves how many lanes hold one vector's partial sums
        lo = [i for i in range(LANES) if (i // width) % 2 == 0]
        hi = [i for i in range(LANES) if (i // width) % 2 == 1]
        lo, hi = lo + [LANES + i for i in lo], hi + [LANES + i for i in hi]
        vectors = [pair(vectors[i], vectors[i + 1], lo, hi) for i in range(0, len(vectors), 2)]
    return vectors[0]


def lane_sum(builder, v):
    """The sum of a vector's lanes, as a tree (an in-order reduction would chain 16 adds)."""
    width = LANES
    while width > 1:
        width //= 2
        mask = ir.Constant(ir.VectorType(I32, LANES), [(i + width) % LANES for i in range(LANES)])
        v = builder.fadd(v, builder.shuffle_vector(v, ir.Constant(VF, ir.Undefined), mask))
    return builder.extract_element(v, ir.Constant(I32, 0))
