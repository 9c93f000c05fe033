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
# Rows are worked through in runs of about this many weights, each run's temporaries small
# enough to stay in cache between the passes over them: the whole-matrix passes, each
# writing a matrix-sized temporary to fresh memory, took 2.5-3.2 s over SmolLM2's weights
# (find) and 1.8-2.3 s (values), the runs 1.5 s and 0.4 s.
RUN_WEIGHTS = 1 << 16


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
        """The float32 values, fl(d q) + m, one run of rows at a time."""
        o, i = self.codes.shape
        out = np.empty((o, i), np.float32)
        codes, blocks = self.codes.reshape(o, -1, BLOCK), out.reshape(o, -1, BLOCK)
        for rows in _runs(o, i):
            run = blocks[rows]
            np.multiply(codes[rows], self.d[rows, :, None], out=run)
            np.add(run, self.m[rows, :, None], out=run)
        return out


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
    for form in (_Affine, _Symmetric):
        # The first rows first: a matrix of the other form (or none) fails there cheaply.
        if form.of(w[:PROBE_ROWS]) is not None and (found := form.of(w)) is not None:
            return found
    return None


def _half(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).astype(np.float32)


def _runs(rows: int, cols: int) -> list[slice]:
    step = max(1, RUN_WEIGHTS // cols)
    return [slice(r, min(r + step, rows)) for r in range(0, rows, step)]


class _Form:
    """One block form: per run of rows, the blocks' (d, m) from their least and largest
    values, the codes from (value - m) / d, checked to give back every value bit for bit."""

    dtype: type
    lowest: int
    highest: int

    @classmethod
    def of(cls, w: np.ndarray) -> BlockCodes | None:
        o, i = w.shape
        blocks = w.reshape(o, i // BLOCK, BLOCK)
        codes = np.empty((o, i // BLOCK, BLOCK), cls.dtype)
        d, m = np.empty((o, i // BLOCK), np.float32), np.empty((o, i // BLOCK), np.float32)
        runs = _runs(o, i)
        q = np.empty((runs[0].stop, i // BLOCK, BLOCK), np.float32)
        back = np.empty_like(q)
        for rows in runs:
            x = blocks[rows]
            n = x.shape[0]
            d[rows], m[rows] = cls.scales(x.min(axis=2), x.max(axis=2))
            dr, mr, qr, br = d[rows, :, None], m[rows, :, None], q[:n], back[:n]
            np.subtract(x, mr, out=qr)
            np.divide(qr, np.where(dr == 0, np.float32(1), dr), out=qr)
            np.rint(qr, out=qr)
            if qr.min() < cls.lowest or qr.max() > cls.highest:
                return None
            np.multiply(qr, dr, out=br)
            np.add(br, mr, out=br)
            if not np.array_equal(br, x):
                return None
            codes[rows] = qr
        return BlockCodes(codes.reshape(o, i), d, m)

    @staticmethod
    def scales(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError


class _Affine(_Form):
    """value = fl(d q) + m, q in 0..15: m is the block's minimum (its q is 0), d ~ range / 15."""

    dtype, lowest, highest = np.uint8, 0, 15

    @staticmethod
    def scales(lo, hi):
        return _half((hi - lo) / np.float32(15)), lo


class _Symmetric(_Form):
    """value = fl(q d) (+ 0, exactly), q in -127..127: d ~ max |value| / 127."""

    dtype, lowest, highest = np.int8, -127, 127

    @staticmethod
    def scales(lo, hi):
        return _half(np.maximum(-lo, hi) / np.float32(127)), np.zeros_like(lo)
