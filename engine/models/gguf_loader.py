"""Loads a Llama-family GGUF file (llama.cpp's format) into a LoadedModel.

Every tensor is dequantized to float32 with gguf-py (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) into the canonical names and [out, in] layout of base.py.
llama.cpp's HF->GGUF converter interleaves the rotary halves of the Q and K rows; the loader
undoes it (unpermute_rows), so the weights are in the Hugging Face "rotate_half" layout.
A file without `output.weight` has its output head tied to the embedding.

Cache: parsing and dequantizing a file takes seconds, so files of CACHE_MIN_BYTES (32 MiB) or
more keep their float32 weights, config and tokenizer in
    $POOT_CACHE_DIR/gguf/<key>/        (POOT_CACHE_DIR defaults to $XDG_CACHE_HOME/poot,
                                        that is ~/.cache/poot)
        weights.safetensors  codes.safetensors  tokenizer.json  meta.json
keyed by the file's real path, size, modification time and first MiB; an entry for an older
version of the same file is removed when a new one is written. codes.safetensors holds the
exact block codes of every weight that has them (block_codes.find), which a load from the
cache hands on as LoadedModel.block_codes: searching SmolLM2's weights for them takes 2-3 s,
reading them a tenth of that. POOT_NO_CACHE=1 turns the cache off; load_gguf(path,
cache=True/False) forces it on or off. The default model (SmolLM2-135M) takes about 700 MB
there. A cache entry that cannot be read is ignored and rewritten; a cache that cannot be
written only costs the next load its speed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

import numpy as np

from ..cache_dir import cache_root
from . import block_codes
from .base import LlamaConfig, LoadedModel, ModelLoadError
from .canonical import expected_shapes
from .gguf_file import dequantize_tensor, metadata, one_line, open_reader, scalar, vocab
from .hf_tokenizer import HFTokenizer, tokenizer_from_gguf
from .safetensors_loader import map_tensors

log = logging.getLogger(__name__)

CACHE_VERSION = 2  # 2: the block codes beside the weights
CACHE_MIN_BYTES = 32 << 20
ARCHITECTURES = ("llama", "mamba")
SUPPORTED_TYPES = ("F32", "F16", "BF16", "F64", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

_LAYER_TENSORS = {
    "attn_norm": "attn_norm", "attn_q": "wq", "attn_k": "wk", "attn_v": "wv", "attn_output": "wo",
    "ffn_norm": "mlp_norm", "ffn_gate": "w_gate", "ffn_up": "w_up", "ffn_down": "w_down",
}
_GLOBAL_TENSORS = {"token_embd.weight": "embed", "output_norm.weight": "norm", "output.weight": "lm_head"}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of the converter's `w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2)`:
    interleaved rotary pairs back to the rotate_half halves, head by head."""
    rows = w.shape[0]
    return np.ascontiguousarray(
        w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def _f32(value) -> float:
    """A float32 metadata value as the decimal it was written from (9.99999975e-06 -> 1e-05)."""
    return float(f"{float(value):.7g}")


def _config(meta: dict, arch: str, shapes: dict[str, tuple[int, ...]]) -> LlamaConfig:
    k = f"{arch}."
    hidden = int(scalar(meta, k + "embedding_length", required=True))
    layers = int(scalar(meta, k + "block_count", required=True))
    inter = int(scalar(meta, k + "feed_forward_length", required=True))
    heads = int(scalar(meta, k + "attention.head_count", required=True))
    kv_heads = int(scalar(meta, k + "attention.head_count_kv", heads))
    if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
        raise ModelLoadError(f"bad attention head counts: {heads} heads, {kv_heads} kv heads")
    head_dim = int(scalar(meta, k + "attention.key_length", hidden // heads))
    if int(scalar(meta, k + "attention.value_length", head_dim)) != head_dim:
        raise ModelLoadError("attention key and value head sizes differ, which the llama forward does not support")
    if head_dim % 2:
        raise ModelLoadError(f"odd attention head size {head_dim}")
    rope_dims = int(scalar(meta, k + "rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ModelLoadError(f"partial rotary embedding ({rope_dims} of {head_dim} dims) is not supported")
    scaling = scalar(meta, k + "rope.scaling.type")
    if scaling not in (None, "none"):
        raise ModelLoadError(f"rope scaling {scaling!r} is not supported")
    embed = shapes.get("token_embd.weight")
    if embed is None:
        raise ModelLoadError("missing tensor token_embd.weight")
    vocab_size = embed[0]
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=inter, num_layers=layers, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim,
        rope_theta=_f32(scalar(meta, k + "rope.freq_base", 10000.0)),
        rms_eps=_f32(scalar(meta, k + "attention.layer_norm_rms_epsilon", 1e-5)),
        max_positions=int(scalar(meta, k + "context_length", 2048)),
        tie_embeddings="output.weight" not in shapes,
    )


def _canonical_name(name: str, num_layers: int) -> str | None:
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    m = _LAYER_NAME.fullmatch(name)
    if m and int(m.group(1)) < num_layers and m.group(2) in _LAYER_TENSORS:
        return f"layers.{int(m.group(1))}.{_LAYER_TENSORS[m.group(2)]}"
    return None


def _read_model(path: Path, progress=None) -> LoadedModel:
    reader = open_reader(path)
    meta = metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"unsupported architecture {arch!r} in {path.name} (poot loads: {', '.join(ARCHITECTURES)})")
    if arch == "mamba":
        from .mamba import load_mamba_gguf

        return load_mamba_gguf(reader)
    tensors = {t.name: t for t in reader.tensors}
    shapes = {name: tuple(int(d) for d in reversed(t.shape.tolist())) for name, t in tensors.items()}
    if "rope_freqs.weight" in tensors:
        raise ModelLoadError("rope frequency scaling (tensor rope_freqs.weight, as in Llama 3.1+) is not supported")
    config = _config(meta, arch, shapes)

    names = {}
    for name, t in tensors.items():
        canon = _canonical_name(name, config.num_layers)
        if canon is None:
            raise ModelLoadError(f"unexpected tensor {name}: not part of the llama model poot runs")
        if t.tensor_type.name not in SUPPORTED_TYPES:
            raise ModelLoadError(f"tensor {name} has type {t.tensor_type.name}, which poot cannot dequantize "
                                 f"(supported: {', '.join(SUPPORTED_TYPES)})")
        names[canon] = name
    expected = expected_shapes(config)
    gguf_names = {v: k for k, v in _GLOBAL_TENSORS.items()} | {
        f"layers.{i}.{c}": f"blk.{i}.{g}.weight" for i in range(config.num_layers) for g, c in _LAYER_TENSORS.items()}
    for canon, shape in expected.items():
        if canon not in names:
            raise ModelLoadError(f"missing tensor {gguf_names[canon]}")
        if shapes[names[canon]] != shape:
            raise ModelLoadError(f"tensor {names[canon]} has shape {list(shapes[names[canon]])}, expected {list(shape)}")

    tokenizer, special = tokenizer_from_gguf(vocab(meta))
    weights = {}
    each = progress.each("model", f"dequantizing {path.name}", expected) if progress is not None else expected
    for canon in each:
        name = names[canon]
        try:
            w = dequantize_tensor(tensors[name])
        except Exception as e:
            raise ModelLoadError(f"cannot dequantize tensor {name} ({tensors[name].tensor_type.name}): {one_line(e)}") from None
        if canon.endswith(".wq"):
            w = unpermute_rows(w, config.num_heads)
        elif canon.endswith(".wk"):
            w = unpermute_rows(w, config.num_kv_heads)
        weights[canon] = w
    template = meta.get("tokenizer.chat_template")
    return LoadedModel(
        name=str(meta.get("general.name") or path.stem), config=config, weights=weights, tokenizer=tokenizer,
        chat_template=template if isinstance(template, str) else None, special_tokens=special, source=str(path),
    )


# ---- the cache -----------------------------------------------------------------------------

def _cache_key(path: Path) -> str:
    st = path.stat()
    h = hashlib.sha256(f"{CACHE_VERSION}|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
    return h.hexdigest()[:32]


def _cache_read(entry: Path) -> LoadedModel | None:
    """The entry's model, its weights and codes mapped from the entry's files (copy-on-write):
    a driver on block codes reads the codes and a few float32 weights only, and reading every
    float32 weight (SmolLM2: 540 MB) had cost each start 0.6 s, and as much again in a VM for
    the fresh memory the copies took."""
    try:
        meta = json.loads((entry / "meta.json").read_text(encoding="utf-8"))
        if meta.get("version") != CACHE_VERSION:
            return None
        config = LlamaConfig(**meta["config"])
        weights = map_tensors(entry / "weights.safetensors")
        expected = expected_shapes(config)
        if {k: v.shape for k, v in weights.items()} != expected or any(w.dtype != np.float32 for w in weights.values()):
            return None
        codes = _read_codes(entry / "codes.safetensors", weights)
        tokenizer = HFTokenizer.from_state((entry / "tokenizer.json").read_text(encoding="utf-8"), meta["tokenizer"])
        return LoadedModel(name=meta["name"], config=config, weights=weights, tokenizer=tokenizer,
                           chat_template=meta["chat_template"], special_tokens=meta["special_tokens"],
                           source=meta["source"], block_codes=codes)
    except Exception as e:  # a damaged or foreign entry: reload from the file
        log.warning("ignoring unreadable cache entry %s: %s", entry, one_line(e))
        return None


CODE_PARTS = ("codes", "d", "m")


def _read_codes(path: Path, weights: dict[str, np.ndarray]) -> dict[str, block_codes.BlockCodes]:
    """The entry's block codes by weight name, mapped as the weights are; ValueError when they
    do not fit the weights."""
    parts: dict[str, dict[str, np.ndarray]] = {}
    for key, array in map_tensors(path).items():
        name, _, part = key.rpartition("/")
        parts.setdefault(name, {})[part] = array
    codes = {}
    for name, found in parts.items():
        if set(found) != set(CODE_PARTS) or name not in weights:
            raise ValueError(f"codes.safetensors: bad entry {name!r}")
        c = block_codes.BlockCodes(*(found[p] for p in CODE_PARTS))
        o, i = weights[name].shape
        scales = (o, i // block_codes.BLOCK)
        if (c.codes.shape != (o, i) or c.codes.dtype not in (np.uint8, np.int8) or c.d.shape != scales
                or c.m.shape != scales or c.d.dtype != np.float32 or c.m.dtype != np.float32):
            raise ValueError(f"codes.safetensors: {name}'s codes do not fit its weight")
        codes[name] = c
    return codes


def _find_codes(weights: dict[str, np.ndarray], progress=None) -> dict[str, block_codes.BlockCodes]:
    """Every matrix's exact block codes, where it has them."""
    matrices = [name for name, w in weights.items() if w.ndim == 2]
    each = progress.each("model", "finding the weights' block codes", matrices) if progress is not None else matrices
    return {name: c for name in each if (c := block_codes.find(weights[name])) is not None}


def _cache_write(root: Path, key: str, model: LoadedModel, real: str) -> None:
    from safetensors.numpy import save_file

    final = root / key
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=root))
        try:
            save_file(model.weights, str(tmp / "weights.safetensors"))
            save_file({f"{name}/{part}": getattr(c, part) for name, c in (model.block_codes or {}).items()
                       for part in CODE_PARTS}, str(tmp / "codes.safetensors"))
            (tmp / "tokenizer.json").write_text(model.tokenizer.to_json(), encoding="utf-8")
            meta = {"version": CACHE_VERSION, "realpath": real, "name": model.name, "config": asdict(model.config),
                    "chat_template": model.chat_template, "special_tokens": model.special_tokens,
                    "source": model.source, "tokenizer": model.tokenizer.state()}
            (tmp / "meta.json").write_text(json.dumps(meta), encoding="utf-8")
            if final.exists():
                shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        log.warning("cannot write the model cache under %s: %s", root, one_line(e))
        return
    # Older entries for the same file are stale now.
    for other in root.iterdir():
        if other.name == key or other.name.startswith("."):
            continue
        try:
            if json.loads((other / "meta.json").read_text(encoding="utf-8")).get("realpath") == real:
                shutil.rmtree(other, ignore_errors=True)
        except (OSError, ValueError):
            continue


def load_gguf(path: str | os.PathLike, *, cache: bool | None = None, cache_dir: str | os.PathLike | None = None,
              progress=None) -> LoadedModel:
    """Loads a llama GGUF file; raises ModelLoadError with a one-line message on any problem.

    cache: None uses the cache for files of CACHE_MIN_BYTES or more unless POOT_NO_CACHE is
    set; True/False force it. cache_dir overrides the cache root (see the module docstring).
    progress: an engine.progress.Progress told what the load is doing.
    """
    path = Path(path).expanduser()
    model = _load_gguf(path, cache, cache_dir, progress)
    # Served under its file name: general.name is free text ("Smollm2 135M 8k ..."), the file
    # name is what a user chose and can type.
    model.name = path.stem
    return model


def _load_gguf(path: Path, cache: bool | None, cache_dir, progress) -> LoadedModel:
    try:
        size = path.stat().st_size if path.is_file() else 0
    except OSError:
        size = 0
    if cache is None:
        cache = size >= CACHE_MIN_BYTES and os.environ.get("POOT_NO_CACHE", "") in ("", "0")
    if not cache or size == 0:
        return _read_model(path, progress)

    root = (Path(cache_dir).expanduser() if cache_dir is not None else cache_root()) / "gguf"
    try:
        key = _cache_key(path)
    except OSError:
        return _read_model(path, progress)
    if (root / key / "meta.json").is_file():
        if progress is not None:
            progress.report("model", f"reading the cached weights of {path.name}")
        model = _cache_read(root / key)
        if model is not None:
            model.source = str(path)
            return model
    model = _read_model(path, progress)
    if model.config.family == "llama":  # the cache's layout is the llama family's
        model.block_codes = _find_codes(model.weights, progress)
        if progress is not None:
            progress.report("model", f"writing the float32 cache of {path.name}")
        _cache_write(root, key, model, str(path.resolve()))
    return model
