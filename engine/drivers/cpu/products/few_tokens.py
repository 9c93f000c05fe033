"""Float32 products of 1 to 12 tokens on the few-token kernel (kernels/few_token.py). OpenBLAS
runs 2- to 12-token products at a third to a half of memory speed (on SmolLM2 the products of a
2-token step took 1.9x those of a 1-token step); this kernel reads each weight row once and
dots it with every token while it sits in L1 (1.25x). Speculative verification and small
batches live in this range. One-token products use it too, so that a few-token step runs on
one thread pool: numba's and OpenBLAS's threads each spin for a while after their work, and
alternating between them on two cores made a one-row step several times slower."""

from __future__ import annotations

import numpy as np

from .path import Path

FEW_TOKENS = range(1, 13)  # token counts the kernel takes over from BLAS (measured crossover)


class FewTokenPath(Path):
    name = "few_tokens"
    numba_kernel = True

    @classmethod
    def of_matrix(cls, w: np.ndarray, head: bool, runtime) -> FewTokenPath:
        return cls(w, head, runtime.kernels)

    def __init__(self, w: np.ndarray, head: bool, kernels):
        super().__init__(head)
        self.w = w
        self._kernel = kernels.few_token.few_token_matmul

    def run(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        result = np.empty((self.w.shape[0], x.shape[1]), dtype=np.float32)
        self._kernel(self.w, np.ascontiguousarray(x.T), result)
        return self.finish(result, out)

    def bytes_read(self, tokens: int) -> int:
        return self.w.nbytes
