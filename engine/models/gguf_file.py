"""Reading a GGUF file (llama.cpp's format), whatever family it holds: the checked reader,
its metadata as Python values, one tensor dequantized to float32, and the tokenizer's
vocabulary. Every problem with the file is a ModelLoadError naming it: model files are
untrusted input."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import numpy as np

from .base import ModelLoadError
from .block_codes import BLOCK, BlockCodes
from .hf_tokenizer import GGUFVocab

log = logging.getLogger(__name__)


def one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text or type(e).__name__


def open_reader(path: Path):
    """A gguf.GGUFReader for the file, or ModelLoadError naming what is wrong with it."""
    import gguf

    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise ModelLoadError(f"model file not found: {path}") from None
    except OSError as e:
        raise ModelLoadError(f"cannot read model file {path}: {one_line(e)}") from None
    if not path.is_file():
        raise ModelLoadError(f"model path is not a file: {path}")
    if size == 0:
        raise ModelLoadError(f"model file is empty: {path}")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelLoadError(f"cannot read model file {path}: {one_line(e)}") from None
    if magic != b"GGUF":
        raise ModelLoadError(f"not a GGUF file (bad magic {magic!r}): {path}")
    try:
        try:
            reader = _fast_reader_class()(str(path), "r")
        except (TypeError, AttributeError):  # a gguf-py whose private reader API changed
            reader = gguf.GGUFReader(str(path), "r")
    except Exception as e:
        # gguf-py's own message (a numpy view or index error) says nothing useful to a user.
        log.debug("GGUFReader failed on %s: %s", path, one_line(e))
        detail = one_line(e).strip("'\"")
        if "version" in detail.lower():
            raise ModelLoadError(f"unsupported GGUF version in {path}: {detail}") from None
        if "duplicate" in detail.lower() or "alignment" in detail.lower():
            raise ModelLoadError(f"corrupt GGUF file {path}: {detail}") from None
        raise ModelLoadError(f"truncated or corrupt GGUF file {path}: the header describes more than "
                             f"its {size} bytes hold") from None
    if reader.byte_order != "I":
        raise ModelLoadError(f"big-endian GGUF files are not supported: {path}")
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ModelLoadError(f"truncated GGUF file {path}: tensor {t.name} ends past the end of the file")
    return reader


@functools.cache
def _fast_reader_class():
    import gguf

    class FastReader(gguf.GGUFReader):
        """GGUFReader that slices a plain ndarray view of its memmap: np.memmap's per-slice
        overhead makes parsing a 50k-token vocabulary take seconds otherwise."""

        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain_view")
            if plain is None:
                plain = self._plain_view = self.data.view(np.ndarray)
            count = int(count)
            dt = np.dtype(dtype)
            arr = plain[offset : offset + dt.itemsize * count].view(dt)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    return FastReader


def _field_value(field):
    """A metadata field as a Python value (str, int, float, bool, or a list of them)."""
    from gguf import GGUFValueType as V

    types = field.types
    if not types:
        return None
    if types[0] == V.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    if types[0] == V.ARRAY:
        if len(types) != 2:
            return None  # nested arrays: nothing the loader reads
        if types[1] == V.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        if not field.data:
            return []
        return np.concatenate([field.parts[i] for i in field.data]).tolist()
    return field.parts[field.data[0]].tolist()[0]


def metadata(reader) -> dict:
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            out[key] = _field_value(field)
        except Exception as e:
            raise ModelLoadError(f"corrupt GGUF metadata value {key}: {one_line(e)}") from None
    return out


def dequantize_tensor(tensor) -> np.ndarray:
    """One reader tensor as a float32 C-contiguous array of shape (rows, ..., cols), that is
    the gguf shape reversed ([out, in] for matrices); never a view of the file."""
    import gguf

    Q = gguf.GGMLQuantizationType
    kind = tensor.tensor_type
    data = np.asarray(tensor.data)
    if kind == Q.F32:
        out = np.array(data, dtype=np.float32, copy=True)
    elif kind in (Q.F16, Q.F64):
        out = data.astype(np.float32)
    else:
        out = gguf.quants.dequantize(data, kind)
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    return np.ascontiguousarray(out, dtype=np.float32).reshape(shape)


# Block types whose codes a step's integer products read as the file stores them.
CODED_TYPES = ("Q4_0", "Q4_1", "Q8_0")


def tensor_codes(tensor) -> BlockCodes | None:
    """A Q4_0, Q4_1 or Q8_0 matrix's block codes as the file holds them, read without
    dequantizing: their values, fl(d q) + m, are bit for bit what dequantize_tensor gives (d and
    m are float16 and q has at most 8 bits, so d q is exact; Q4_0's q - 8 is q with m = -8 d).
    None for any other type or shape."""
    kind = tensor.tensor_type.name
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    if kind not in CODED_TYPES or len(shape) != 2 or shape[1] % BLOCK:
        return None
    rows, cols = shape
    blocks = np.asarray(tensor.data).reshape(rows, cols // BLOCK, -1)
    d = np.ascontiguousarray(blocks[:, :, 0:2]).view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q8_0":
        codes = np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(rows, cols)
        return BlockCodes(codes, d, np.zeros_like(d))
    first = 4 if kind == "Q4_1" else 2
    m = np.ascontiguousarray(blocks[:, :, 2:4]).view(np.float16)[..., 0].astype(np.float32) if kind == "Q4_1" \
        else (d * np.float32(-8)).astype(np.float32)
    packed = blocks[:, :, first:]  # byte j: code j in its low nibble, code j + 16 in its high one
    codes = np.concatenate([packed & 15, packed >> 4], axis=2).reshape(rows, cols)
    return BlockCodes(np.ascontiguousarray(codes), d, m)


def scalar(meta: dict, key: str, default=None, *, required: bool = False):
    value = meta.get(key)
    if value is None:
        if required:
            raise ModelLoadError(f"missing metadata key {key}")
        return default
    if isinstance(value, list):
        if value and all(v == value[0] for v in value):
            return value[0]  # a per-layer array with one value throughout
        raise ModelLoadError(f"metadata key {key} varies by layer, which the llama forward does not support")
    return value


def vocab(meta: dict) -> GGUFVocab:
    g = "tokenizer.ggml."

    def opt_int(key):
        v = meta.get(g + key)
        return None if v is None or isinstance(v, list) else int(v)

    model = meta.get(g + "model")
    if model is None:
        raise ModelLoadError("the file has no tokenizer (tokenizer.ggml.model is missing)")
    return GGUFVocab(
        model=str(model), tokens=meta.get(g + "tokens") or [], token_types=meta.get(g + "token_type"),
        scores=meta.get(g + "scores"), merges=meta.get(g + "merges"), pre=meta.get(g + "pre"),
        bos_id=opt_int("bos_token_id"), eos_id=opt_int("eos_token_id"), eot_id=opt_int("eot_token_id"),
        eom_id=opt_int("eom_token_id"), unk_id=opt_int("unknown_token_id"),
        add_bos=meta.get(g + "add_bos_token"), add_space_prefix=meta.get(g + "add_space_prefix"),
    )
