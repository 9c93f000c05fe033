"""The CPU driver's attention over its paged KV cache, and the step layout it works from.

KV: one array per layer, kv_cache_shape(): (2 [K, V], kv_heads, num_blocks, block_size,
head_dim). Paged queries attend their own row's keys up to their own position: with the
compiled kernels every fed token is one, read in place through the block table (a row's
several tokens in tiles: glue.py, kernels/attention.py). On the plain NumPy path only decode tokens
are: each query's blocks are gathered (block_size x head_dim floats per copy) into one
contiguous context, and attention is two batched products for all queries together; prefill
chunks gather their row once and attend in causal query tiles. Never a loop over rows or
blocks in Python. Masks are additive float32 biases (0 or -inf) built once per step on the host and
shared by every layer; softmax is normalised after the value product (fewer divisions).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def kv_cache_shape(dims: dict[str, int], num_blocks: int, block_size: int) -> tuple[int, ...]:
    """One layer's paged KV cache (`dims`: a Program's): K and V, each kv head's blocks contiguous."""
    return (2, dims["kv_heads"], num_blocks, block_size, dims["head_dim"])


def rms_scale(xp, x, eps: float):
    """x / rms(x) over the features, axis 0 of a feature-major x (the norm's weight is folded
    into the next product)."""
    r = (x * x).sum(axis=0, keepdims=True)
    r *= 1.0 / x.shape[0]
    r += eps
    xp.sqrt(r, out=r)
    return x / r


def softmax_apply(xp, scores, values):
    """softmax(scores) @ values over the last axis of scores, in place on scores. Masked keys
    hold -inf; every query row has at least one valid key (its own position)."""
    scores -= scores.max(axis=-1, keepdims=True)
    xp.exp(scores, out=scores)
    den = scores.sum(axis=-1, keepdims=True)
    out = xp.matmul(scores, values)
    out /= den
    return out


@dataclass(slots=True)
class StepLayout:
    """The CPU driver's view of one step, derived from the flat StepArrays once and shared by
    every layer: which tokens attend in place and which rows go as causal chunks."""

    positions: np.ndarray  # (T,) rotary position of each fed token
    write_block: np.ndarray  # (T,) physical block each token's K/V goes to
    write_offset: np.ndarray  # (T,) slot within that block
    # Paged queries: tokens that attend their row's blocks in place (decode tokens; with the
    # compiled kernels, every token).
    paged_idx: np.ndarray  # (Q,) token index of each paged query
    paged_tables: np.ndarray  # (R, B) block table of each row they come from, padded with its first block
    paged_table_of: np.ndarray  # (Q,) which of those tables a query reads
    paged_lengths: np.ndarray  # (Q,) keys each query attends: its position + 1 (per-row length mask)
    prefills: list[tuple[int, int, int, np.ndarray, np.ndarray]]  # (first token, count, context, blocks, causal bias)
    logit_idx: np.ndarray  # token indices whose logits are returned
    all_paged: bool  # every fed token is a paged query (no scatter needed)
    block_size: int
    tokens: np.ndarray  # (T,) int64 token ids


PREFILL_TILE = 128  # query rows per attention product in a prefill chunk


def _bias(valid: np.ndarray) -> np.ndarray:
    return np.where(valid, np.float32(0), np.float32(-np.inf)).astype(np.float32)


def step_layout(step, tables: np.ndarray, paged_upto: int = 1) -> StepLayout:
    """Rows fed at most `paged_upto` tokens become paged queries; longer rows (prefill
    chunks) are attended chunk-wise with a causal mask. `step` is the driver's StepArrays,
    `tables` every open row's block table, (rows, blocks), padded with the row's first block."""
    block_size = step.block_size
    positions = step.positions.astype(np.int64)
    slots = step.kv_slots.astype(np.int64)
    counts = step.row_tokens
    short = counts <= paged_upto
    token_short = short[step.token_row]
    paged_idx = np.flatnonzero(token_short)
    paged_rows = np.flatnonzero(short)
    width = int(-(-step.seq_lens[paged_rows].max() // block_size)) if len(paged_rows) else 0
    padded = tables[step.row_ids[paged_rows], :width] if len(paged_rows) else np.empty((0, 0), np.int64)
    table_of = np.cumsum(short) - 1  # each short row's index among the paged tables
    prefills = []
    for r in np.flatnonzero(~short):
        first, n, ctx = int(step.row_first[r]), int(counts[r]), int(step.seq_lens[r])
        table = tables[int(step.row_ids[r]), : -(-ctx // block_size)]
        keys = np.arange(len(table) * block_size)
        pos = positions[first : first + n]
        prefills.append((first, n, ctx, table, _bias(keys[None, :] <= pos[:, None])))
    return StepLayout(positions, slots // block_size, slots % block_size, paged_idx.astype(np.int64),
                      np.ascontiguousarray(padded, dtype=np.int64), table_of[step.token_row[paged_idx]].astype(np.int64),
                      positions[paged_idx] + 1, prefills, step.logit_idx.astype(np.int64),
                      len(paged_idx) == step.num_tokens, block_size, step.tokens.astype(np.int64))


def paged_attention_gathered(xp, q, cache, tables, lengths):
    """The array-module path for paged queries: each query's blocks are gathered into one
    contiguous context (a copy), then two batched products for all queries together.
    q: (Q, heads, hd); tables: (Q, B) the blocks each query reads; returns (Q, heads * hd)."""
    n, heads, hd = q.shape
    kv_heads = cache.shape[1]
    kv = xp.take(cache, xp.asarray(tables), axis=2).reshape(2, kv_heads, n, -1, hd)  # (2, kvh, Q, L, hd)
    bias = xp.asarray(_bias(np.arange(kv.shape[3])[None, :] < lengths[:, None])[:, None, :])
    qd = q.reshape(n, kv_heads, heads // kv_heads, hd).transpose(1, 0, 2, 3)
    scores = xp.matmul(qd, kv[0].swapaxes(-1, -2))  # (kvh, Q, g, L)
    scores += bias
    return softmax_apply(xp, scores, kv[1]).transpose(1, 0, 2, 3).reshape(n, heads * hd)


def attention(xp, q, cache, paged, prefills, kv_heads: int, glue=None):
    """q: (T, heads, hd), pre-scaled; cache: one layer's kv_cache_shape() array.
    paged: None or (token idx, tables (R, B), table of each query, lengths (host), all_paged);
    prefills: [(first, n, context, blocks (B,), causal bias (n, B*bs))]. Returns (T, heads * hd)."""
    t, heads, hd = q.shape
    groups = heads // kv_heads
    out = None
    if paged is not None:
        idx, tables, table_of, lengths, all_paged = paged
        qp = q if all_paged else q[idx]
        if glue is not None:  # in place through the block tables, no gathered copy
            op = xp.empty((len(table_of), heads * hd), dtype=q.dtype)
            glue.paged_attention(xp.ascontiguousarray(qp), cache, tables, table_of, lengths, op, t)
        else:
            op = paged_attention_gathered(xp, qp, cache, tables[table_of], lengths)
        if all_paged:
            return op
        out = xp.empty((t, heads * hd), dtype=q.dtype)
        out[idx] = op
    if out is None:
        out = xp.empty((t, heads * hd), dtype=q.dtype)
    for first, n, ctx, blocks, bias in prefills:
        kv = xp.take(cache, blocks, axis=2).reshape(2, kv_heads, -1, hd)  # (2, kvh, L, hd)
        # Long chunks go in query tiles, each against the keys up to its last position only
        # (causal: the rest are masked anyway), which saves up to half the work.
        for i0 in range(0, n, PREFILL_TILE):
            i1 = min(n, i0 + PREFILL_TILE)
            m = i1 - i0
            keys = ctx - (n - i1)  # keys up to the tile's last position
            qp = q[first + i0 : first + i1].reshape(m, kv_heads, groups, hd).transpose(1, 2, 0, 3)
            scores = xp.matmul(qp.reshape(kv_heads, groups * m, hd), kv[0, :, :keys].swapaxes(-1, -2))
            scores.reshape(kv_heads, groups, m, keys)[...] += bias[i0:i1, :keys]
            o = softmax_apply(xp, scores, kv[1, :, :keys])  # (kvh, g * m, hd)
            out[first + i0 : first + i1] = o.reshape(kv_heads, groups, m, hd).transpose(2, 0, 1, 3).reshape(m, heads * hd)
    return out
