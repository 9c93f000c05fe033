"""NumPy references of the CUDA kernels (kernels.cu, pick.cu): the same indexing, masks,
layouts and stores, in float32, with the same rounding where a kernel stores a 16-bit
value. Sums a kernel reduces in parallel are summed here in NumPy's order (equal to within
float32 rounding), except the pick's, which repeat the kernel's order exactly.

16-bit arrays: fp16 as np.float16; bf16 as np.uint16 words (the model's raw bf16 bits),
named by `wtype` ("f16" or "bf16"), the suffix of the kernel's name.
"""

from __future__ import annotations

import numpy as np

from ...random_stream import philox4x32

PICK_THREADS = 1024
ATT_WARPS = 4


def bf16_to_f32(words: np.ndarray) -> np.ndarray:
    return (np.asarray(words, np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round to nearest even, as __float2bfloat16_rn (NaN aside)."""
    b = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((b + np.uint32(0x7FFF) + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def to_w(x: np.ndarray, wtype: str) -> np.ndarray:
    """float32 -> the stored 16-bit type."""
    return np.asarray(x, np.float32).astype(np.float16) if wtype == "f16" else f32_to_bf16(x)


def w_to_f32(a: np.ndarray) -> np.ndarray:
    return bf16_to_f32(a) if a.dtype == np.uint16 else np.asarray(a, np.float32)


def wtype_of(a: np.ndarray) -> str:
    return "bf16" if a.dtype == np.uint16 else "f16"


def embed(table: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """x (T, D) float32."""
    return w_to_f32(table[tokens])


def rms_norm(x: np.ndarray, eps: float, wtype: str, rows=None, weight=None) -> np.ndarray:
    """h[i] = x[src] * rsqrt(mean(x[src]^2) + eps) (* weight) in W; src = rows[i] or i."""
    xs = x if rows is None else x[rows]
    r = np.float32(1.0) / np.sqrt((xs * xs).sum(axis=1, dtype=np.float32) / np.float32(x.shape[1]) + np.float32(eps))
    h = xs * r[:, None]
    if weight is not None:
        h = h * w_to_f32(weight)
    return to_w(h, wtype)


def rope_kv_write(qkv, rope, positions, kv_slots, k_cache, v_cache, heads: int, kv_heads: int, head_dim: int):
    """q_out (T, heads head_dim) float32; writes K (rotated) and V into the caches (num_slots,
    kv_heads, head_dim) in place at each token's slot (negative: not written). rope
    (positions, head_dim / 2, 2): cos, sin."""
    t, half = len(positions), head_dim // 2
    pairs = qkv.reshape(t, heads + 2 * kv_heads, half, 2)
    cs = rope[positions][:, None]  # (T, 1, half, 2)
    a, b, c, s = pairs[..., 0], pairs[..., 1], cs[..., 0], cs[..., 1]
    rot = np.stack([a * c - b * s, a * s + b * c], axis=-1).astype(np.float32)
    ok = kv_slots >= 0
    k_cache[kv_slots[ok]] = to_w(rot[ok, heads : heads + kv_heads].reshape(-1, kv_heads, head_dim), wtype_of(k_cache))
    v_cache[kv_slots[ok]] = to_w(pairs[ok, heads + kv_heads :].reshape(-1, kv_heads, head_dim), wtype_of(v_cache))
    return rot[:, :heads].reshape(t, heads * head_dim)


def paged_attention(q, k_cache, v_cache, positions, row_slot, tables, heads: int, kv_heads: int, head_dim: int,
                    block_size: int) -> np.ndarray:
    """out (T, heads head_dim) in W: each token's query heads over keys 0..position of its
    row, read through tables[row_slot[t]]."""
    t_count = len(positions)
    group = heads // kv_heads
    out = np.zeros((t_count, heads, head_dim), np.float32)
    qh = q.reshape(t_count, heads, head_dim)
    kf, vf = w_to_f32(k_cache), w_to_f32(v_cache)
    for t in range(t_count):
        k = np.arange(positions[t] + 1)
        slots = tables[row_slot[t], k // block_size].astype(np.int64) * block_size + k % block_size
        for h in range(heads):
            keys, values = kf[slots, h // group], vf[slots, h // group]
            s = keys @ qh[t, h]
            e = np.exp(s - s.max())
            out[t, h] = (e @ values) / e.sum()
    return to_w(out.reshape(t_count, heads * head_dim), wtype_of(k_cache))


def silu_mul(gu: np.ndarray, wtype: str) -> np.ndarray:
    inter = gu.shape[1] // 2
    g = gu[:, :inter]
    return to_w(g / (np.float32(1) + np.exp(-g)) * gu[:, inter:], wtype)


def add(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    return x + y


# ---- pick ---------------------------------------------------------------------------------------


def pick_uniform(words: np.ndarray) -> np.ndarray:
    """(L,) float32: each row's uniform, Philox of counter (k, 0, choice, 0), key (lo, hi)."""
    w = words.astype(np.uint64)
    zero = np.zeros(len(w), np.uint64)
    word = philox4x32((w[:, 4], zero, w[:, 3], zero), (w[:, 1], w[:, 2]))[0]
    return (word >> np.uint64(8)).astype(np.float32) * np.float32(1 / 16777216)


def _chunks(a: np.ndarray) -> np.ndarray:
    """(PICK_THREADS, chunk): thread j's ids, padded with zeros (which add nothing)."""
    chunk = -(-len(a) // PICK_THREADS)
    out = np.zeros(PICK_THREADS * chunk, a.dtype)
    out[: len(a)] = a
    return out.reshape(PICK_THREADS, chunk)


def _thread_sums(a: np.ndarray) -> np.ndarray:
    """Each thread's float32 sum of its chunk, in id order."""
    return np.cumsum(_chunks(a), axis=1, dtype=np.float32)[:, -1]


def _tree_sum(parts: np.ndarray) -> np.float32:
    red = parts.astype(np.float32).copy()
    s = PICK_THREADS // 2
    while s:
        red[:s] += red[s : 2 * s]
        s //= 2
    return red[0]


def order_key(x: np.ndarray) -> np.ndarray:
    b = np.ascontiguousarray(x, np.float32).view(np.uint32).copy()
    b[b == 0x80000000] = 0
    return np.where(b & 0x80000000, ~b, b | 0x80000000).astype(np.uint32)


def pick_row(z: np.ndarray, w: np.ndarray, u: np.float32) -> tuple[int, np.ndarray]:
    """One row's picked token and the row as the kernel leaves it (weights when sampled)."""
    z = np.asarray(z, np.float32).copy()
    vocab = len(z)
    if w[0] == 0:
        return -1, z
    if w[0] == 1:
        return int(np.argmax(z)), z
    temperature, top_p = (np.array([w[5], w[7]], np.uint32).view(np.float32))
    top_k = int(w[6])
    top = z.max()
    keys = order_key(z)
    kth = np.uint32(0)
    if 0 < top_k < vocab:
        kth = np.partition(keys, -top_k)[-top_k]
    e = np.where(keys >= kth, np.exp((z - top) / temperature), np.float32(0)).astype(np.float32)
    total = _tree_sum(_thread_sums(e))
    bits = e.view(np.uint32)
    cut = 0
    if top_p < 1:
        need = np.float32(top_p * total)
        at_t, at_up = vocab, 0
        for b in range(2, 32):
            cand = cut | (0x80000000 >> b)
            sel = bits >= cand
            got = _tree_sum(_thread_sums(np.where(sel, e, np.float32(0))))
            if got >= need:
                cut, at_t = cand, int(sel.sum())
            else:
                at_up = int(sel.sum())
            if at_t - at_up == 1:
                break
    kept = np.where((e > 0) & (bits >= cut), e, np.float32(0))
    parts = _thread_sums(kept)
    before = np.concatenate([[np.float32(0)], np.cumsum(parts, dtype=np.float32)])
    goal = np.float32(u * before[-1])
    chunks = _chunks(kept)
    for j in np.flatnonzero(parts > 0):
        if before[j] <= goal < np.float32(before[j] + parts[j]):
            run = np.cumsum(np.concatenate([[before[j]], chunks[j]]), dtype=np.float32)[1:]
            live = np.flatnonzero((chunks[j] > 0) & (run > goal))
            ids = np.flatnonzero(chunks[j] > 0)
            return j * chunks.shape[1] + int(live[0] if len(live) else ids[-1]), e
    return int(np.flatnonzero(kept)[-1]), e


def pick(logits: np.ndarray, words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ids (L,) int32 and the logits as the kernel leaves them."""
    u = pick_uniform(words)
    out = np.asarray(logits, np.float32).copy()
    ids = np.empty(len(words), np.int32)
    for i in range(len(words)):
        ids[i], out[i] = pick_row(logits[i], words[i], u[i])
    return ids, out


# ---- Mamba (mamba.cu) ---------------------------------------------------------------------------


def _window(xz, conv_state, slot: int, first: int, n: int, d_inner: int) -> np.ndarray:
    """[the slot's last d_conv - 1 inputs, the segment's inputs], (d_conv - 1 + n, d_inner)."""
    return np.concatenate([conv_state[slot], xz[first : first + n, :d_inner]])


def mamba_conv(xz, token_row, row_ids, row_first, row_tokens, conv_w, conv_b, conv_state, wtype: str):
    """xs (T, d_inner) float32 and its W copy: SiLU of the causal depthwise convolution.
    Token t (index li in its segment) reads window[li + j] of its row's window."""
    d_inner, d_conv = conv_w.shape
    xs = np.zeros((len(token_row), d_inner), np.float32)
    windows = [_window(xz, conv_state, s, f, n, d_inner) for s, f, n in zip(row_ids, row_first, row_tokens, strict=True)]
    for t, r in enumerate(token_row):
        li = t - row_first[r]
        acc = conv_b.astype(np.float32)
        for j in range(d_conv):
            acc = acc + windows[r][li + j] * conv_w[:, j]
        xs[t] = acc / (np.float32(1) + np.exp(-acc))
    return xs, to_w(xs, wtype)


def mamba_conv_state(xz, row_ids, row_first, row_tokens, conv_state) -> None:
    """Each row's slot <- its last d_conv - 1 inputs (in place)."""
    for slot, first, n in zip(row_ids, row_first, row_tokens, strict=True):
        conv_state[slot] = _window(xz, conv_state, slot, first, n, conv_state.shape[2])[n:]


def mamba_scan(xs, dbc, dtr, xz, row_ids, row_first, row_tokens, dt_bias, a, d_skip, ssm_state, dt_rank: int,
               wtype: str):
    """y (T, d_inner) in W; each row's SSM state advanced in place."""
    d_inner, d_state = a.shape
    y = np.zeros((len(xs), d_inner), np.float32)
    for slot, first, n in zip(row_ids, row_first, row_tokens, strict=True):
        h = ssm_state[slot].copy()
        for u in range(first, first + n):
            raw = dtr[u] + dt_bias
            dt = np.maximum(raw, np.float32(0)) + np.log1p(np.exp(-np.abs(raw)))
            b, c = dbc[u, dt_rank : dt_rank + d_state], dbc[u, dt_rank + d_state : dt_rank + 2 * d_state]
            h = h * np.exp(dt[:, None] * a) + (dt * xs[u])[:, None] * b
            z = xz[u, d_inner:]
            y[u] = ((h * c).sum(axis=1, dtype=np.float32) + xs[u] * d_skip) * (z / (np.float32(1) + np.exp(-z)))
        ssm_state[slot] = h
    return to_w(y, wtype)
