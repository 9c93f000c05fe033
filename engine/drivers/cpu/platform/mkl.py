"""Weight products on Intel oneMKL's packed GEMM, for the CPU driver's steps of more tokens
than its few-token kernel takes (13 and up: many decoding rows, prefill chunks).

Why MKL, and why packed: OpenBLAS (NumPy's BLAS) repacks the whole weight matrix into its
panel layout on every call, so a 32-column product with a 576-wide input reads and writes
the weights a second time; on SmolLM2's shapes it reached 110-210 GFLOP/s at 32 tokens,
against 290-320 for MKL computing from weights packed once, when the driver prepares
(`cblas_sgemm_pack`, then `cblas_sgemm_compute` every step).

MKL runs on GNU OpenMP here (`MKL_Set_Threading_Layer`), the runtime numba's kernels use:
one pool of threads for the whole step. Two pools on two cores each spin for a while after
their work and slow the other down (a step mixing OpenBLAS products and numba's threads ran
up to 4x slower).

The library comes from the `mkl` wheel (Linux x86-64); without it `available()` is False and
the driver keeps NumPy's BLAS for these products.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import mmap
import threading

import numpy as np

from .. import target

_ROW_MAJOR, _NO_TRANS, _TRANS, _A_MATRIX, _B_MATRIX, _PACKED = 101, 111, 112, 161, 162, 151
_THREADING_GNU = 3
# Products run on a multiple of this many columns (zero-padded): MKL's packed products are
# uneven across column counts, fastest at multiples of 16 (measured on SmolLM2's layer
# shapes: 76 columns ran at 70-125 GFLOP/s, 80 at 170-175, 96 at 200-260).
PAD_TOKENS = 16
# Below this many weights a product is too small for packing to pay (and tiny test models
# would pack thousands of matrices).
MIN_PACKED_WEIGHTS = 1 << 16

# What MKL may dispatch to when the kernels are held to fewer instruction sets (target.py's
# modes): MKL picks its code by the CPU, not by numba's target, so on an AVX-512 host held to
# AVX2 it would otherwise run its AVX-512 GEMM (2048^3 on a 2-core Xeon: 326 GFLOP/s, 205 held
# to AVX2, 77 to SSE4.2). mkl_service.h's MKL_ENABLE_SSE4_2 and MKL_ENABLE_AVX2.
_ENABLE = {"x86-64": 0, "avx2": 2}

# The code branches MKL names (mkl_cbwr.h's MKL_CBWR_* values), by name. On a CPU that is not
# Intel's MKL names none of its own: its dispatcher answers MKL_CBWR_AUTO ("auto"), and
# MKL_Enable_Instructions refuses every request (an AMD EPYC Zen 3 with MKL 2026.2: its own
# sgemm ran as fast as OpenBLAS's there, 72 against 74 GFLOP/s; the generic branch, forced
# with MKL_CBWR=COMPATIBLE, at a third of that).
BRANCHES = {2: "auto", 3: "compatible", 4: "sse2", 6: "ssse3", 7: "sse4_1", 8: "sse4_2", 9: "avx", 10: "avx2",
            12: "avx512", 14: "avx512_e1"}
_AUTO, _CNR_BRANCH = 2, 1
# The branches each held mode's instruction sets cover: a mode whose MKL dispatches past them,
# or cannot be held at all, has no MKL products (the products of many tokens then run on the
# integer, block and OpenBLAS paths, which the mode does hold).
_WITHIN = {"x86-64": ("compatible", "sse2", "ssse3", "sse4_1", "sse4_2")}
_WITHIN["avx2"] = (*_WITHIN["x86-64"], "avx", "avx2")

_lib = None
_isa: str | None = None  # the mode MKL was held to when it loaded
_error: str | None = None
_lock = threading.Lock()


def _find_library() -> str:
    try:
        files = importlib.metadata.files("mkl") or []
    except importlib.metadata.PackageNotFoundError:
        raise OSError("the mkl package is not installed") from None
    for f in files:
        if f.name.startswith("libmkl_rt.so"):
            return str(f.locate())
    raise OSError("the mkl package has no libmkl_rt")


def hold(lib, isa: str) -> bool:
    """Asks MKL to keep to the instruction sets of `isa` (a held mode); whether it agreed."""
    lib.MKL_Enable_Instructions.argtypes = [ctypes.c_int]
    return lib.MKL_Enable_Instructions(_ENABLE[isa]) == 1


def _load(isa: str):
    lib = ctypes.CDLL(_find_library())
    # Before any other MKL call: the threading layer and the instruction sets are chosen once, at the first one.
    lib.MKL_Set_Threading_Layer.argtypes = [ctypes.c_int]
    lib.MKL_Set_Threading_Layer(_THREADING_GNU)
    if isa in _ENABLE:
        if not hold(lib, isa):
            raise RuntimeError(f"MKL refused to keep to {isa} (it does on CPUs that are not Intel's)")
        branch = _branch(lib)
        if branch not in _WITHIN[isa]:
            raise RuntimeError(f"MKL kept to {isa} but dispatches to its {branch} code")
    c_int, c_ptr, c_float = ctypes.c_int, ctypes.c_void_p, ctypes.c_float
    lib.cblas_sgemm_pack_get_size.restype = ctypes.c_size_t
    lib.cblas_sgemm_pack_get_size.argtypes = [c_int] * 4
    lib.cblas_sgemm_pack.argtypes = [c_int] * 6 + [c_float, c_ptr, c_int, c_ptr]
    lib.cblas_sgemm_compute.argtypes = [c_int] * 6 + [c_ptr, c_int, c_ptr, c_int, c_float, c_ptr, c_int]
    lib.cblas_sgemm.argtypes = [c_int] * 6 + [c_float, c_ptr, c_int, c_ptr, c_int, c_float, c_ptr, c_int]
    lib.cblas_sgemm_batch_strided.argtypes = ([c_int] * 6 + [c_float] + [c_ptr, c_int, c_int] * 2
                                              + [c_float, c_ptr, c_int, c_int, c_int])
    return lib


def _branch(lib) -> str:
    """The code MKL runs: the branch MKL_CBWR forces, where it forces one MKL took, else the
    one its dispatcher picks for this CPU."""
    lib.MKL_CBWR_Get.argtypes = [ctypes.c_int]
    forced = lib.MKL_CBWR_Get(_CNR_BRANCH)
    branch = forced if forced > _AUTO else lib.MKL_CBWR_Get_Auto_Branch()
    return BRANCHES.get(branch, f"branch {branch}")


def available(isa: str | None = None) -> bool:
    """Loads MKL once per process, held to the instruction sets of `isa` (target.py's modes;
    None: POOT_CPU_ISA's), and checks it on a known product. MKL fixes them at its first call,
    so a later call asking for another mode than the first gets False."""
    global _lib, _isa, _error
    isa = target.requested(isa)
    with _lock:
        if _lib is None and _error is None:
            try:
                _lib, _isa = _load(isa), isa
                _smoke()
            except Exception as exc:  # no wheel, an unloadable library, a wrong result
                _lib = None
                _error = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return _lib is not None and _isa == isa


def dispatched() -> str:
    """The code MKL runs in this process (BRANCHES' names), once loaded."""
    if _lib is None:
        raise RuntimeError("MKL is not loaded")
    return _branch(_lib)


def unavailable_reason(isa: str | None = None) -> str:
    if available(isa):
        return ""
    return f"MKL products unavailable: {_error or f'MKL was loaded for {_isa}, not {target.requested(isa)}'}"


def _smoke() -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((40, 24), dtype=np.float32)
    x = rng.standard_normal((24, 17), dtype=np.float32)
    out = matmul(PackedWeight(w), x)
    if not np.allclose(out, w @ x, atol=1e-4):
        raise RuntimeError("packed products gave wrong results on a known input")


def _pack_buffer(nbytes: int) -> np.ndarray:
    """Room for one packed weight, in pages the kernel never merges into huge pages.

    MKL asks for 2-3.4x the weight's size (SmolLM2's shapes) and writes about the weight's
    size. In memory eligible for transparent huge pages (NumPy advises them for its arrays of
    4 MiB and more), khugepaged fills in each partly written 2 MiB region over the first
    minutes of serving: SmolLM2's server grew about 210 MB in its first 11 minutes under
    load, then stopped. With small pages only what MKL wrote stays resident; decode and
    prefill steps timed the same either way."""
    mm = mmap.mmap(-1, max(4, -(-nbytes // 4) * 4))
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux
        mm.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(mm, np.float32)  # keeps the mapping alive as its base


class PackedWeight:
    """A weight matrix w (o, i) in MKL's packed layout, for products w @ x with any number
    of columns, or with `right` for (w @ x).T = x.T @ w.T, whose result comes out token-major
    (the output head: logits are returned one row per token). Holds its own copy: w may be
    freed or changed afterwards."""

    __slots__ = ("shape", "buffer", "right")

    def __init__(self, w: np.ndarray, right: bool = False):
        w = np.ascontiguousarray(w, dtype=np.float32)
        o, i = w.shape
        if right:  # w.T as the right-hand matrix (i, o): packed from w read transposed
            size = _lib.cblas_sgemm_pack_get_size(_B_MATRIX, 1, o, i)
            self.buffer = _pack_buffer(size)
            _lib.cblas_sgemm_pack(_ROW_MAJOR, _B_MATRIX, _TRANS, 1, o, i, 1.0, w.ctypes.data, i,
                                  self.buffer.ctypes.data)
        else:
            size = _lib.cblas_sgemm_pack_get_size(_A_MATRIX, o, 1, i)
            self.buffer = _pack_buffer(size)
            _lib.cblas_sgemm_pack(_ROW_MAJOR, _A_MATRIX, _NO_TRANS, o, 1, i, 1.0, w.ctypes.data, i,
                                  self.buffer.ctypes.data)
        self.shape = (o, i)
        self.right = right


def matmul(w: PackedWeight, x: np.ndarray) -> np.ndarray:
    """w @ x for x (i, T) float32; returns (o, T), a view of a wider array when T was padded."""
    o, i = w.shape
    tokens = x.shape[1]
    if tokens == 0:  # MKL rejects a zero leading dimension
        return np.empty((o, 0), np.float32)
    b, trans, ldb, width = _columns(x)
    out = np.empty((o, width), np.float32)
    _lib.cblas_sgemm_compute(_ROW_MAJOR, _PACKED, trans, o, width, i, w.buffer.ctypes.data, i,
                             b.ctypes.data, ldb, 0.0, out.ctypes.data, width)
    return out[:, :tokens]


def matmul_token_major(w: PackedWeight, x: np.ndarray) -> np.ndarray:
    """(w @ x).T as a C-contiguous (T, o) array, for w packed with `right`; x (i, T)."""
    o, i = w.shape
    tokens = x.shape[1]
    if tokens == 0:
        return np.empty((0, o), np.float32)
    b, trans, ldb, width = _columns(x)
    out = np.empty((width, o), np.float32)
    # x.T is the left matrix: x's transpose flag flips (a feature-major x is read transposed).
    _lib.cblas_sgemm_compute(_ROW_MAJOR, _NO_TRANS if trans == _TRANS else _TRANS, _PACKED, width, o, i,
                             b.ctypes.data, ldb, w.buffer.ctypes.data, o, 0.0, out.ctypes.data, o)
    return out[:tokens]


def matmul_add(w: PackedWeight, x: np.ndarray, acc: np.ndarray) -> None:
    """acc += w @ x, in place on acc (o, T). MKL adds into acc itself (no result array, no
    separate pass) when acc is contiguous and T needs no padding."""
    tokens = x.shape[1]
    if tokens == 0:
        return
    b, trans, ldb, width = _columns(x)
    if width != tokens or not acc.flags.c_contiguous or acc.dtype != np.float32:
        acc += matmul(w, x)
        return
    o, i = w.shape
    _lib.cblas_sgemm_compute(_ROW_MAJOR, _PACKED, trans, o, width, i, w.buffer.ctypes.data, i,
                             b.ctypes.data, ldb, 1.0, acc.ctypes.data, width)


def _columns(x: np.ndarray):
    """The right operand (i, T) as cblas takes it: (array, transpose flag, leading
    dimension, width), the width T rounded up to PAD_TOKENS with zero columns. A
    transposed view of a token-major array is read as it lies (no transposing copy)."""
    i, tokens = x.shape
    width = -(-tokens // PAD_TOKENS) * PAD_TOKENS
    token_major = x.dtype == np.float32 and x.T.flags.c_contiguous and not x.flags.c_contiguous
    if width == tokens:
        if token_major:
            return x.T, _TRANS, i, width
        x = np.ascontiguousarray(x, dtype=np.float32)
        return x, _NO_TRANS, width, width
    if token_major:  # pad along the contiguous axis: a plain copy, not a transposing one
        padded = np.zeros((width, i), np.float32)
        padded[:tokens] = x.T
        return padded, _TRANS, i, width
    padded = np.zeros((i, width), np.float32)
    padded[:, :tokens] = x
    return padded, _NO_TRANS, width, width


def batched_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b for float32 stacks a (n, m, k) and b (n, k, p), in one MKL call for the whole
    stack (one start of the thread team, not one per item), so that no OpenBLAS thread runs
    inside a step. Either operand may be a view: items that are plain or transposed
    matrices with any row spacing, spaced evenly (a head's keys up to a tile's end, out of
    its whole context), are read in place."""
    n, m, k = a.shape
    p = b.shape[2]
    out = np.empty((n, m, p), np.float32)
    if n == 0 or m == 0 or p == 0:
        return out
    if k == 0:
        out[...] = 0
        return out
    a, trans_a, lda, stride_a = _operand(a)
    b, trans_b, ldb, stride_b = _operand(b)
    _lib.cblas_sgemm_batch_strided(_ROW_MAJOR, trans_a, trans_b, m, p, k, 1.0, a.ctypes.data, lda, stride_a,
                                   b.ctypes.data, ldb, stride_b, 0.0, out.ctypes.data, p, m * p, n)
    return out


def _operand(x: np.ndarray):
    """A stack of row-major matrices for cblas: x itself when each item is a plain or a
    transposed matrix with unit steps along its rows, else a contiguous copy; with the
    transpose flag, the leading dimension and the spacing of the items, in elements."""
    size = np.dtype(np.float32).itemsize
    if x.dtype == np.float32 and all(st % size == 0 for st in x.strides):
        batch, rows, cols = (st // size for st in x.strides)
        if cols == 1 and rows >= max(1, x.shape[2]) and batch >= 0:
            return x, _NO_TRANS, rows, batch
        if rows == 1 and cols >= max(1, x.shape[1]) and batch >= 0:
            return x, _TRANS, cols, batch
    x = np.ascontiguousarray(x, dtype=np.float32)
    return x, _NO_TRANS, x.shape[2], x.shape[1] * x.shape[2]
