"""The canonical weight names and shapes of base.py, for loaders to check against."""

from __future__ import annotations

from .base import LlamaConfig


def expected_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every canonical weight the llama forward reads, with its shape ([out, in] for matrices)."""
    d, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out = {"embed": (cfg.vocab_size, d), "norm": (d,)}
    if not cfg.tie_embeddings:
        out["lm_head"] = (cfg.vocab_size, d)
    for layer in range(cfg.num_layers):
        p = f"layers.{layer}."
        out |= {p + "attn_norm": (d,), p + "wq": (q, d), p + "wk": (kv, d), p + "wv": (kv, d), p + "wo": (d, q),
                p + "mlp_norm": (d,), p + "w_gate": (i, d), p + "w_up": (i, d), p + "w_down": (d, i)}
    return out
