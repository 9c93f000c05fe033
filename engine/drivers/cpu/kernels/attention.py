"""Paged attention on the CPU: every fed token attends its own row's keys in place, block by
block through the row's block table, with an online softmax (no gathered copy, no per-row
Python loop). `paged_attention` splits the queries into tasks of one kv head each: a lone
query (decode) alone (query_task, a block at a time by attention_query.py's query_block), a
row's several consecutive tokens in tiles of up to LANES query vectors (tile_task, by
attention_tile.py's tile_block).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .attention_ir import AHEAD, LANES, as_float32
from .attention_query import query_block
from .attention_tile import tile_block
from .numeric import ERRORS, FASTMATH, exp


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
