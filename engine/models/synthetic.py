"""Tiny Llama models generated from a seed, for tests that need a real forward but no file."""

from __future__ import annotations

import numpy as np

from .base import LlamaConfig, LoadedModel
from .block_codes import BLOCK, _half
from .byte_tokenizer import ByteTokenizer

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

TINY = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=16, max_positions=512, rope_theta=10000.0)


def synthetic_config(**overrides) -> LlamaConfig:
    sizes = {**TINY, **overrides}
    return LlamaConfig(vocab_size=ByteTokenizer.vocab_size, tie_embeddings=False, **sizes)


def synthetic_weights(config: LlamaConfig, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    d, i = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32)

    w = {"embed": rng.standard_normal((config.vocab_size, d)).astype(np.float32)}
    for layer in range(config.num_layers):
        p = f"layers.{layer}."
        w |= {p + "attn_norm": norm(), p + "wq": mat(q, d), p + "wk": mat(kv, d), p + "wv": mat(kv, d),
              p + "wo": mat(d, q), p + "mlp_norm": norm(), p + "w_gate": mat(i, d), p + "w_up": mat(i, d),
              p + "w_down": mat(d, i)}
    w["norm"] = norm()
    # A sharper head than 1/sqrt(d) so greedy choices are decisive, not ties.
    head = 3.0 * mat(config.vocab_size, d)
    # Damp bytes outside printable ASCII so outputs read as text and stop strings can match;
    # EOS keeps full weight so some requests end on it.
    printable = np.zeros(config.vocab_size, dtype=bool)
    printable[32:127] = True
    printable[[10, config.vocab_size - 1]] = True
    head[~printable] *= 0.2
    w["lm_head"] = head.astype(np.float32)
    return w


def _byte_model(family: str, config, weights: dict[str, np.ndarray], seed: int, spec: str) -> LoadedModel:
    return LoadedModel(
        name=f"synthetic-{family}-{seed}",
        config=config,
        weights=weights,
        tokenizer=ByteTokenizer(),
        chat_template=CHAT_TEMPLATE,
        special_tokens={"bos_token": "", "eos_token": ""},
        source=f"{spec}:seed={seed}",
    )


def synthetic_llama(seed: int = 0, block_coded: bool = False, **overrides) -> LoadedModel:
    """A tiny seeded Llama with the byte tokenizer. `block_coded`: every layer matrix rounded to
    Q4_1 values and the head to Q8_0 values, as a GGUF's dequantized blocks are (so the CPU
    driver's products run on their codes)."""
    config = synthetic_config(**overrides)
    weights = synthetic_weights(config, seed)
    if block_coded:
        weights = {name: _q8_0(w) if name == "lm_head" else _q4_1(w) if w.ndim == 2 and name != "embed" else w
                   for name, w in weights.items()}
    return _byte_model("llama", config, weights, seed, "synthetic-q4_1" if block_coded else "synthetic")


def _blocks(w: np.ndarray) -> np.ndarray:
    return w.reshape(w.shape[0], -1, BLOCK)


def _q4_1(w: np.ndarray) -> np.ndarray:
    """fl(d q) + m per block, q in 0..15, d and m float16; each block's first weight takes q 0
    and its second q 15 (as a quantizer gives its least and largest), so block_codes finds the
    codes again from the values alone."""
    b = _blocks(w)
    m = _half(b.min(axis=2))
    d = _half((b.max(axis=2) - m) / 15)
    q = np.clip(np.rint((b - m[:, :, None]) / np.where(d == 0, 1, d)[:, :, None]), 0, 15)
    q[:, :, 0], q[:, :, 1] = 0, 15
    return (q * d[:, :, None] + m[:, :, None]).astype(np.float32).reshape(w.shape)


def _q8_0(w: np.ndarray) -> np.ndarray:
    """fl(q d) per block, q in -127..127, d float16; a block's largest magnitude takes q 127."""
    b = _blocks(w)
    d = _half(np.abs(b).max(axis=2) / 127)
    q = np.clip(np.rint(b / np.where(d == 0, 1, d)[:, :, None]), -127, 127)
    q[:, :, 0] = 127
    return (q * d[:, :, None]).astype(np.float32).reshape(w.shape)


# ---- the Mamba family ----------------------------------------------------------------------

MAMBA_TINY = dict(hidden_size=64, num_layers=2, d_inner=128, d_state=8, d_conv=4, max_positions=2048)


def synthetic_mamba_config(**overrides):
    from .mamba import MambaConfig

    return MambaConfig(vocab_size=ByteTokenizer.vocab_size, **{**MAMBA_TINY, **overrides})


def synthetic_mamba_weights(config, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    d, di, ds, r = config.hidden_size, config.d_inner, config.d_state, config.dt_rank

    def mat(rows: int, cols: int, scale: float = 1.0) -> np.ndarray:
        return (scale * rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    w = {"embed": rng.standard_normal((config.vocab_size, d)).astype(np.float32)}
    for layer in range(config.num_layers):
        p = f"layers.{layer}."
        dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), di))  # Mamba's dt initialisation
        w |= {
            p + "norm": (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32),
            p + "in_proj": mat(2 * di, d),
            p + "conv_w": mat(di, config.d_conv),
            p + "conv_b": (0.1 * rng.standard_normal(di)).astype(np.float32),
            p + "x_proj": mat(r + 2 * ds, di),
            p + "dt_proj": mat(di, r, 0.5),
            p + "dt_bias": (dt + np.log(-np.expm1(-dt))).astype(np.float32),  # softplus^-1(dt)
            # S4D-real: A_log = log(1..d_state), stored as A = -exp(A_log) the way GGUF keeps it
            p + "A": -np.tile(np.arange(1, ds + 1, dtype=np.float32), (di, 1)),
            p + "D": np.ones(di, np.float32),
            p + "out_proj": mat(d, di),
        }
    w["norm"] = (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    head = 3.0 * mat(config.vocab_size, d)
    printable = np.zeros(config.vocab_size, dtype=bool)  # same damping as the Llama head
    printable[32:127] = True
    printable[[10, config.vocab_size - 1]] = True
    head[~printable] *= 0.2
    w["lm_head"] = head.astype(np.float32)
    return w


def synthetic_mamba(seed: int = 0, **overrides) -> LoadedModel:
    """A tiny seeded Mamba-1 (d_model 64, 2 layers, d_state 8, d_conv 4, expand 2) with the
    byte tokenizer: the recurrent family without a file."""
    config = synthetic_mamba_config(**overrides)
    return _byte_model("mamba", config, synthetic_mamba_weights(config, seed), seed, "synthetic-mamba")
