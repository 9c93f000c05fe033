"""The Llama family: one step as a program of generic ops (engine/ops.py) and the weights
those ops read, prepared once. Every driver runs this one definition; none writes the
family's layers again.

The maths that is the family's own, fixed here:
- Q/K/V fused and gate/up fused; each RMSNorm weight folded into the columns of the
  projection that follows it (so rms_norm only divides by the RMS), and 1/sqrt(head_dim)
  folded into the Q rows (scores come out pre-scaled).
- Rotary: the Q and K rows of each head are stored with the rotate_half pairs (j, j + hd/2)
  adjacent, so rotating is one complex multiply by e^(i pos theta) per pair. Q and K are
  permuted alike, so every q.k (and so attention) is unchanged; the cache holds K permuted.
- A layer: rms_norm, the QKV product, rotary with the K/V write, paged attention, the output
  product added to the residual, rms_norm, gate/up, SiLU times up, the down product added;
  named as one op (`llama_layer`, engine/ops.py), for drivers that run it as one kernel.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from ..ops import Op, Program, fused
from . import block_codes as block_quant
from .base import LlamaConfig
from .prepared import PreparedWeights


def program(config: LlamaConfig) -> Program:
    """One step of the family over named buffers; the weights are prepare()'s names."""
    heads, kvh, hd, d = config.num_heads, config.num_kv_heads, config.head_dim, config.hidden_size
    ops = [Op("embed", (), "x", ("embed",))]
    ops += [layer(i) for i in range(config.num_layers)]
    ops += [Op("final_norm", ("x",), "hl", ("norm",)), Op("head", ("hl",), "logits", ("lm_head",))]
    inter = config.intermediate_size
    widths = {"x": d, "h": d, "qkv": (heads + 2 * kvh) * hd, "q": heads * hd, "att": heads * hd,
              "gu": 2 * inter, "act": inter, "hl": d, "logits": config.vocab_size}
    dims = {"hidden": d, "vocab": config.vocab_size, "heads": heads, "kv_heads": kvh, "head_dim": hd}
    return Program(tuple(ops), widths, dims, config.rms_eps)


def layer(i: int) -> Op:
    """Layer i as one op (a driver may run it as one kernel), its parts in order."""
    p = f"layers.{i}."
    return fused("llama_layer", [
        Op("rms_norm", ("x",), "h"),
        Op("matmul", ("h",), "qkv", (p + "wqkv",)),
        Op("rope_kv_write", ("qkv",), "q", ("rope",), layer=i),
        Op("paged_attention", ("q",), "att", layer=i),
        Op("matmul_add", ("att",), "x", (p + "wo",)),
        Op("rms_norm", ("x",), "h"),
        Op("matmul", ("h",), "gu", (p + "w_gate_up",)),
        Op("silu_mul", ("gu",), "act"),
        Op("matmul_add", ("act",), "x", (p + "w_down",)),
    ], layer=i)


def rope_table(config: LlamaConfig, positions: int) -> np.ndarray:
    """(positions, head_dim / 2, 2) float32: (cos, sin) of pos * theta_j."""
    half = config.head_dim // 2
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(half, dtype=np.float64) / half))
    angles = np.outer(np.arange(positions, dtype=np.float64), inv_freq)
    return np.exp(1j * angles).astype(np.complex64).view(np.float32).reshape(positions, half, 2)


def pair_rows(w: np.ndarray, heads: int, head_dim: int) -> np.ndarray:
    """Reorders each head's rows from the rotate_half layout (x_j and x_{j+hd/2} apart) to
    adjacent pairs (x_j, x_{j+hd/2}), the real and imaginary parts of one complex number."""
    half = head_dim // 2
    order = np.stack([np.arange(half), np.arange(half) + half], axis=1).reshape(-1)
    return w.reshape(heads, head_dim, -1)[:, order].reshape(heads * head_dim, -1)


def prepare(config: LlamaConfig, weights: dict[str, np.ndarray], positions: int) -> PreparedWeights:
    """The program's weights by name, host float32, laid out as engine/ops.py states; each is
    made on its first read (prepared.py)."""
    def dev(name: str) -> Callable[[], np.ndarray]:
        return lambda: np.ascontiguousarray(weights[name], dtype=np.float32)

    def folded(w: np.ndarray, norm: np.ndarray) -> np.ndarray:
        # W @ (x * norm) == (W * norm) @ x: the norm's weight multiplies the columns.
        return np.ascontiguousarray(np.asarray(w, dtype=np.float64) * np.asarray(norm, dtype=np.float64)[None, :],
                                    dtype=np.float32)

    def qkv(p: str) -> np.ndarray:
        wq = np.asarray(weights[p + "wq"], dtype=np.float64) * (1.0 / np.sqrt(config.head_dim))  # scores come out pre-scaled
        wq = pair_rows(wq, config.num_heads, config.head_dim)
        wk = pair_rows(np.asarray(weights[p + "wk"]), config.num_kv_heads, config.head_dim)
        return folded(np.concatenate([wq, wk, weights[p + "wv"]]), weights[p + "attn_norm"])

    def gate_up(p: str) -> np.ndarray:
        return folded(np.concatenate([weights[p + "w_gate"], weights[p + "w_up"]]), weights[p + "mlp_norm"])

    makers: dict[str, Callable[[], np.ndarray]] = {"embed": dev("embed")}
    for i in range(config.num_layers):
        p = f"layers.{i}."
        makers |= {p + "wqkv": functools.partial(qkv, p), p + "wo": dev(p + "wo"),
                   p + "w_gate_up": functools.partial(gate_up, p), p + "w_down": dev(p + "w_down")}
    makers["norm"] = dev("norm")  # the final norm (not folded: the head may be tied to the embedding)
    makers["lm_head"] = dev("lm_head" if "lm_head" in weights else "embed")
    makers["rope"] = lambda: rope_table(config, positions)
    return PreparedWeights(makers)


def block_codes(config: LlamaConfig, weights: dict[str, np.ndarray], known: dict | None = None) -> dict[str, tuple]:
    """prepare()'s product matrices as exact block codes (block_codes.find), where the loaded
    weights are block-quantized values (a GGUF's Q4_1/Q8_0 layers): {name: (BlockCodes,
    colscale or None)}. The same rows, order and Q scale as prepare(); the RMSNorm weight
    prepare() folds into the columns is colscale, for the product to apply to its input.
    Matrices without exact codes (float32 from anywhere else) are left out. `known`: the
    loader's codes of the weights by name (LoadedModel.block_codes), when it has them: then
    a weight it does not name has none, and nothing is searched."""
    def rows_order(heads: int) -> np.ndarray:
        return pair_rows(np.arange(heads * config.head_dim)[:, None], heads, config.head_dim)[:, 0]

    def found(name: str):
        return known.get(name) if known is not None else block_quant.find(weights[name])

    def norm(name: str) -> np.ndarray:
        return np.ascontiguousarray(weights[name], dtype=np.float32)

    scale = 1.0 / np.sqrt(config.head_dim)
    out = {}
    for i in range(config.num_layers):
        p = f"layers.{i}."
        wq, wk, wv = found(p + "wq"), found(p + "wk"), found(p + "wv")
        if wq is not None and wk is not None and wv is not None:
            qkv = block_quant.concat([wq.scaled(scale).rows(rows_order(config.num_heads)),
                                      wk.rows(rows_order(config.num_kv_heads)), wv])
            if qkv is not None:
                out[p + "wqkv"] = (qkv, norm(p + "attn_norm"))
        gate, up = found(p + "w_gate"), found(p + "w_up")
        if gate is not None and up is not None and (gu := block_quant.concat([gate, up])) is not None:
            out[p + "w_gate_up"] = (gu, norm(p + "mlp_norm"))
        for name in ("wo", "w_down"):
            if (codes := found(p + name)) is not None:
                out[p + name] = (codes, None)
    if (head := found("lm_head" if "lm_head" in weights else "embed")) is not None:
        out["lm_head"] = (head, None)
    return out
