"""Loads a Hugging Face Llama checkpoint folder into a LoadedModel.

    config.json                       LlamaForCausalLM / model_type "llama"
    model.safetensors                 or shards listed by model.safetensors.index.json
    tokenizer.json                    (+ tokenizer_config.json, generation_config.json)

Tensors (F32, F16, F64, BF16) become float32 arrays under the canonical names of base.py;
Hugging Face Llama weights are already [out, in] and in the rotate_half layout. The
safetensors numpy API cannot read BF16, so BF16 tensors are read from the file's raw bytes.
"""

from __future__ import annotations

import json
import mmap
import re
import struct
from pathlib import Path

import numpy as np

from .base import LlamaConfig, LoadedModel, ModelLoadError
from .canonical import expected_shapes
from .hf_tokenizer import tokenizer_from_folder

ARCHITECTURES = ("LlamaForCausalLM",)
MODEL_TYPES = ("llama",)
DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": None}

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)\.weight")
_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "wq", "self_attn.k_proj": "wk",
    "self_attn.v_proj": "wv", "self_attn.o_proj": "wo", "post_attention_layernorm": "mlp_norm",
    "mlp.gate_proj": "w_gate", "mlp.up_proj": "w_up", "mlp.down_proj": "w_down",
}
_GLOBAL_NAMES = {"model.embed_tokens.weight": "embed", "model.norm.weight": "norm", "lm_head.weight": "lm_head"}
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")  # buffers in old checkpoints


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"model folder has no config.json: {folder}")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {_one_line(e)}") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path} is not a JSON object")
    return config


def _llama_config(config: dict) -> LlamaConfig:
    archs = config.get("architectures") or []
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES or (archs and not set(archs) & set(ARCHITECTURES)):
        name = archs[0] if archs else model_type
        raise ModelLoadError(f"unsupported architecture {name!r} (poot loads: {', '.join(ARCHITECTURES)})")

    def need(key):
        value = config.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ModelLoadError(f"config.json: {key} must be a positive integer; got {value!r}")
        return value

    hidden, heads = need("hidden_size"), need("num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise ModelLoadError(f"config.json: {heads} attention heads are not a multiple of {kv_heads} kv heads")
    head_dim = config.get("head_dim") or hidden // heads
    if config.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"unsupported activation {config.get('hidden_act')!r} (the llama forward uses silu)")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ModelLoadError("attention or MLP biases are not supported by the llama forward")
    rope = config.get("rope_scaling") or {}
    params = config.get("rope_parameters") or {}  # newer transformers keep rope_theta here
    kind = rope.get("rope_type", rope.get("type")) or params.get("rope_type") or "default"
    if kind != "default":
        raise ModelLoadError(f"rope scaling {kind!r} is not supported")
    theta = config.get("rope_theta") or params.get("rope_theta") or 10000.0
    return LlamaConfig(
        vocab_size=need("vocab_size"), hidden_size=hidden, intermediate_size=need("intermediate_size"),
        num_layers=need("num_hidden_layers"), num_heads=heads, num_kv_heads=int(kv_heads), head_dim=int(head_dim),
        rope_theta=float(theta), rms_eps=float(config.get("rms_norm_eps", 1e-6)),
        max_positions=int(config.get("max_position_embeddings", 2048)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
    )


def _shard_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"cannot read {index}: {_one_line(e)}") from None
        files = [folder / n for n in names]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"missing shard {f.name} listed in {index.name}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"model folder has no .safetensors files: {folder}")
    return files


def _header(path: Path) -> tuple[dict, int]:
    """The safetensors header and where the data starts, checked against the file size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ModelLoadError(f"truncated safetensors file {path.name}: {size} bytes")
        (length,) = struct.unpack("<Q", raw)
        if length > size - 8:
            raise ModelLoadError(f"truncated or corrupt safetensors file {path.name}: header of {length} bytes "
                                 f"in a {size}-byte file")
        try:
            header = json.loads(f.read(length))
        except ValueError:
            raise ModelLoadError(f"corrupt safetensors file {path.name}: the header is not JSON") from None
    if not isinstance(header, dict):
        raise ModelLoadError(f"corrupt safetensors file {path.name}: the header is not a JSON object")
    start = 8 + length
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            end = int(info["data_offsets"][1])
        except (KeyError, TypeError, ValueError, IndexError):
            raise ModelLoadError(f"corrupt safetensors file {path.name}: bad entry for {name}") from None
        if start + end > size:
            raise ModelLoadError(f"truncated safetensors file {path.name}: tensor {name} ends past the end of the file")
    return header, start


MAPPED_TYPES = {"F32": np.float32, "F16": np.float16, "U8": np.uint8, "I8": np.int8, "I32": np.int32}


def map_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file of MAPPED_TYPES, mapped copy-on-write, not read:
    a page is read from the file (or found in the page cache) when first used, a tensor never
    used costs nothing, and a write goes to the process's own copy of its page, never to the
    file. The arrays stay valid when the file is replaced or removed (its pages stay while
    mapped). ModelLoadError for a tensor of another type or one whose bytes do not fit it."""
    header, start = _header(path)
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = MAPPED_TYPES.get(info.get("dtype"))
        if dtype is None:
            raise ModelLoadError(f"{path.name}: tensor {name} is {info.get('dtype')}, which is not mapped")
        begin, end = (int(x) for x in info["data_offsets"])
        shape = tuple(int(d) for d in info["shape"])
        count = int(np.prod(shape, dtype=np.int64))
        if begin < 0 or end - begin != count * np.dtype(dtype).itemsize:
            raise ModelLoadError(f"corrupt safetensors file {path.name}: tensor {name} has {end - begin} bytes "
                                 f"for shape {list(shape)}")
        out[name] = np.frombuffer(mapped, dtype, count, start + begin).reshape(shape)
    return out


def _read_bf16(path: Path, start: int, info: dict) -> np.ndarray:
    begin, end = (int(x) for x in info["data_offsets"])
    shape = tuple(int(d) for d in info["shape"])
    raw = np.fromfile(path, dtype="<u2", count=(end - begin) // 2, offset=start + begin)
    if raw.size != int(np.prod(shape)):
        raise ModelLoadError(f"corrupt safetensors file {path.name}: size of a BF16 tensor does not match its shape")
    return (raw.astype(np.uint32) << 16).view(np.float32).reshape(shape)


def _canonical(name: str, num_layers: int) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER.fullmatch(name)
    if m and int(m.group(1)) < num_layers and m.group(2) in _LAYER_NAMES:
        return f"layers.{int(m.group(1))}.{_LAYER_NAMES[m.group(2)]}"
    return None


def _read_tensors(files: list[Path], num_layers: int) -> dict[str, np.ndarray]:
    from safetensors import safe_open

    weights: dict[str, np.ndarray] = {}
    for path in files:
        header, start = _header(path)
        names = [n for n in header if n != "__metadata__"]
        for name in names:
            if _IGNORED.fullmatch(name):
                continue
            canon = _canonical(name, num_layers)
            if canon is None:
                raise ModelLoadError(f"unexpected tensor {name} in {path.name}: not part of the llama model poot runs")
            dtype = header[name].get("dtype")
            if dtype not in DTYPES:
                raise ModelLoadError(f"tensor {name} has dtype {dtype}, which poot cannot load "
                                     f"(supported: {', '.join(DTYPES)})")
            if canon in weights:
                raise ModelLoadError(f"tensor {name} appears twice")
        try:
            with safe_open(str(path), framework="numpy") as f:
                for name in names:
                    canon = _canonical(name, num_layers)
                    if canon is None:
                        continue
                    if header[name]["dtype"] == "BF16":
                        arr = _read_bf16(path, start, header[name])
                    else:
                        arr = f.get_tensor(name)
                    weights[canon] = np.array(arr, dtype=np.float32, order="C", copy=True)
        except ModelLoadError:
            raise
        except Exception as e:
            raise ModelLoadError(f"cannot read safetensors file {path.name}: {_one_line(e)}") from None
    return weights


def _hf_name(canon: str) -> str:
    inverse = {v: k for k, v in _GLOBAL_NAMES.items()}
    if canon in inverse:
        return inverse[canon]
    _, layer, short = canon.split(".")
    hf = {v: k for k, v in _LAYER_NAMES.items()}[short]
    return f"model.layers.{layer}.{hf}.weight"


def load_safetensors(folder: str | Path) -> LoadedModel:
    """Loads a Hugging Face Llama folder; raises ModelLoadError with a one-line message."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise ModelLoadError(f"model folder not found: {folder}")
    config = _llama_config(_read_config(folder))
    weights = _read_tensors(_shard_files(folder), config.num_layers)
    if config.tie_embeddings:
        weights.pop("lm_head", None)  # a tied checkpoint may still store a copy; HF ignores it
    elif "lm_head" not in weights:
        raise ModelLoadError("missing tensor lm_head.weight (config.json says the head is not tied)")
    for canon, shape in expected_shapes(config).items():
        if canon not in weights:
            raise ModelLoadError(f"missing tensor {_hf_name(canon)}")
        if weights[canon].shape != shape:
            raise ModelLoadError(f"tensor {_hf_name(canon)} has shape {list(weights[canon].shape)}, expected {list(shape)}")
    tokenizer, template, special = tokenizer_from_folder(folder)
    return LoadedModel(name=folder.name, config=config, weights=weights, tokenizer=tokenizer, chat_template=template,
                       special_tokens=special, source=str(folder))
