"""Integer products on block codes (engine/models/block_codes.py): the activations quantized to
16 bits per block of 32 (quantize.py), each block's dot product computed exactly in int32 by
the CPU's integer dot product (integer_dot.py: AVX-512 VNNI's vpdpwssd, 32 products of two
16-bit words an instruction, or AVX2's vpmaddwd and vpaddd), then scaled in float32:

    out[r, t] = sum_b dx[t, b] * (d[r, b] * (u[r, b] . v[t, b]) + m'[r, b] * sum(v[t, b]))

u: the codes as unsigned bytes (a Q4_1 code as it is; a Q8_0 code plus 128, so m' = m - 128 d),
widened to words in registers; v: round(x * colscale / dx) in -LEVELS..LEVELS, dx = max |x *
colscale| / LEVELS per block, one int16 each. One byte (v in -127..127, as llama.cpp's Q8
activations) moved SmolLM2's logits by up to 7% of the largest and changed 19 of 64 greedy
continuations (12 tokens each); 16 bits, 6e-4 and none.

The tiles are integer_tile.py's, shaped for the route's registers; the codes and scales laid
out by integer_layout.py. Compiled only where the CPU has a route (products/integer.py). Every
route sums a (row, token) in the same order: the same bits on either instruction set.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .integer_tile import (
    SHAPE,
    tile_column_4,
    tile_few,
    tile_few_4,
    tile_many,
    tile_many_4,
    tile_one,
    tile_one_4,
)
from .numeric import ERRORS, FASTMATH
from .quantize import quantize_words

ROWS_PER_TASK = 32
MANY_ROWS, MANY_TOKENS = SHAPE.many  # this route's tiles (integer_tile.py)
FEW_ROWS, FEW_TOKENS = SHAPE.few
COLUMN = SHAPE.column
ONE, FEW, MANY = 0, 1, 2  # which tile _tile runs
L1_WAYS = 8  # lines a level-1 data cache set holds (8 or more on x86-64 CPUs since 2008)


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
    """Rows r0 .. r1 of the product for every token, tile by tile, into out (see make_tile
    for rs, ts and first). The tiles differ in how many sums they keep in flight, not in how a
    sum is taken: a (row, token)'s result is the same in any of them."""
    tokens = v.shape[0]
    step = MANY_ROWS if tokens >= MANY_TOKENS else FEW_ROWS if tokens >= FEW_TOKENS else 0  # rows a pass
    r = r0
    while nibbles and tokens == 1 and r + COLUMN <= r1:  # a lone token: COLUMN rows a tile
        tile_column_4(codes, d, m, v, dx, c, out, r, 0, rs, ts, first)
        r += COLUMN
    while step > 0 and r + step <= r1:  # the many-token tiles, the tokens left in few-token ones, then one by one
        t = 0
        while step == MANY_ROWS and t + MANY_TOKENS <= tokens:
            _tile(codes, d, m, dw, mw, v, dx, c, out, r, t, rs, ts, first, MANY, nibbles)
            t += MANY_TOKENS
        while t + FEW_TOKENS <= tokens:
            for rr in range(r, r + step, FEW_ROWS):
                _tile(codes, d, m, dw, mw, v, dx, c, out, rr, t, rs, ts, first, FEW, nibbles)
            t += FEW_TOKENS
        for rr in range(r, r + step):
            for tt in range(t, tokens):
                _tile(codes, d, m, dw, mw, v, dx, c, out, rr, tt, rs, ts, first, ONE, nibbles)
        r += step
    for rr in range(r, r1):  # the rows left
        for t in range(tokens):
            _tile(codes, d, m, dw, mw, v, dx, c, out, rr, t, rs, ts, first, ONE, nibbles)


@njit(inline="always", fastmath=FASTMATH, boundscheck=False, error_model=ERRORS)
def _tile(codes, d, m, dw, mw, v, dx, c, flat, r, t, rs, ts, first, which, nibbles):
    if nibbles:
        if which == MANY:
            tile_many_4(codes, dw, mw, v, dx, c, flat, r, t, rs, ts, first)
        elif which == FEW:
            tile_few_4(codes, dw, mw, v, dx, c, flat, r, t, rs, ts, first)
        else:
            tile_one_4(codes, d, m, v, dx, c, flat, r, t, rs, ts, first)
    elif which == MANY:
        tile_many(codes, dw, mw, v, dx, c, flat, r, t, rs, ts, first)
    elif which == FEW:
        tile_few(codes, dw, mw, v, dx, c, flat, r, t, rs, ts, first)
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
