"""What every path of a matrix on block codes starts from: the codes as unsigned bytes with
their block scales (`Codes`), and the activations quantized to 16 bits per block of 32
(`Quantized`, kernels/quantize.py), so whichever path a step's token count runs on, a token's
result is the same to float32 rounding (~1e-6), and greedy output cannot depend on what else
shares the step (determinism/batch/1) or on whether a prefix came from the cache."""

from __future__ import annotations

import numpy as np

BLOCK = 32
SHIFT = 128  # a signed code plus this is an unsigned byte (the integer paths multiply unsigned codes)


def unsigned(codes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(u, d, m') with u unsigned bytes: a signed code is shifted by SHIFT and m' = m - SHIFT d
    takes the shift back (exact: SHIFT is a power of two)."""
    if codes.codes.dtype == np.uint8:
        return codes.codes, codes.d, codes.m
    u = (codes.codes.astype(np.int16) + SHIFT).astype(np.uint8)
    return u, codes.d, (codes.m - np.float32(SHIFT) * codes.d).astype(np.float32)


class Codes:
    """One matrix's block codes as its paths take them (engine/models/block_codes.py's
    BlockCodes, made unsigned), and the column scale its input takes (the RMSNorm weight the
    float32 path folds into the matrix; folding it into codes would break the blocks)."""

    __slots__ = ("u", "d", "m", "colscale", "shape", "_source")

    def __init__(self, codes, colscale: np.ndarray | None):
        self.u, self.d, self.m = unsigned(codes)
        self.shape = self.u.shape
        self.colscale = np.ones(self.shape[1], np.float32) if colscale is None \
            else np.ascontiguousarray(colscale, np.float32)
        self._source = codes

    def values(self) -> np.ndarray:
        """The codes' float32 values, unfolded (for the float paths)."""
        return self._source.values()


class Quantized:
    """A product's input as every path on block codes takes it: x (i, T) quantized to 16 bits
    per block of 32, v = 256 qh + ql, with each block's scale dx and c = dx * sum(v)."""

    __slots__ = ("qh", "ql", "dx", "c", "_values", "_kernels")

    def __init__(self, x: np.ndarray, colscale: np.ndarray, kernels):
        i, tokens = x.shape
        self.qh = np.empty((tokens, i), np.int8)
        self.ql = np.empty((tokens, i), np.int8)
        self.dx = np.empty((tokens, i // BLOCK), np.float32)
        self.c = np.empty((tokens, i // BLOCK), np.float32)
        self._kernels = kernels  # kernels/quantize.py
        kernels.quantize(np.ascontiguousarray(x, dtype=np.float32), colscale, self.qh, self.ql, self.dx, self.c)
        self._values = None

    def values(self) -> np.ndarray:
        """The quantized activations as float32 (i, T), for the float paths."""
        if self._values is None:
            tokens, i = self.qh.shape
            self._values = np.empty((i, tokens), np.float32)
            self._kernels.dequantize(self.qh, self.ql, self.dx, self._values)
        return self._values
