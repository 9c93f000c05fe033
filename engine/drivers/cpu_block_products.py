"""Products on a matrix's block codes (engine/models/block_codes.py): one byte a weight and a
(d, m) pair per 32, where float32 takes four bytes a weight.

Every path takes the same input: the activations quantized to 16 bits per block of 32
(cpu_int8_kernels.quantize), so whichever path a step's token count runs on, a token's result
is the same to float32 rounding (~1e-6), and greedy output cannot depend on what else shares
the step (determinism/batch/1) or on whether a prefix came from the cache.

    int8      integer dot products (AVX-512 VNNI) on the codes   cpu_int8_kernels
    blocks    the codes widened to float32, one block at a time  cpu_block_kernels
    mkl       MKL's packed GEMM on the codes' float32 values      mkl_products
    openblas  NumPy's BLAS on the codes' float32 values

Which path runs for how many tokens is measured when the driver prepares (cpu_product_choice);
`table` holds the choice. Measured on SmolLM2-135M (2-core Zen 4): the products of a one-token
step take 3-4 ms on int8 against 13 on blocks and 20 on float32; from about 64 tokens MKL's
float products overtake the integer ones.
"""

from __future__ import annotations

import numpy as np

from . import huge_pages, mkl_products

BLOCK = 32
PATHS = ("int8", "blocks", "mkl", "openblas")
SHIFT = 128  # a signed code plus this is an unsigned byte (vpdpbusd multiplies unsigned by signed)

# The kernel modules, imported by compile(): after cpu_kernels has chosen numba's target.
# cpu_int8_kernels' quantizer serves every path; its integer product runs only where the CPU
# has VNNI.
_int8_kernels = None
_block_kernels = None


def compile(int8: bool) -> None:
    """Builds (or loads from numba's cache) the quantizer and the block kernels, and the
    integer product when `int8` (the caller checked the CPU has VNNI), and checks them on a
    known input. Call it after cpu_kernels.compile(), which chooses numba's target and
    threading layer."""
    global _int8_kernels, _block_kernels
    from . import cpu_block_kernels, cpu_int8_kernels

    _int8_kernels, _block_kernels = cpu_int8_kernels, cpu_block_kernels
    for path in ("blocks", "int8") if int8 else ("blocks",):
        _smoke(path)


def _smoke(path: str) -> None:
    from types import SimpleNamespace

    codes = SimpleNamespace(codes=np.full((5, 64), 2, np.uint8), d=np.full((5, 2), 0.5, np.float32),
                            m=np.full((5, 2), 1.0, np.float32), values=lambda: np.full((5, 64), 2, np.float32))
    product = BlockProduct(codes, None, paths=(path,))
    out = np.full((5, 3), 1.0, np.float32)
    product.run(path, np.ones((64, 3), np.float32), out=out)
    if not np.allclose(out, 129, rtol=1e-5):
        raise RuntimeError(f"the {path} block kernels gave wrong results on a known input")


def specializations() -> int:
    modules = [m for m in (_int8_kernels, _block_kernels) if m is not None]
    return sum(len(k.signatures) for m in modules for k in m.KERNELS)


def unsigned(codes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(u, d, m') with u unsigned bytes: a signed code is shifted by SHIFT and m' = m - SHIFT d
    takes the shift back (exact: SHIFT is a power of two)."""
    if codes.codes.dtype == np.uint8:
        return codes.codes, codes.d, codes.m
    u = (codes.codes.astype(np.int16) + SHIFT).astype(np.uint8)
    return u, codes.d, (codes.m - np.float32(SHIFT) * codes.d).astype(np.float32)


class Quantized:
    """A product's input as every path takes it (see the module's docstring)."""

    __slots__ = ("qh", "ql", "dx", "c", "_values")

    def __init__(self, x: np.ndarray, colscale: np.ndarray):
        i, tokens = x.shape
        self.qh = np.empty((tokens, i), np.int8)
        self.ql = np.empty((tokens, i), np.int8)
        self.dx = np.empty((tokens, i // BLOCK), np.float32)
        self.c = np.empty((tokens, i // BLOCK), np.float32)
        _int8_kernels.quantize(np.ascontiguousarray(x, dtype=np.float32), colscale, self.qh, self.ql, self.dx,
                               self.c)
        self._values = None

    def values(self) -> np.ndarray:
        """The quantized activations as float32 (i, T), for the float paths."""
        if self._values is None:
            tokens, i = self.qh.shape
            self._values = np.empty((i, tokens), np.float32)
            _int8_kernels.dequantize(self.qh, self.ql, self.dx, self._values)
        return self._values


class BlockProduct:
    """One matrix's codes, the column scale its input takes (the RMSNorm weight the float32
    path folds into the matrix; folding it into codes would break the blocks), and the paths
    it may run. `head`: the output head, whose products return token-major logits."""

    def __init__(self, codes, colscale: np.ndarray | None, paths: tuple[str, ...] = PATHS, head: bool = False):
        self.u, self.d, self.m = unsigned(codes)
        o, i = self.u.shape
        self.shape = (o, i)
        self.head = head
        self.colscale = np.ones(i, np.float32) if colscale is None else np.ascontiguousarray(colscale, np.float32)
        if i % (2 * BLOCK):  # the integer tile takes blocks in pairs
            paths = tuple(p for p in paths if p != "int8")
        if "mkl" in paths and not mkl_products.available():
            paths = tuple(p for p in paths if p != "mkl")
        self.paths = paths
        # The integer path reads the codes in its own order (4-bit codes two a byte: a one-token
        # product is bound by the bytes it reads), its activations arranged to match.
        self.kernel_codes = self.order = None
        if "int8" in paths:
            from .cpu_int8_kernels import arrange_codes

            arranged, self.order = arrange_codes(self.u)
            self.kernel_codes = huge_pages.placed(arranged)  # a head's codes span many pages
        # The integer path reads the scales as float16 where that holds them exactly: a
        # 4-bit block is 20 bytes instead of 24 (the float paths keep float32).
        self.scales = self.lane_scales = (self.d, self.m)
        if "int8" in paths:
            from .cpu_int8_kernels import half_scales

            self.set_scales(*(half_scales(self.d, self.m) or self.scales))
        float_paths = {"mkl", "openblas"} & set(paths)
        self.values = codes.values() if float_paths else None  # the codes' float32 values, unfolded
        self.packed = mkl_products.PackedWeight(self.values, right=head) if "mkl" in paths else None
        # (most tokens, path), ascending; the fixed choice until cpu_product_choice measures one.
        first = "int8" if "int8" in paths else paths[0]
        self.table: list[tuple[int, str]] = [(1 << 30, first)]

    def set_scales(self, d: np.ndarray, m: np.ndarray) -> None:
        """The integer path's block scales (d, m as they are, or as float16 bits), and the same
        laid out in its lanes (cpu_int8_kernels.lane_scales) for its tiles of several tokens."""
        from .cpu_int8_kernels import lane_scales

        self.scales = (d, m)
        self.lane_scales = (lane_scales(d), lane_scales(m, lone=True))

    def share(self, kernel_codes: np.ndarray, scales: tuple, lane_scales: tuple, colscale: np.ndarray) -> None:
        """Moves the integer path onto the same values held elsewhere (views of a stack over
        a model's layers, cpu_layers): its own copies are freed."""
        for mine, theirs in zip((self.kernel_codes, *self.scales, *self.lane_scales, self.colscale),
                                (kernel_codes, *scales, *lane_scales, colscale), strict=True):
            if mine.shape != theirs.shape or mine.dtype != theirs.dtype:
                raise ValueError("shared arrays must match the product's own")
        self.kernel_codes, self.scales, self.lane_scales, self.colscale = kernel_codes, scales, lane_scales, colscale

    @property
    def nbytes(self) -> int:
        total = self.d.nbytes + self.m.nbytes + self.colscale.nbytes
        if self.scales[0] is not self.d:
            total += self.scales[0].nbytes + self.scales[1].nbytes
        if self.lane_scales[0] is not self.d:
            total += self.lane_scales[0].nbytes + self.lane_scales[1].nbytes
        total += sum(c.nbytes for c in (self.u, self.kernel_codes, self.order) if c is not None)
        if self.values is not None and "openblas" in self.paths:
            total += self.values.nbytes
        if self.packed is not None:
            total += self.packed.buffer.nbytes
        return total

    def bytes_read(self, tokens: int) -> int:
        """The weight bytes a product of `tokens` tokens reads on the path chosen for it."""
        path = self.path_for(tokens)
        if path == "int8":  # a lone token's tiles read the block scales, more tokens' the lanes'
            d, m = self.scales if tokens == 1 else self.lane_scales
            return self.kernel_codes.nbytes + d.nbytes + m.nbytes
        if path == "blocks":
            return self.u.nbytes + self.d.nbytes + self.m.nbytes
        return 4 * self.shape[0] * self.shape[1]

    def work(self, tokens: int) -> int:
        return self.shape[0] * self.shape[1] * tokens

    def path_for(self, tokens: int) -> str:
        for most, path in self.table:
            if tokens <= most:
                return path
        return self.table[-1][1]

    def keep_only(self, paths: set[str]) -> None:
        """Drops what the paths no chosen entry names would need (MKL's packed copy, the
        float32 values): a path that wins nowhere costs no memory."""
        self.paths = tuple(p for p in self.paths if p in paths)
        if "mkl" not in paths:
            self.packed = None
        if "blocks" not in paths:
            self.u = None  # the integer path reads its own arrangement
        if "int8" not in paths:
            self.kernel_codes = self.order = None
            self.scales = self.lane_scales = (self.d, self.m)
        if not {"openblas"} & paths:
            self.values = None

    def run(self, path: str, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The product w @ x for a feature-major x (i, T): (o, T), or (T, o) for the head;
        added into `out` when given (the residual adds). Threads: as numba is set."""
        tokens = x.shape[1]
        add = out is not None
        if path == "int8":
            if out is None:
                out = np.empty((tokens, self.shape[0]) if self.head else (self.shape[0], tokens), np.float32)
            x = np.ascontiguousarray(x, dtype=np.float32)
            _int8_kernels.int8_product(self.kernel_codes, *self.scales, *self.lane_scales, self.order, x,
                                       self.colscale, out, self.head, add)
            return out
        q = Quantized(x, self.colscale)
        if path == "blocks":
            xt = np.ascontiguousarray(q.values().T)  # the kernel reads tokens as rows
            if add and not self.head:
                _block_kernels.block_matmul(self.u, self.d, self.m, xt, q.c, out, True)
                return out
            result = np.empty((self.shape[0], tokens), np.float32)
            _block_kernels.block_matmul(self.u, self.d, self.m, xt, q.c, result, False)
        elif path == "mkl":
            if self.head:
                result = mkl_products.matmul_token_major(self.packed, q.values())
            elif add:
                mkl_products.matmul_add(self.packed, q.values(), out)
                return out
            else:
                result = mkl_products.matmul(self.packed, q.values())
        elif path == "openblas":
            result = self.values @ q.values()
        else:
            raise ValueError(f"unknown product path {path!r}")
        if self.head and result.shape[0] != tokens:
            result = np.ascontiguousarray(result.T)
        if add:
            out += result
            return out
        return result
