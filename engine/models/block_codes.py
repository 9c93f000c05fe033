"""Finds a float32 matrix's exact block-quantized form, when it has one.

A GGUF's quantized tensors are dequantized to float32 at load (gguf_loader); a Q4_1 block of
32 weights along a row becomes fl(d * q) + m, q in 0..15, and a Q8_0 block fl(q * d), q in
-127..127, with d and m float16. Those float32 values are all a step needs, but read as
float32 they are 4 bytes a weight where the codes are one. This module recovers codes and
per-block (d, m) from the float32 values themselves, so it works whatever the load path
(the GGUF or the float32 cache of it), and checks every weight: a matrix is returned only
when fl(d * q) + m gives back each of its float32 values bit for bit, else None.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BLOCK = 32  # weights per block along a row (GGUF's Q4_0/Q4_1/Q5_x/Q8_0 blocks)
PROBE_ROWS = 16


@dataclass(slots=True)
class BlockCodes:
    """w[r, b * BLOCK + j] == fl(d[r, b] * codes[r, b * BLOCK + j]) + m[r, b] (float32)."""

    codes: np.ndarray  # (o, i) uint8 (0..15) or int8 (-127..127)
    d: np.ndarray  # (o, i / BLOCK) float32
    m: np.ndarray  # (o, i / BLOCK) float32; zeros for symmetric codes

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.d.nbytes + self.m.nbytes

    def rows(self, order: np.ndarray) -> BlockCodes:
        return BlockCodes(self.codes[order], self.d[order], self.m[order])

    def scaled(self, s: float) -> BlockCodes:
        """Every value times s (exact when s is a power of two)."""
        return BlockCodes(self.codes, (self.d * np.float32(s)).astype(np.float32),
                          (self.m * np.float32(s)).astype(np.float32))

    def values(self) -> np.ndarray:
        o, i = self.codes.shape
        q = self.codes.reshape(o, i // BLOCK, BLOCK).astype(np.float32)
        return (q * self.d[:, :, None] + self.m[:, :, None]).reshape(o, i)


def concat(parts: list[BlockCodes]) -> BlockCodes | None:
    if len({p.codes.dtype for p in parts}) != 1:
        return None
    return BlockCodes(*(np.ascontiguousarray(np.concatenate([getattr(p, f) for p in parts]))
                        for f in ("codes", "d", "m")))


def find(w: np.ndarray) -> BlockCodes | None:
    """The matrix's exact 4-bit affine (Q4_1-like) or 8-bit symmetric (Q8_0-like) block
    form, or None (a float32 matrix from anywhere else: no codes reproduce it)."""
    if w.ndim != 2 or w.dtype != np.float32 or w.shape[1] % BLOCK or not np.all(np.isfinite(w)):
        return None
    o, i = w.shape
    blocks = w.reshape(o, i // BLOCK, BLOCK)
    for form in (_affine, _symmetric):
        # The first rows first: a matrix of the other form (or none) fails there cheaply.
        head = blocks[:PROBE_ROWS]
        if form(head, head.min(axis=2), head.max(axis=2)) is None:
            continue
        found = form(blocks, blocks.min(axis=2), blocks.max(axis=2))
        if found is not None:
            return found
    return None


def _half(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).astype(np.float32)


def _affine(blocks, lo, hi) -> BlockCodes | None:
    """value = fl(d q) + m, q in 0..15: m is the block's minimum (its q is 0), d ~ range / 15."""
    m = lo
    d = _half((hi - lo) / np.float32(15))
    safe = np.where(d == 0, np.float32(1), d)
    q = np.rint((blocks - m[:, :, None]) / safe[:, :, None])
    if q.min() < 0 or q.max() > 15:
        return None
    if not np.array_equal(q * d[:, :, None] + m[:, :, None], blocks):
        return None
    return BlockCodes(q.astype(np.uint8).reshape(blocks.shape[0], -1), d, m)


def _symmetric(blocks, lo, hi) -> BlockCodes | None:
    """value = fl(q d), q in -127..127: d ~ max |value| / 127."""
    d = _half(np.maximum(-lo, hi) / np.float32(127))
    safe = np.where(d == 0, np.float32(1), d)
    q = np.rint(blocks / safe[:, :, None])
    if q.min() < -127 or q.max() > 127:
        return None
    if not np.array_equal(q * d[:, :, None], blocks):
        return None
    return BlockCodes(q.astype(np.int8).reshape(blocks.shape[0], -1), d, np.zeros_like(d))
