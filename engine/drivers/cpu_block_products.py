"""Few-token products on a matrix's block codes (engine/models/block_codes.py; kernels in
cpu_block_kernels): one byte a weight and a (d, m) pair per 32 instead of four bytes, for
the steps whose products are bound by the bytes they read (a one-row decode step read
540 MB of float32 SmolLM2 weights; its codes are 170 MB).

Measured on SmolLM2-135M (2-core Zen 4, same process, alternating): the one-row step's
products took 13.0 ms on the codes against 20.2 ms on float32 (the step 15.3 against 23.1
ms); a 4-row step 30.7 against 33.7 ms, and 6 rows were even, so from 5 tokens on the float32
matrices (and MKL's packed copies) take over. Both copies are kept. The codes' products are
bound by arithmetic, not bytes (widening each code and a sum per block of 32), about 10 G
weights/s on the two cores.
"""

from __future__ import annotations

import numpy as np

BLOCK_TOKENS = range(1, 5)  # token counts the codes run (measured crossover with float32)

_kernels = None


def compile() -> tuple:
    """Builds (or loads from numba's cache) the block kernels and checks them on a known
    input. Call it after cpu_kernels.compile(), which chooses numba's target and threading
    layer for every kernel of the process."""
    global _kernels
    if _kernels is None:
        from . import cpu_block_kernels

        kernels = cpu_block_kernels.KERNELS
        inputs, _rows, product = kernels
        codes = np.full((5, 32), 2, np.uint8)
        d, m = np.full((5, 1), 0.5, np.float32), np.full((5, 1), 1.0, np.float32)
        x = np.ones((32, 1), np.float32)
        xt, sx = np.empty((1, 32), np.float32), np.empty((1, 1), np.float32)
        inputs(x, np.ones(32, np.float32), xt, sx)
        out = np.zeros((5, 1), np.float32)
        product(codes, d, m, xt, sx, out, True)
        product(codes.view(np.int8), d, m, xt, sx, out, True)
        if not np.all(out == 128):
            raise RuntimeError("the block kernels gave wrong results on a known input")
        _kernels = kernels
    return _kernels


def specializations() -> int:
    return sum(len(k.signatures) for k in _kernels) if _kernels is not None else 0


class BlockProduct:
    """One matrix's codes and the column scale its input takes (see cpu_block_kernels)."""

    def __init__(self, codes, colscale: np.ndarray | None):
        compile()
        self.codes, self.d, self.m = codes.codes, codes.d, codes.m
        i = self.codes.shape[1]
        self.colscale = np.ones(i, np.float32) if colscale is None else np.ascontiguousarray(colscale, np.float32)
        self.nbytes = codes.nbytes + self.colscale.nbytes

    def work(self, tokens: int) -> int:
        """Multiply-adds of a product over `tokens` tokens (the caller chooses threads by it)."""
        return self.codes.size * tokens

    def __call__(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """w @ x for a feature-major x (i, T); into `out` (accumulating) when given, on the
        threads numba is set to."""
        inputs, _rows, product = _kernels
        i, tokens = x.shape
        xt = np.empty((tokens, i), np.float32)
        sx = np.empty((tokens, i // 32), np.float32)
        inputs(np.ascontiguousarray(x), self.colscale, xt, sx)
        add = out is not None
        if out is None:
            out = np.empty((self.codes.shape[0], tokens), np.float32)
        product(self.codes, self.d, self.m, xt, sx, out, add)
        return out
