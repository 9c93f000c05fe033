"""Products on block codes widened to float32 a block at a time (kernels/blocks.py): a quarter
of the float32 matrix's bytes, for CPUs without an integer path (and timed against it where
there is one)."""

from __future__ import annotations

import numpy as np

from .path import Path
from .quantized import Codes, Quantized


class FloatBlockPath(Path):
    name = "blocks"
    numba_kernel = True

    @classmethod
    def of_codes(cls, codes: Codes, head: bool, runtime) -> FloatBlockPath:
        return cls(codes, head, runtime.kernels)

    def __init__(self, codes: Codes, head: bool, kernels):
        super().__init__(head)
        self.u, self.d, self.m, self.colscale = codes.u, codes.d, codes.m, codes.colscale
        self._quantize, self._matmul = kernels.quantize, kernels.blocks.block_matmul

    def run(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        q = Quantized(x, self.colscale, self._quantize)
        xt = np.ascontiguousarray(q.values().T)  # the kernel reads tokens as rows
        if out is not None and not self.head:
            self._matmul(self.u, self.d, self.m, xt, q.c, out, True)
            return out
        result = np.empty((self.u.shape[0], x.shape[1]), np.float32)
        self._matmul(self.u, self.d, self.m, xt, q.c, result, False)
        return self.finish(result, out)

    def bytes_read(self, tokens: int) -> int:
        return self.u.nbytes + self.d.nbytes + self.m.nbytes
