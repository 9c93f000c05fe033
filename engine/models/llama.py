"""The Llama family's forward pass over paged KV, written against an array module `xp`
(numpy here; CuPy has the same API) so every backend runs this one model code.

One call computes a mixed step: prefill chunks and decode tokens of many rows, each row at
its own positions and attending only to its own valid keys (per-row length masks). Rows
that are not in the step are not computed at all: the empty-row policy is exclusion, so no
attention row is ever fully masked.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..drivers.base import RowWork
from .base import LlamaConfig


@dataclass(slots=True)
class PreparedLlama:
    """Weights laid out for the step: fused projections, contiguous, on the device."""

    embed: object
    layers: list[dict]
    norm: object
    lm_head: object
    cos: object  # (positions, head_dim) rotary tables
    sin: object


def rope_tables(config: LlamaConfig, positions: int, xp=np):
    half = config.head_dim // 2
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(half, dtype=np.float64) / half))
    angles = np.outer(np.arange(positions, dtype=np.float64), inv_freq)
    angles = np.concatenate([angles, angles], axis=1)
    return xp.asarray(np.cos(angles).astype(np.float32)), xp.asarray(np.sin(angles).astype(np.float32))


def prepare_llama(config: LlamaConfig, weights: dict[str, np.ndarray], positions: int, xp=np) -> PreparedLlama:
    def dev(a: np.ndarray):
        return xp.asarray(np.ascontiguousarray(a, dtype=np.float32))

    layers = []
    for i in range(config.num_layers):
        p = f"layers.{i}."
        layers.append({
            "attn_norm": dev(weights[p + "attn_norm"]),
            "wqkv": dev(np.concatenate([weights[p + "wq"], weights[p + "wk"], weights[p + "wv"]])),
            "wo": dev(weights[p + "wo"]),
            "mlp_norm": dev(weights[p + "mlp_norm"]),
            "w_gate_up": dev(np.concatenate([weights[p + "w_gate"], weights[p + "w_up"]])),
            "w_down": dev(weights[p + "w_down"]),
        })
    head = weights.get("lm_head", weights["embed"])
    cos, sin = rope_tables(config, positions, xp)
    return PreparedLlama(dev(weights["embed"]), layers, dev(weights["norm"]), dev(head), cos, sin)


def linear(xp, x, w):
    # W @ X.T keeps the weight as the streamed operand, which BLAS handles well for few rows.
    return (w @ x.T).T


def rms_norm(xp, x, weight, eps: float):
    var = (x * x).mean(axis=-1, keepdims=True)
    return x / xp.sqrt(var + eps) * weight


def rotate(xp, x, cos, sin):
    """x: (tokens, heads, head_dim) in the rotate_half layout; cos/sin: (tokens, head_dim)."""
    half = x.shape[-1] // 2
    rotated = xp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def softmax_masked(xp, scores, valid):
    """Softmax over the last axis, counting only valid keys. Every query row here has at
    least one valid key (its own position), so no row is all-masked."""
    scores = xp.where(valid, scores, -xp.inf)
    scores = scores - scores.max(axis=-1, keepdims=True)
    weights = xp.exp(scores)
    return weights / weights.sum(axis=-1, keepdims=True)


@dataclass(slots=True)
class StepLayout:
    """Host-side index arrays for one step, computed once and shared by every layer."""

    positions: np.ndarray  # (T,) position of each fed token
    write_slots: np.ndarray  # (T,) flat KV slot each token's K/V goes to
    decode_idx: np.ndarray  # (D,) token index of each single-token row
    decode_ctx_slots: np.ndarray  # (D, Lmax) flat slots of each decode row's context
    decode_valid: np.ndarray  # (D, Lmax) which of those are real keys (length mask)
    prefills: list[tuple[int, int, np.ndarray, np.ndarray]]  # (first token, count, ctx slots, causal mask)
    logit_idx: np.ndarray  # token indices whose logits are returned


def step_layout(batch: list[RowWork], block_size: int, shared_position: bool = False) -> StepLayout:
    positions, write_slots, logit_idx = [], [], []
    decode_rows, prefills = [], []
    offset = 0
    for work in batch:
        n = len(work.tokens)
        pos = np.arange(work.start, work.start + n)
        table = np.asarray(work.block_table, dtype=np.int64)
        slots = table[pos // block_size] * block_size + pos % block_size
        positions.append(pos)
        write_slots.append(slots)
        ctx = work.start + n
        ctx_pos = np.arange(ctx)
        ctx_slots = table[ctx_pos // block_size] * block_size + ctx_pos % block_size
        if n == 1:
            decode_rows.append((offset, ctx_slots))
        else:
            causal = ctx_pos[None, :] <= pos[:, None]
            prefills.append((offset, n, ctx_slots, causal))
        logit_idx.extend(range(offset + n - work.num_logits, offset + n))
        offset += n
    positions = np.concatenate(positions)
    if shared_position:  # deliberately wrong: used by the mutation test that proves positions matter
        positions = np.full_like(positions, positions.max())
    lmax = max((len(s) for _, s in decode_rows), default=0)
    d_slots = np.zeros((len(decode_rows), lmax), dtype=np.int64)
    d_valid = np.zeros((len(decode_rows), lmax), dtype=bool)
    for i, (_, s) in enumerate(decode_rows):
        d_slots[i, : len(s)] = s
        d_valid[i, : len(s)] = True
    return StepLayout(positions, np.concatenate(write_slots), np.array([o for o, _ in decode_rows], dtype=np.int64),
                      d_slots, d_valid, prefills, np.array(logit_idx, dtype=np.int64))


def attention(xp, q, k_cache, v_cache, layout: StepLayout, groups: int, mask_lengths: bool = True):
    """q: (T, heads, hd); caches: (slots, kv_heads, hd). Returns (T, heads, hd)."""
    t, heads, hd = q.shape
    kvh = heads // groups
    scale = 1.0 / np.sqrt(hd)
    out = xp.empty_like(q)
    if len(layout.decode_idx):
        # All single-token rows in one batched product over their padded contexts.
        d = len(layout.decode_idx)
        qd = q[layout.decode_idx].reshape(d, kvh, groups, hd)
        slots = xp.asarray(layout.decode_ctx_slots)
        k = k_cache[slots]  # (D, Lmax, kvh, hd)
        v = v_cache[slots]
        scores = xp.matmul(qd, k.transpose(0, 2, 3, 1)) * scale  # (D, kvh, g, Lmax)
        valid = xp.asarray(layout.decode_valid if mask_lengths else np.ones_like(layout.decode_valid))
        w = softmax_masked(xp, scores, valid[:, None, None, :])
        out[layout.decode_idx] = xp.matmul(w, v.transpose(0, 2, 1, 3)).reshape(d, heads, hd)
    for first, n, ctx_slots, causal in layout.prefills:
        qp = q[first : first + n].reshape(n, kvh, groups, hd).transpose(1, 2, 0, 3)  # (kvh, g, n, hd)
        slots = xp.asarray(ctx_slots)
        k = k_cache[slots].transpose(1, 2, 0)  # (kvh, hd, ctx)
        v = v_cache[slots].transpose(1, 0, 2)  # (kvh, ctx, hd)
        scores = xp.matmul(qp, k[:, None]) * scale  # (kvh, g, n, ctx)
        w = softmax_masked(xp, scores, xp.asarray(causal)[None, None])
        out[first : first + n] = xp.matmul(w, v[:, None]).transpose(2, 0, 1, 3).reshape(n, heads, hd)
    return out


def forward(xp, config: LlamaConfig, model: PreparedLlama, kv: list[tuple[object, object]],
            tokens, layout: StepLayout, mask_lengths: bool = True):
    """Runs one step; writes each fed token's K/V into the paged caches; returns logits
    (len(layout.logit_idx), vocab) as float32 on the device."""
    heads, kvh, hd = config.num_heads, config.num_kv_heads, config.head_dim
    q_size, kv_size = heads * hd, kvh * hd
    x = model.embed[tokens]
    pos = xp.asarray(layout.positions)
    cos, sin = model.cos[pos], model.sin[pos]
    write = xp.asarray(layout.write_slots)
    t = x.shape[0]
    for layer, (k_cache, v_cache) in zip(model.layers, kv, strict=True):
        h = rms_norm(xp, x, layer["attn_norm"], config.rms_eps)
        qkv = linear(xp, h, layer["wqkv"])
        q = rotate(xp, qkv[:, :q_size].reshape(t, heads, hd), cos, sin)
        k = rotate(xp, qkv[:, q_size : q_size + kv_size].reshape(t, kvh, hd), cos, sin)
        k_cache[write] = k
        v_cache[write] = qkv[:, q_size + kv_size :].reshape(t, kvh, hd)
        a = attention(xp, q, k_cache, v_cache, layout, heads // kvh, mask_lengths)
        x = x + linear(xp, a.reshape(t, q_size), layer["wo"])
        h = rms_norm(xp, x, layer["mlp_norm"], config.rms_eps)
        gate_up = linear(xp, h, layer["w_gate_up"])
        inter = gate_up.shape[1] // 2
        gate = gate_up[:, :inter]
        act = gate / (1.0 + xp.exp(-gate)) * gate_up[:, inter:]
        x = x + linear(xp, act, layer["w_down"])
    h = rms_norm(xp, x[xp.asarray(layout.logit_idx)], model.norm, config.rms_eps)
    return linear(xp, h, model.lm_head).astype(xp.float32)
