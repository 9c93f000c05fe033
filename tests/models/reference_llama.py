"""A plain float64 Llama forward, the yardstick for the engine's logits.

Written from the Llama architecture's definition (as in Hugging Face's modeling_llama), not
from any engine code: the whole sequence at once, full causal attention, no KV cache, no
batching, no fused weights. Reads the canonical weight names of poot.engine.models.base.

    x = embed[tokens]
    per layer:  x += Wo . attention(rope(Wq . rms(x)), rope(Wk . rms(x)), Wv . rms(x))
                x += Wdown . (silu(Wgate . rms(x)) * (Wup . rms(x)))
    logits = head . rms(x)

rope is the "rotate_half" form: the head's first half pairs with its second half, with
frequency theta^(-2i/head_dim) for pair i.
"""

from __future__ import annotations

import numpy as np


class ReferenceLlama:
    def __init__(self, config, weights: dict[str, np.ndarray]):
        self.c = config
        self.w = {name: np.asarray(arr, dtype=np.float64) for name, arr in weights.items()}
        self.head = self.w["lm_head"] if "lm_head" in self.w else self.w["embed"]

    def rms_norm(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        variance = np.mean(x * x, axis=-1, keepdims=True)
        return x / np.sqrt(variance + self.c.rms_eps) * weight

    def rope(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """x: (tokens, heads, head_dim)."""
        d = x.shape[-1]
        inv_freq = self.c.rope_theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)  # (d/2,)
        angle = positions[:, None].astype(np.float64) * inv_freq[None, :]  # (t, d/2)
        cos = np.cos(np.concatenate([angle, angle], axis=-1))[:, None, :]
        sin = np.sin(np.concatenate([angle, angle], axis=-1))[:, None, :]
        first, second = x[..., : d // 2], x[..., d // 2 :]
        rotated = np.concatenate([-second, first], axis=-1)
        return x * cos + rotated * sin

    def attention(self, layer: int, h: np.ndarray, positions: np.ndarray) -> np.ndarray:
        c, w, p = self.c, self.w, f"layers.{layer}."
        t = h.shape[0]
        q = (h @ w[p + "wq"].T).reshape(t, c.num_heads, c.head_dim)
        k = (h @ w[p + "wk"].T).reshape(t, c.num_kv_heads, c.head_dim)
        v = (h @ w[p + "wv"].T).reshape(t, c.num_kv_heads, c.head_dim)
        q, k = self.rope(q, positions), self.rope(k, positions)
        group = c.num_heads // c.num_kv_heads
        out = np.empty((t, c.num_heads, c.head_dim))
        causal = np.tril(np.ones((t, t), dtype=bool))
        for head in range(c.num_heads):
            kv = head // group  # query head `head` reads kv head head // group
            scores = q[:, head, :] @ k[:, kv, :].T / np.sqrt(c.head_dim)  # (t, t)
            scores = np.where(causal, scores, -np.inf)
            scores -= scores.max(axis=-1, keepdims=True)
            probs = np.exp(scores)
            probs /= probs.sum(axis=-1, keepdims=True)
            out[:, head, :] = probs @ v[:, kv, :]
        return out.reshape(t, c.num_heads * c.head_dim) @ w[p + "wo"].T

    def mlp(self, layer: int, h: np.ndarray) -> np.ndarray:
        w, p = self.w, f"layers.{layer}."
        gate = h @ w[p + "w_gate"].T
        up = h @ w[p + "w_up"].T
        return (gate / (1.0 + np.exp(-gate)) * up) @ w[p + "w_down"].T

    def hidden(self, tokens) -> np.ndarray:
        tokens = np.asarray(tokens, dtype=np.int64)
        positions = np.arange(len(tokens))
        x = self.w["embed"][tokens]
        for layer in range(self.c.num_layers):
            p = f"layers.{layer}."
            x = x + self.attention(layer, self.rms_norm(x, self.w[p + "attn_norm"]), positions)
            x = x + self.mlp(layer, self.rms_norm(x, self.w[p + "mlp_norm"]))
        return self.rms_norm(x, self.w["norm"])

    def logits(self, tokens, last_only: bool = False) -> np.ndarray:
        """(tokens, vocab) float64 logits; (vocab,) for the last position with last_only."""
        h = self.hidden(tokens)
        if last_only:
            return self.head @ h[-1]
        return h @ self.head.T

    def greedy(self, tokens, steps: int) -> list[int]:
        seq = list(tokens)
        for _ in range(steps):
            seq.append(int(np.argmax(self.logits(seq, last_only=True))))
        return seq[len(tokens):]
