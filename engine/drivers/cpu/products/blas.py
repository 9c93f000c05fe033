"""Products on NumPy's BLAS (OpenBLAS) over float32 values: the path every CPU has."""

from __future__ import annotations

import numpy as np

from .path import ValuesPath


class BlasPath(ValuesPath):
    name = "openblas"
    blas_threads = True

    def __init__(self, values: np.ndarray, head: bool, quantize=None):
        super().__init__(values, head, quantize)
        self.values = values

    def run(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        return self.finish(self.values @ self.input(x), out)

    def bytes_read(self, tokens: int) -> int:
        return self.values.nbytes
