"""The product interface: one way of running one matrix's products (`Path`), a class per
instruction set or library, bound to the matrix when the driver prepares (what it keeps of
the matrix is its own: codes in its order, a packed copy, float32 values).

A path's `run(x, out)` is w @ x for a feature-major x (i, T): (o, T), or (T, o) for the
output head (the logits come back one row per token); added into `out` when given (the
residual adds). The product (product.py) picks which path runs for how many tokens, sets
numba's threads and keeps OpenBLAS's clock; a path only computes.

Adding a way (an Arm NEON integer path, sdot, beside the AVX-512 VNNI and AVX2 ones): a
subclass with its `name`, `available()` (what the CPU and the process must have), `fits()`
(the shapes it takes) and `run()`, and its class in registry.py. The choice
among a matrix's paths is measured when the driver prepares (choice.py), whatever they are.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import numpy as np

from .quantized import Codes, Quantized


class Path(ABC):
    name: ClassVar[str]
    # Runs on OpenBLAS's own threads, not the pool every other kernel of a step runs on:
    # timed last and chosen only with a clear lead (choice.py), its spin clocked (runtime.py).
    blas_threads: ClassVar[bool] = False
    # Runs a numba kernel, whose threads are set for the product's work.
    numba_kernel: ClassVar[bool] = False
    # Holds a float32 copy of a matrix on block codes (4 bytes a weight where the codes take
    # half of one or one): built for every matrix of a shape only where it wins (model_products.py).
    float_copy: ClassVar[bool] = False

    @classmethod
    def available(cls, runtime) -> bool:
        """Whether this CPU and this process have what the path needs."""
        return True

    @classmethod
    def fits(cls, shape: tuple[int, int]) -> bool:
        """Whether a matrix of this shape (out, in) can run here."""
        return True

    def __init__(self, head: bool):
        self.head = head

    @abstractmethod
    def run(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray: ...

    @abstractmethod
    def bytes_read(self, tokens: int) -> int:
        """The weight bytes a product of `tokens` tokens reads."""

    def finish(self, result: np.ndarray, out: np.ndarray | None, token_major: bool = False) -> np.ndarray:
        """`result` (o, T), or (T, o) where `token_major`, in the layout the product returns
        (token-major for the head), added into `out` when given."""
        if self.head and not token_major:
            result = np.ascontiguousarray(result.T)
        if out is not None:
            out += result
            return out
        return result


class ValuesPath(Path):
    """A path over the matrix's float32 values (MKL, BLAS): a float32 matrix as it is, or a
    matrix on block codes by the codes' values, its input quantized first as every path on
    codes takes it."""

    float_copy = True

    @classmethod
    def of_codes(cls, codes: Codes, head: bool, runtime) -> ValuesPath:
        kernels, colscale = runtime.kernels.quantize, codes.colscale
        return cls(codes.values(), head, lambda x: Quantized(x, colscale, kernels).values())

    @classmethod
    def of_matrix(cls, w: np.ndarray, head: bool, runtime) -> ValuesPath:
        return cls(w, head)

    def __init__(self, values: np.ndarray, head: bool, quantize=None):
        """`values`: the matrix (o, i) in float32; `quantize`: what the input goes through
        first, or None."""
        super().__init__(head)
        self._quantize = quantize

    def input(self, x: np.ndarray) -> np.ndarray:
        return x if self._quantize is None else self._quantize(x)
