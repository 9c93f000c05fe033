"""The Llama family's forward pass over paged KV, written against an array module `xp`
(numpy here; CuPy has the same API) so every backend runs this one model code.

One call computes a mixed step: prefill chunks and decode tokens of many rows, each row at
its own positions and attending only to its own valid keys (per-row length masks). Rows
that are not in the step are not computed at all: the empty-row policy is exclusion, so no
attention row is ever fully masked.

Layout, chosen for throughput on a BLAS:
- Weights: Q/K/V fused and gate/up fused, each RMSNorm weight folded into the columns of the
  projection that follows it, and 1/sqrt(head_dim) folded into the Q rows.
- Activations are feature-major, (features, tokens), between the products: every product is
  `W @ X` with both operands contiguous and the weight the streamed operand (one pass over
  it per step, whatever the rows; the layout BLAS handles well for few rows), and gate/up,
  Q/K/V come out as contiguous blocks. Only attention works token-major.
- Rotary: the Q and K rows of each head are stored with the rotate_half pairs (j, j + hd/2)
  adjacent, so rotating is one complex multiply by e^(i pos theta) in place. Q and K are
  permuted alike, so every q.k (and so attention) is unchanged; the cache holds K permuted.
- KV: one array per layer, kv_cache_shape(): (2 [K, V], kv_heads, num_blocks, block_size,
  head_dim). Decode tokens, and the tokens of short rows (speculative verification), are
  paged queries: each attends its own row's keys up to its own position. With the CPU
  driver's kernels they are read in place through the block table; on the plain array-module
  path each query's blocks are gathered (block_size x head_dim floats per copy) into one
  contiguous context, and attention is two batched products for all queries together.
  Prefill chunks gather their row once and attend in causal query tiles. Never a loop over
  rows or blocks in Python.
- Masks are additive float32 biases (0 or -inf) built once per step on the host and shared
  by every layer; softmax is normalised after the value product (fewer divisions).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .base import LlamaConfig


@dataclass(slots=True)
class PreparedLlama:
    """Weights laid out for the step: fused projections, norms folded, contiguous, on the device."""

    embed: object
    layers: list[dict]
    norm: object  # the final norm (not folded: the output head is tied to the embedding)
    lm_head: object
    rope: object  # (positions, head_dim // 2) complex64: e^(i pos theta_j)


def kv_cache_shape(config: LlamaConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """One layer's paged KV cache: K and V, each kv head's blocks contiguous."""
    return (2, config.num_kv_heads, num_blocks, block_size, config.head_dim)


def rope_table(config: LlamaConfig, positions: int, xp=np):
    half = config.head_dim // 2
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(half, dtype=np.float64) / half))
    angles = np.outer(np.arange(positions, dtype=np.float64), inv_freq)
    return xp.asarray(np.exp(1j * angles).astype(np.complex64))


def pair_rows(w: np.ndarray, heads: int, head_dim: int) -> np.ndarray:
    """Reorders each head's rows from the rotate_half layout (x_j and x_{j+hd/2} apart) to
    adjacent pairs (x_j, x_{j+hd/2}), the real and imaginary parts of one complex number."""
    half = head_dim // 2
    order = np.stack([np.arange(half), np.arange(half) + half], axis=1).reshape(-1)
    return w.reshape(heads, head_dim, -1)[:, order].reshape(heads * head_dim, -1)


def prepare_llama(config: LlamaConfig, weights: dict[str, np.ndarray], positions: int, xp=np) -> PreparedLlama:
    def dev(a: np.ndarray):
        return xp.asarray(np.ascontiguousarray(a, dtype=np.float32))

    def folded(w: np.ndarray, norm: np.ndarray) -> np.ndarray:
        # W @ (x * norm) == (W * norm) @ x: the norm's weight multiplies the columns.
        return np.asarray(w, dtype=np.float64) * np.asarray(norm, dtype=np.float64)[None, :]

    scale = 1.0 / np.sqrt(config.head_dim)
    layers = []
    for i in range(config.num_layers):
        p = f"layers.{i}."
        attn_norm, mlp_norm = weights[p + "attn_norm"], weights[p + "mlp_norm"]
        wq = np.asarray(weights[p + "wq"], dtype=np.float64) * scale  # scores come out pre-scaled
        wq = pair_rows(wq, config.num_heads, config.head_dim)
        wk = pair_rows(np.asarray(weights[p + "wk"]), config.num_kv_heads, config.head_dim)
        layers.append({
            "wqkv": dev(folded(np.concatenate([wq, wk, weights[p + "wv"]]), attn_norm)),
            "wo": dev(weights[p + "wo"]),
            "w_gate_up": dev(folded(np.concatenate([weights[p + "w_gate"], weights[p + "w_up"]]), mlp_norm)),
            "w_down": dev(weights[p + "w_down"]),
        })
    head = weights.get("lm_head", weights["embed"])
    return PreparedLlama(dev(weights["embed"]), layers, dev(weights["norm"]), dev(head),
                         rope_table(config, positions, xp))


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
    # Paged queries: tokens that attend their row's blocks in place, one query at a time
    # (decode tokens, and the tokens of short rows such as speculative verification).
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


def attention(xp, q, cache, paged, prefills, kv_heads: int, kernels=None):
    """q: (T, heads, hd), pre-scaled; cache: one layer's kv_cache_shape() array.
    paged: None or (token idx, tables (R, B), table of each query, lengths (host), all_paged);
    prefills: [(first, n, context, blocks (B,), causal bias (n, B*bs))]. Returns (T, heads * hd)."""
    t, heads, hd = q.shape
    groups = heads // kv_heads
    out = None
    if paged is not None:
        idx, tables, table_of, lengths, all_paged = paged
        qp = q if all_paged else q[idx]
        if kernels is not None:  # in place through the block tables, no gathered copy
            op = xp.empty((len(table_of), heads * hd), dtype=q.dtype)
            kernels.paged_attention(xp.ascontiguousarray(qp), cache, tables, table_of, lengths, op, t)
        else:
            op = paged_attention_gathered(xp, qp, cache, tables[table_of], lengths)
        if all_paged:
            return op
        out = xp.empty((t, heads * hd), dtype=q.dtype)
        out[idx] = op
    if out is None:
        out = xp.empty((t, heads * hd), dtype=q.dtype)
    bmm = kernels.batched_matmul if kernels is not None else xp.matmul
    for first, n, ctx, blocks, bias in prefills:
        kv = xp.take(cache, blocks, axis=2).reshape(2, kv_heads, -1, hd)  # (2, kvh, L, hd)
        # Long chunks go in query tiles, each against the keys up to its last position only
        # (causal: the rest are masked anyway), which saves up to half the work.
        for i0 in range(0, n, PREFILL_TILE):
            i1 = min(n, i0 + PREFILL_TILE)
            m = i1 - i0
            keys = ctx - (n - i1)  # keys up to the tile's last position
            qp = q[first + i0 : first + i1].reshape(m, kv_heads, groups, hd).transpose(1, 2, 0, 3)
            scores = bmm(qp.reshape(kv_heads, groups * m, hd), kv[0, :, :keys].swapaxes(-1, -2))
            if kernels is not None:  # the causal mask is implied by each query's position
                inv = kernels.causal_softmax(scores, m)
                o = bmm(scores, kv[1, :, :keys])
                o *= inv[..., None]
            else:
                scores.reshape(kv_heads, groups, m, keys)[...] += bias[i0:i1, :keys]
                o = softmax_apply(xp, scores, kv[1, :, :keys])  # (kvh, g * m, hd)
            out[first + i0 : first + i1] = o.reshape(kv_heads, groups, m, hd).transpose(2, 0, 1, 3).reshape(m, heads * hd)
    return out


def forward(ops, model: PreparedLlama, step):
    """One step of the family, on any backend: `ops` supplies the operations (its device's
    arrays, its KV layout) and `step` is whatever the backend made of the step's flat arrays.
    Each fed token's K/V is written into the layer's cache; returns the logits of the
    step's logit indices (or, from a backend that picks tokens, its ids).

    Between the products the activations are in whichever layout the backend chose; the
    loop only passes them along. Norm weights are folded into the next product (so
    `rms_scale` only divides by the RMS) and the residual adds are the products' own."""
    x = ops.embed(model, step)
    for i, layer in enumerate(model.layers):
        q = ops.rope_store(ops.matmul(layer["wqkv"], ops.rms_scale(x)), i, step)
        ops.matmul_add(layer["wo"], ops.attention(q, i, step), x)
        ops.matmul_add(layer["w_down"], ops.silu_mul(ops.matmul(layer["w_gate_up"], ops.rms_scale(x))), x)
    return ops.logits(model, x, step)


class ArrayOps:
    """The operations on an array module (NumPy; CuPy has the same API). Activations are
    feature-major, (features, tokens); attention works token-major and hands its output
    back transposed (a view) for the next product."""

    def __init__(self, xp, config: LlamaConfig, kv: list):
        self.xp, self.config, self.kv = xp, config, kv

    def embed(self, model: PreparedLlama, step: StepLayout):
        xp = self.xp
        self._rope = model.rope[xp.asarray(step.positions)][:, None, :]  # (T, 1, hd / 2)
        self._blk, self._off = xp.asarray(step.write_block), xp.asarray(step.write_offset)
        self._paged = None
        if len(step.paged_idx):
            self._paged = (xp.asarray(step.paged_idx), step.paged_tables, step.paged_table_of, step.paged_lengths,
                           step.all_paged)
        self._prefills = [(first, n, ctx, xp.asarray(blocks), xp.asarray(bias))
                          for first, n, ctx, blocks, bias in step.prefills]
        return xp.ascontiguousarray(model.embed[xp.asarray(step.tokens)].T)  # (hidden, T): feature-major

    def rms_scale(self, x):
        return rms_scale(self.xp, x, self.config.rms_eps)

    def matmul(self, w, x):
        return self.xp.matmul(w, x)

    def matmul_add(self, w, x, out):
        out += self.xp.matmul(w, x)

    def rope_store(self, qkv, layer: int, step: StepLayout):
        xp, c = self.xp, self.config
        heads, kvh, hd = c.num_heads, c.num_kv_heads, c.head_dim
        q_size, kv_size = heads * hd, kvh * hd
        t = qkv.shape[1]
        cache = self.kv[layer]
        qk = xp.ascontiguousarray(qkv[: q_size + kv_size].T)  # (T, q + kv): token-major for attention
        qk.view(xp.complex64).reshape(t, heads + kvh, hd // 2)[...] *= self._rope  # rotary, in place
        qk = qk.reshape(t, heads + kvh, hd)
        cache[0][:, self._blk, self._off] = qk[:, heads:].transpose(1, 0, 2)
        cache[1][:, self._blk, self._off] = qkv[q_size + kv_size :].reshape(kvh, hd, t).transpose(0, 2, 1)
        return qk[:, :heads]

    def attention(self, q, layer: int, step: StepLayout):
        a = attention(self.xp, q, self.kv[layer], self._paged, self._prefills, self.config.num_kv_heads)
        return a.T  # (heads * hd, T) for the output product

    def silu_mul(self, gate_up):
        xp = self.xp
        inter = self.config.intermediate_size
        gate = gate_up[:inter]
        act = xp.negative(gate)
        xp.exp(act, out=act)
        act += 1.0
        xp.divide(gate, act, out=act)  # silu(gate)
        act *= gate_up[inter:]
        return act

    def logits(self, model: PreparedLlama, x, step: StepLayout):
        xp = self.xp
        h = rms_scale(xp, x[:, xp.asarray(step.logit_idx)], self.config.rms_eps) * model.norm[:, None]
        return xp.matmul(model.lm_head, h).T


class KernelOps(ArrayOps):
    """The operations on the CPU driver's compiled kernels (cpu_kernels.Kernels): the glue
    between products (norms, rotary with the KV write, SiLU) is one compiled call each
    instead of a handful of NumPy passes (most of what a one-row step spent outside its
    products, and a sixth of a long prompt's step), split across threads when the step has
    many tokens; few-token products and paged attention in place are the kernels' own."""

    def __init__(self, config: LlamaConfig, kv: list, kernels):
        super().__init__(np, config, kv)
        self.kernels = kernels

    def embed(self, model: PreparedLlama, step: StepLayout):
        self._rope_f = model.rope.view(np.float32)[step.positions]  # (T, hd): cos, sin interleaved
        self._step = step
        x = super().embed(model, step)
        return x

    def rms_scale(self, x):
        return self.kernels.rms_scale(x, self.config.rms_eps)

    def matmul(self, w, x):
        return self.kernels.matmul(w, x)

    def matmul_add(self, w, x, out):
        self.kernels.matmul_add(w, x, out)  # the residual add, in place

    def rope_store(self, qkv, layer: int, step: StepLayout):
        return self.kernels.rope_store(qkv, self._rope_f, step.write_block, step.write_offset, self.kv[layer],
                                       self.config.num_heads)

    def attention(self, q, layer: int, step: StepLayout):
        return attention(np, q, self.kv[layer], self._paged, self._prefills, self.config.num_kv_heads,
                         self.kernels).T

    def silu_mul(self, gate_up):
        return self.kernels.silu_mul(gate_up)

    def logits(self, model: PreparedLlama, x, step: StepLayout):
        h = self.kernels.rms_scale(np.ascontiguousarray(x[:, step.logit_idx]), self.config.rms_eps) * model.norm[:, None]
        return self.kernels.head(model.lm_head, h)  # (logits, vocab), token-major as returned
