"""The integer kernel's inner loop as LLVM IR (`tile`), on this process's dot product
(integer_dot.py: AVX-512 VNNI or AVX2).

Why not numba alone: LLVM vectorizes a long int8 reduction into VNNI but left the per-block
one (32 terms, then a float scale) scalar, at a quarter of the float kernel's speed. So the
inner loop is written here as LLVM IR: for a tile of rows by tokens it keeps one 16-lane float
accumulator per (row, token), over codes and activations in the kernel's own order
(integer_layout.py). No horizontal sum happens until the end of the row. A (row, token)'s sum is
computed in the same order whatever the tile or the token count, so a token's result does not
depend on what else is in the step.
"""

from __future__ import annotations

from typing import NamedTuple

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import integer_dot
from .integer_layout import BLOCK, GROUP


class Shapes(NamedTuple):
    """The tiles a route's kernel takes: `many` (rows, tokens) from many[1] tokens, `few` for
    fewer and for the tokens left over (few[0] divides many[0]), one (row, token) at a time for
    the rest; a lone token's 4-bit rows `column` at a time; `chains`: independent sums a lone
    (row, token) keeps in flight (a dot product's latency over its throughput); `rolled`: a
    run's chunks as a loop, else written out one after another."""

    many: tuple[int, int]
    few: tuple[int, int]
    column: int
    chains: int
    rolled: bool


SHAPES = {
    # Measured on SmolLM2's shapes (2-core Zen 4, products of 1-24 tokens interleaved in one
    # run): 4 x 4 tiles from four tokens (16 sums, 4 rows' codes and a token's within the 32
    # vector registers), 2 x 2 for two or three and the tokens left over; 4 x 4 tiles reach
    # 90-100 G multiply-adds/s on the two cores. A lone token takes 4-bit rows two at a time:
    # one row's sum is a chain of dependent steps (dot products, scale, horizontal sum) that
    # left the core idle between rows; two in flight ran a one-token product 2.3x faster with
    # the codes in cache (576 x 576 on one thread: 10.9 against 25.2 us), a step's 120 layer
    # products out of cache 1.03-1.1x faster (separate processes, alternated). Four rows: no
    # faster. Byte codes (a Q8_0 head) stay one row a tile: two were slower there (1.10
    # against 0.75 ms for SmolLM2's head).
    "vpdpwssd": Shapes(many=(4, 4), few=(2, 2), column=2, chains=4, rolled=False),
    # AVX2 has 16 vector registers of 256 bits: a (row, token)'s int32 sums take two, its float
    # accumulator two. So one row a tile, its codes unpacked once for the tile's tokens, the
    # tokens' activations read from memory by vpmaddwd itself. Measured on SmolLM2's three
    # layer shapes (ten matrices each, one thread's CPU time, the least of 9 rounds, the tiles
    # interleaved in one process; a 2-core Xeon, AVX-512 off): 1 x 4 from four tokens and
    # 1 x 3 below ran as fast as 1 x 6 with 1 x 2 or 1 x 3 at 6-32 tokens and 1.1-1.3x faster
    # at 3-5 (30 QKV products at 3 tokens: 1.65 against 2.04 ms with 1 x 2 and a 1 x 1 tile);
    # an earlier run had 1 x 4 and 1 x 6 at 1.05-1.2x the speed of 2 x 2, 2 x 3, 2 x 4 and of
    # VNNI's own 4 x 4 and 2 x 2, which spilled 11 vectors to the stack per sum and chunk. The
    # chunks as a loop: 1.03-1.10x faster than written out (LLVM had hoisted the unpacking of
    # later chunks and spilled it). vpaddd, the only dependent step, takes a cycle: one chain.
    "vpmaddwd": Shapes(many=(1, 4), few=(1, 3), column=2, chains=1, rolled=True),
}
ROUTE = integer_dot.route()  # this process's (None: no integer products here; nothing compiles them)
SHAPE = SHAPES[ROUTE or "vpdpwssd"]
# Codes are asked for this many rows ahead of the tile, into L2 (llvm.prefetch locality 2): 16
# rows into L1 ran a step's one-token products in 3.55-3.75 ms, 32 into L2 in 3.18-3.31 (48 and
# 64: no better); 48 or 128 rows into L1 were 1.5x slower (L1 holds 32 KiB, fewer lines than that).
PREFETCH_ROWS = 32

_I32, _F32 = ir.IntType(32), ir.FloatType()
_I8P = ir.IntType(8).as_pointer()
_V32B = ir.VectorType(ir.IntType(8), 32)
_V16I, _V16F = ir.VectorType(_I32, 16), ir.VectorType(_F32, 16)
_V32W = ir.VectorType(ir.IntType(16), 32)


def make_tile(rows: int, tokens: int, nibbles: bool, lane_weights: bool, route: str | None, shape: Shapes):
    """An intrinsic adding a rows x tokens tile's products to out: for each (r, t) of the tile,
    out[(r0 + r - first) * rs + (t0 + t) * ts] += sum over blocks of d dx (u . v) + m' c, codes and
    activations in kernel order (see `kernel_order`), dx and c in lane layout (lane_scales).
    `first`: the product's row that out's row 0 holds (0, or a task's first row when it
    writes a scratch of its own). `nibbles`: the codes are 4-bit, two a byte (pack_nibbles),
    unpacked in registers. `lane_weights`: d and m in lane layout too (several tokens' tiles,
    where each run's scales serve many products); else as the file has them, a block a
    scale (a lone token's tiles, which bandwidth bounds: fewer bytes). The same values in the
    same lanes either way, so a sum's result does not depend on which tile took it. `route`:
    the dot product (integer_dot.py); `shape`: its chains and whether its chunks loop."""
    group = GROUP
    chains = max(1, shape.chains // (rows * tokens))  # independent sums a tile keeps in flight
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
            dot = integer_dot.emitter(builder, route)
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

            def products(chunk, j, sums):
                """sums, each (row, token)'s, plus its products over chunk `chunk` (the j-th of its run)."""
                for c in code_rows if prefetching else ():  # the rows a few tiles on, at the same place
                    where = builder.gep(c, [builder.add(builder.mul(chunk, chunk_bytes), ahead)])
                    builder.call(prefetch, [where, ir.Constant(_I32, 0), ir.Constant(_I32, 2), ir.Constant(_I32, 1)])
                u = [codes_at(c, chunk) for c in code_rows]
                sums = [[list(chained) for chained in by_token] for by_token in sums]
                for t in range(tokens):
                    a = activations_at(v_rows[t], chunk)
                    for r in range(rows):
                        for half_ in range(2):
                            chain = (2 * j + half_) % chains
                            sums[r][t][chain] = dot(sums[r][t][chain], u[r][half_], a[half_])
                return sums

            def store(sums, cells):
                for by_row, cell_row in zip(sums, cells, strict=True):
                    for by_token, cell_token in zip(by_row, cell_row, strict=True):
                        for value, cell in zip(by_token, cell_token, strict=True):
                            builder.store(value, cell)

            def load(cells):
                return [[[builder.load(cell) for cell in by_token] for by_token in by_row] for by_row in cells]

            def span(count, first_block, first_chunk, first_run, size):
                """`count` runs of `size` blocks from block first_block (chunk first_chunk, run
                first_run): each run's products summed exactly in int32, then scaled once."""
                with cgutils.for_range(builder, count) as loop:
                    k = loop.index
                    chunk0 = builder.add(first_chunk, builder.mul(k, ir.Constant(k.type, size // 2)))
                    block0 = builder.add(first_block, builder.mul(k, ir.Constant(k.type, size)))
                    lane0 = builder.mul(builder.add(first_run, k), ir.Constant(k.type, 16))
                    sums = [[[zero] * chains for _ in range(tokens)] for _ in range(rows)]
                    if shape.rolled:  # sums kept in stack slots, which LLVM lifts into registers
                        cells = [[[cgutils.alloca_once(builder, _V16I) for _ in range(chains)] for _ in range(tokens)]
                                 for _ in range(rows)]
                        store(sums, cells)
                        with cgutils.for_range(builder, ir.Constant(k.type, size // 2)) as inner:
                            store(products(builder.add(chunk0, inner.index), 0, load(cells)), cells)
                        sums = load(cells)
                    else:
                        for j in range(size // 2):
                            sums = products(at(j, chunk0), j, sums)
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



def _tiles(rows: int, tokens: int, lane_weights: bool = True):
    """The tile for byte codes and for 4-bit ones, on this process's route."""
    return tuple(make_tile(rows, tokens, nibbles, lane_weights, ROUTE, SHAPE) for nibbles in (False, True))


tile_many, tile_many_4 = _tiles(*SHAPE.many)
tile_few, tile_few_4 = _tiles(*SHAPE.few)
tile_one, tile_one_4 = _tiles(1, 1, lane_weights=False)
tile_column_4 = make_tile(SHAPE.column, 1, True, False, ROUTE, SHAPE)
