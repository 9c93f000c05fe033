"""Loads a Llama-family GGUF file (llama.cpp's format) into a LoadedModel.

Q4_0, Q4_1 and Q8_0 matrices are read as their block codes (gguf_file.tensor_codes), exactly
as the file stores them and never dequantized here: the model's weights are a CodedWeights
(coded_weights.py) that makes a coded weight's float32 values only when one is read by name,
and LoadedModel.block_codes names them for the CPU driver's products. The embedding keeps a
float32 copy too (a step looks its rows up). Every other tensor is dequantized to float32
with gguf-py (F32, F16, BF16, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K), and its exact codes
searched for (block_codes.find), into the canonical names and [out, in] layout of base.py.
llama.cpp's HF->GGUF converter interleaves the rotary halves of the Q and K rows; the loader
undoes it (unpermute_rows, on codes and scales alike), so the weights are in the Hugging Face
"rotate_half" layout. A file without `output.weight` has its output head tied to the embedding.

Cache: parsing a file takes seconds, so files of CACHE_MIN_BYTES (32 MiB) or more keep their
float32 weights, block codes, config and tokenizer in
    $POOT_CACHE_DIR/gguf/<key>/        (POOT_CACHE_DIR defaults to $XDG_CACHE_HOME/poot,
                                        that is ~/.cache/poot)
        weights.safetensors  codes.safetensors  tokenizer.json  meta.json
keyed by the file's real path, size, modification time and first MiB; an entry for an older
version of the same file is removed when a new one is written. weights.safetensors holds only
the float32 weights the model holds as floats (never a float32 copy of a matrix with codes,
but the embedding); codes.safetensors the codes. Both are mapped, not read, when loaded.
POOT_NO_CACHE=1 turns the cache off; load_gguf(path, cache=True/False) forces it on or off.
The default model (SmolLM2-135M) takes about 200 MB there, a Llama 3.2 1B shape 1.8 GB. A
cache entry that cannot be read is ignored and rewritten; a cache that cannot be written only
costs the next load its speed. The load that writes an entry returns the entry's mapped
weights too, so a first start holds no more memory than later ones.
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
from .block_codes import BlockCodes
from .canonical import expected_shapes
from .coded_weights import CodedWeights
from .gguf_file import dequantize_tensor, metadata, one_line, open_reader, scalar, tensor_codes, vocab
from .hf_tokenizer import HFTokenizer, tokenizer_from_gguf
from .safetensors_loader import map_tensors

log = logging.getLogger(__name__)

CACHE_VERSION = 3  # 2: the block codes beside the weights; 3: no float32 copy of a weight with codes
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
    floats, codes, dequantized = {}, {}, []
    each = progress.each("model", f"reading {path.name}", expected) if progress is not None else expected
    for canon in each:
        name = names[canon]
        heads = {".wq": config.num_heads, ".wk": config.num_kv_heads}.get(canon[-3:])
        try:
            c = tensor_codes(tensors[name])
            if c is None:
                w = dequantize_tensor(tensors[name])
        except Exception as e:
            raise ModelLoadError(f"cannot read tensor {name} ({tensors[name].tensor_type.name}): {one_line(e)}") from None
        if c is not None:
            codes[canon] = c if heads is None else BlockCodes(*(unpermute_rows(a, heads) for a in (c.codes, c.d, c.m)))
            if canon == "embed":  # a step looks rows up in it: kept as float32 (mapped from the cache)
                floats[canon] = codes[canon].values()
            continue
        floats[canon] = w if heads is None else unpermute_rows(w, heads)
        if w.ndim == 2:
            dequantized.append(canon)
    # Every weight that has codes is named (LoadedModel.block_codes): the dequantized ones
    # (K-quants, float16 ...) are searched, as exact codes of them are rare but possible.
    each = progress.each("model", "finding the block codes of dequantized weights", dequantized) \
        if progress is not None and dequantized else dequantized
    codes |= {canon: c for canon in each if (c := block_codes.find(floats[canon])) is not None}
    template = meta.get("tokenizer.chat_template")
    return LoadedModel(
        name=str(meta.get("general.name") or path.stem), config=config,
        weights=CodedWeights({n: floats[n] for n in floats if n not in codes or n == "embed"}, codes, list(expected)),
        tokenizer=tokenizer, chat_template=template if isinstance(template, str) else None, special_tokens=special,
        source=str(path), block_codes=codes,
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
        expected = expected_shapes(config)
        floats = map_tensors(entry / "weights.safetensors")
        codes = _read_codes(entry / "codes.safetensors", expected)
        if set(floats) | set(codes) != set(expected) or any(
                w.shape != expected[n] or w.dtype != np.float32 for n, w in floats.items()):
            return None
        weights = CodedWeights(floats, codes, list(expected))
        tokenizer = HFTokenizer.from_state((entry / "tokenizer.json").read_text(encoding="utf-8"), meta["tokenizer"])
        return LoadedModel(name=meta["name"], config=config, weights=weights, tokenizer=tokenizer,
                           chat_template=meta["chat_template"], special_tokens=meta["special_tokens"],
                           source=meta["source"], block_codes=codes)
    except Exception as e:  # a damaged or foreign entry: reload from the file
        log.warning("ignoring unreadable cache entry %s: %s", entry, one_line(e))
        return None


CODE_PARTS = ("codes", "d", "m")


def _read_codes(path: Path, shapes: dict[str, tuple[int, ...]]) -> dict[str, block_codes.BlockCodes]:
    """The entry's block codes by weight name, mapped as the weights are; ValueError when they
    do not fit the weights' shapes."""
    parts: dict[str, dict[str, np.ndarray]] = {}
    for key, array in map_tensors(path).items():
        name, _, part = key.rpartition("/")
        parts.setdefault(name, {})[part] = array
    codes = {}
    for name, found in parts.items():
        if set(found) != set(CODE_PARTS) or name not in shapes:
            raise ValueError(f"codes.safetensors: bad entry {name!r}")
        c = block_codes.BlockCodes(*(found[p] for p in CODE_PARTS))
        o, i = shapes[name]
        scales = (o, i // block_codes.BLOCK)
        if (c.codes.shape != (o, i) or c.codes.dtype not in (np.uint8, np.int8) or c.d.shape != scales
                or c.m.shape != scales or c.d.dtype != np.float32 or c.m.dtype != np.float32):
            raise ValueError(f"codes.safetensors: {name}'s codes do not fit its weight")
        codes[name] = c
    return codes


def _cache_write(root: Path, key: str, model: LoadedModel, real: str) -> None:
    from safetensors.numpy import save_file

    final = root / key
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=root))
        try:
            weights = model.weights
            save_file(dict(weights.floats) if isinstance(weights, CodedWeights) else dict(weights),
                      str(tmp / "weights.safetensors"))
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
        if progress is not None:
            progress.report("model", f"writing the cache of {path.name}")
        _cache_write(root, key, model, str(path.resolve()))
        # Served from the entry just written, mapped as on every later start: the float32
        # copies made here (4.7 GB at Llama 3.2 1B's shape) are not kept for the process's life.
        written = _cache_read(root / key) if (root / key / "meta.json").is_file() else None
        if written is not None:
            written.source = str(path)
            return written
    return model
