"""The Mamba family (Mamba-1, the selective state space model of Gu & Dao, 2023): config,
its step as a program of generic ops (engine/ops.py) over per-row recurrent state,
and loading from GGUF (architecture "mamba").

A Mamba model keeps no per-token KV. Each row of the plan owns one state slot per layer: the
last d_conv - 1 inputs of the causal convolution and the (d_inner, d_state) SSM state. A step
feeds each row's tokens through its slot, so chunked prefill equals one-shot prefill and a
row computes the same whatever else shares the step. A row fed from position 0 starts from
zero state: that is how a request that opens a row never sees the previous owner's state.

Canonical weights ([out, in] orientation, as in base.py):

    embed                 (vocab, hidden)
    layers.{i}.norm       (hidden,)               RMSNorm before the mixer
    layers.{i}.in_proj    (2 * d_inner, hidden)   x and the gate z
    layers.{i}.conv_w     (d_inner, d_conv)       depthwise causal convolution
    layers.{i}.conv_b     (d_inner,)
    layers.{i}.x_proj     (dt_rank + 2 * d_state, d_inner)
    layers.{i}.dt_proj    (d_inner, dt_rank)
    layers.{i}.dt_bias    (d_inner,)
    layers.{i}.A          (d_inner, d_state)      already -exp(A_log)
    layers.{i}.D          (d_inner,)
    layers.{i}.out_proj   (hidden, d_inner)
    norm                  (hidden,)
    lm_head               (vocab, hidden); absent when tied to embed
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..ops import Op, Program
from .base import LoadedModel, ModelLoadError


@dataclass(slots=True, frozen=True)
class MambaConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    d_inner: int
    d_state: int = 16
    d_conv: int = 4
    dt_rank: int = 0  # 0: ceil(hidden_size / 16), Mamba's default
    rms_eps: float = 1e-5
    max_positions: int = 2048  # no positional limit of its own; the plan's per-sequence cap
    tie_embeddings: bool = False
    family: str = "mamba"
    recurrent: bool = True  # per-row state instead of per-token KV: no prefix is ever registered

    def __post_init__(self):
        if self.dt_rank == 0:
            object.__setattr__(self, "dt_rank", -(-self.hidden_size // 16))

    def state_bytes_per_row(self, itemsize: int = 4) -> int:
        return self.num_layers * self.d_inner * (self.d_conv - 1 + self.d_state) * itemsize

    def kv_bytes_per_token(self, itemsize: int = 4) -> int:
        return 0

    def shapes(self) -> dict[str, tuple[int, ...]]:
        d, di, ds, r = self.hidden_size, self.d_inner, self.d_state, self.dt_rank
        out = {"embed": (self.vocab_size, d), "norm": (d,)}
        for i in range(self.num_layers):
            p = f"layers.{i}."
            out |= {p + "norm": (d,), p + "in_proj": (2 * di, d), p + "conv_w": (di, self.d_conv),
                    p + "conv_b": (di,), p + "x_proj": (r + 2 * ds, di), p + "dt_proj": (di, r),
                    p + "dt_bias": (di,), p + "A": (di, ds), p + "D": (di,), p + "out_proj": (d, di)}
        if not self.tie_embeddings:
            out["lm_head"] = (self.vocab_size, d)
        return out

    def weight_count(self) -> int:
        return sum(int(np.prod(s)) for s in self.shapes().values())

    def flops_per_token(self) -> int:
        d, di, ds, r = self.hidden_size, self.d_inner, self.d_state, self.dt_rank
        per_layer = 2 * di * d + (r + 2 * ds) * di + di * r + d * di
        return 2 * (self.num_layers * per_layer + self.vocab_size * d)


# ---- the step -------------------------------------------------------------------------------


def program(config: MambaConfig) -> Program:
    """One step of the family over named buffers; the weights are prepare()'s names. A layer:
    rms_norm, the input product (x and the gate z), the causal convolution (then the row's
    conv state moves on), x's product to dt's input, B and C, dt's own product, the scan
    with its skip term and gate, the output product added to the residual."""
    d, di, ds, r = config.hidden_size, config.d_inner, config.d_state, config.dt_rank
    ops = [Op("embed", (), "x", ("embed",))]
    for i in range(config.num_layers):
        p = f"layers.{i}."
        ops += [
            Op("rms_norm", ("x",), "h"),
            Op("matmul", ("h",), "xz", (p + "in_proj",)),
            Op("conv", ("xz",), "xs", (p + "conv_w", p + "conv_b"), layer=i),
            Op("conv_state", ("xz",), "", layer=i),
            Op("matmul", ("xs",), "dbc", (p + "x_proj",)),
            Op("matmul", ("dbc",), "dtr", (p + "dt_proj",)),
            Op("scan", ("xs", "dbc", "dtr", "xz"), "y", (p + "dt_bias", p + "A", p + "D"), layer=i),
            Op("matmul_add", ("y",), "x", (p + "out_proj",)),
        ]
    ops += [Op("final_norm", ("x",), "hl", ("norm",)), Op("head", ("hl",), "logits", ("lm_head",))]
    widths = {"x": d, "h": d, "xz": 2 * di, "xs": di, "dbc": r + 2 * ds, "dtr": di, "y": di, "hl": d,
              "logits": config.vocab_size}
    dims = {"hidden": d, "vocab": config.vocab_size, "d_inner": di, "d_conv": config.d_conv, "d_state": ds,
            "dt_rank": r}
    return Program(tuple(ops), widths, dims, config.rms_eps)


def prepare(config: MambaConfig, weights: dict[str, np.ndarray], positions: int = 0) -> dict[str, np.ndarray]:
    """The program's weights by name, host float32, laid out as engine/ops.py states: each
    layer's norm weight folded into the columns of in_proj (rms_norm only divides)."""
    def dev(a) -> np.ndarray:
        return np.ascontiguousarray(a, dtype=np.float32)

    out = {"embed": dev(weights["embed"])}
    for i in range(config.num_layers):
        p = f"layers.{i}."
        norm = np.asarray(weights[p + "norm"], dtype=np.float64)
        out[p + "in_proj"] = dev(np.asarray(weights[p + "in_proj"], dtype=np.float64) * norm[None, :])
        out |= {p + n: dev(weights[p + n]) for n in ("conv_w", "conv_b", "x_proj", "dt_proj", "dt_bias", "A", "D",
                                                       "out_proj")}
    out["norm"] = dev(weights["norm"])
    out["lm_head"] = dev(weights.get("lm_head", weights["embed"]))
    return out


# ---- loading from GGUF ------------------------------------------------------------------------

_LAYER_TENSORS = {  # llama.cpp's name -> canonical name
    "attn_norm.weight": "norm", "ssm_in.weight": "in_proj", "ssm_conv1d.weight": "conv_w",
    "ssm_conv1d.bias": "conv_b", "ssm_x.weight": "x_proj", "ssm_dt.weight": "dt_proj",
    "ssm_dt.bias": "dt_bias", "ssm_a": "A", "ssm_d": "D", "ssm_out.weight": "out_proj",
}
_GLOBAL_TENSORS = {"token_embd.weight": "embed", "output_norm.weight": "norm", "output.weight": "lm_head"}


def load_mamba_gguf(reader_or_path, tokenizer=None) -> LoadedModel:
    """Loads a Mamba-1 GGUF (general.architecture "mamba") from a path or an open
    gguf.GGUFReader. The tokenizer comes from the file's tokenizer.ggml.* metadata; a file
    without one and with a 258-token vocabulary gets poot's byte tokenizer (synthetic models)."""
    from .gguf_file import dequantize_tensor, metadata, one_line, open_reader, scalar, vocab

    if isinstance(reader_or_path, str | os.PathLike):
        path = Path(reader_or_path)
        reader = open_reader(path)
    else:
        reader, path = reader_or_path, Path(str(getattr(reader_or_path, "path", "model.gguf")))
    meta = metadata(reader)
    if meta.get("general.architecture") != "mamba":
        raise ModelLoadError(f"not a mamba model: architecture {meta.get('general.architecture')!r}")
    if meta.get("mamba.ssm.dt_b_c_rms"):
        raise ModelLoadError("RMS-normed dt/B/C (Falcon-Mamba) is not supported")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ModelLoadError("missing tensor token_embd.weight")

    def num(key: str, default=None) -> int:
        return int(scalar(meta, "mamba." + key, default, required=default is None))

    hidden = num("embedding_length")
    config = MambaConfig(
        vocab_size=int(tensors["token_embd.weight"].shape[-1]), hidden_size=hidden,
        num_layers=num("block_count"), d_inner=num("ssm.inner_size", 2 * hidden),
        d_state=num("ssm.state_size"), d_conv=num("ssm.conv_kernel"), dt_rank=num("ssm.time_step_rank", 0),
        rms_eps=float(f"{float(scalar(meta, 'mamba.attention.layer_norm_rms_epsilon', 1e-5)):.7g}"),
        max_positions=num("context_length", 2048), tie_embeddings="output.weight" not in tensors,
    )
    names = dict(_GLOBAL_TENSORS)
    for i in range(config.num_layers):
        names |= {f"blk.{i}.{g}": f"layers.{i}.{c}" for g, c in _LAYER_TENSORS.items()}
    weights = {}
    for name, t in tensors.items():
        canon = names.get(name)
        if canon is None:
            raise ModelLoadError(f"unexpected tensor {name}: not part of the mamba model poot runs")
        try:
            weights[canon] = dequantize_tensor(t)
        except Exception as e:
            raise ModelLoadError(f"cannot dequantize tensor {name} ({t.tensor_type.name}): {one_line(e)}") from None
    gguf_name = {c: g for g, c in names.items()}
    for canon, shape in config.shapes().items():
        w = weights.get(canon)
        if w is None:
            raise ModelLoadError(f"missing tensor {gguf_name[canon]}")
        if w.shape != shape and w.size == int(np.prod(shape)):  # e.g. a conv kernel kept as (d_inner, 1, d_conv)
            weights[canon] = w = w.reshape(shape)
        if w.shape != shape:
            raise ModelLoadError(f"tensor {gguf_name[canon]} has shape {list(w.shape)}, expected {list(shape)}")

    special: dict[str, str] = {}
    if tokenizer is None:
        if "tokenizer.ggml.model" in meta:
            from .hf_tokenizer import tokenizer_from_gguf

            tokenizer, special = tokenizer_from_gguf(vocab(meta))
        elif config.vocab_size == 258:
            from .byte_tokenizer import ByteTokenizer

            tokenizer = ByteTokenizer()
        else:
            raise ModelLoadError("the file has no tokenizer (tokenizer.ggml.model is missing)")
    template = meta.get("tokenizer.chat_template")
    return LoadedModel(
        name=str(meta.get("general.name") or path.stem), config=config, weights=weights, tokenizer=tokenizer,
        chat_template=template if isinstance(template, str) else None, special_tokens=special, source=str(path),
    )
