"""Products on Intel oneMKL's packed GEMM (platform/mkl.py): the matrix packed once, when the
driver prepares, for steps of more tokens than the few-token kernels take."""

from __future__ import annotations

import numpy as np

from ..platform import mkl
from .path import ValuesPath


class MklPath(ValuesPath):
    name = "mkl"

    @classmethod
    def available(cls, runtime) -> bool:
        return mkl.available(runtime.requested_isa)

    def __init__(self, values: np.ndarray, head: bool, quantize=None):
        """The matrix packed (for the head as MKL's right-hand matrix, so its logits come out
        token-major)."""
        super().__init__(values, head, quantize)
        self.packed = mkl.PackedWeight(values, right=head)

    def run(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        x = self.input(x)
        if self.head:
            return self.finish(mkl.matmul_token_major(self.packed, x), out, token_major=True)
        if out is not None:
            mkl.matmul_add(self.packed, x, out)
            return out
        return mkl.matmul(self.packed, x)

    def bytes_read(self, tokens: int) -> int:
        return 4 * self.packed.shape[0] * self.packed.shape[1]
