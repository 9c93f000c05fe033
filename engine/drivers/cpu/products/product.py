"""One weight matrix's products (`Product`): the paths it may run on, the table that picks one
by token count, and the runtime whose threads they run on. Every product of a step goes
through `run`, whatever the matrix holds:

- a matrix on block codes (engine/models/block_codes.py: one byte a weight and a (d, m) pair
  per 32, where float32 takes four bytes a weight) has every path registry.py names for codes
  that this machine has and the shape fits; which runs for how many tokens is measured when
  the driver prepares (choice.py). From about 64 tokens MKL's float products overtook the
  integer ones on SmolLM2-135M (2-core Zen 4).
- a float32 matrix runs its few tokens on the few-token kernel and more on MKL's packed copy
  (where MKL loads and the matrix is large enough for packing to pay), else on NumPy's BLAS:
  a fixed table, not measured.
"""

from __future__ import annotations

import numpy as np

from ..platform import mkl
from ..runtime import PARALLEL_MIN_WORK, Runtime
from .few_tokens import FEW_TOKENS
from .path import Path
from .quantized import Codes
from .registry import CODE_PATHS, FLOAT_PATHS

MOST_TOKENS = 1 << 30  # the last entry of a table: any token count


class Product:
    """`paths`: the ways this matrix's products run, by name; `table`: (most tokens, path name)
    ascending, a step of T tokens running the first entry with T <= most; `quantized`: every
    path's input is quantized on numba's threads first (block codes)."""

    def __init__(self, paths: dict[str, Path], shape: tuple[int, int], head: bool, runtime: Runtime,
                 quantized: bool, table: list[tuple[int, str]]):
        self._paths = paths
        self.shape, self.head, self.runtime, self.quantized = shape, head, runtime, quantized
        self.table = table

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(self._paths)

    def path(self, name: str) -> Path:
        return self._paths[name]

    def path_for(self, tokens: int) -> str:
        for most, name in self.table:
            if tokens <= most:
                return name
        return self.table[-1][1]

    def work(self, tokens: int) -> int:
        return self.shape[0] * self.shape[1] * tokens

    def run(self, x: np.ndarray, out: np.ndarray | None = None, path: str | None = None) -> np.ndarray:
        """w @ x for a feature-major x (i, T): (o, T), or (T, o) for the head; added into
        `out` when given. On the path the table names for T tokens, or on `path`; numba's
        threads set as for the product's work where the path (or its input's quantizer) runs
        numba's kernels, OpenBLAS's spin clocked where it runs there."""
        tokens = x.shape[1]
        way = self._paths[path or self.path_for(tokens)]
        large = self.work(tokens) >= PARALLEL_MIN_WORK
        if self.quantized or way.numba_kernel:
            self.runtime.set_threads(large)
        result = way.run(x, out)
        if way.blas_threads and large:
            self.runtime.blas_ran()
        return result

    def keep_only(self, names: set[str]) -> None:
        """Drops the paths no chosen entry names, and what only they held (MKL's packed copy,
        float32 values): a path that wins nowhere costs no memory."""
        self._paths = {name: p for name, p in self._paths.items() if name in names}

    def bytes_read(self, tokens: int) -> int:
        """The weight bytes a product of `tokens` tokens reads on the path chosen for it."""
        return self._paths[self.path_for(tokens)].bytes_read(tokens)


def coded_product(codes, colscale: np.ndarray | None, runtime: Runtime, names: tuple[str, ...] | None = None,
                  head: bool = False) -> Product:
    """A matrix on block codes (BlockCodes, and the column scale its input takes) on the paths
    of registry.CODE_PATHS that this machine has and its shape fits (`names`: of those only);
    until choice.py measures, every token count runs the first."""
    runtime.compile()
    coded = Codes(codes, colscale)
    kinds = [k for k in CODE_PATHS if (names is None or k.name in names) and k.available(runtime) and k.fits(coded.shape)]
    paths = {k.name: k.of_codes(coded, head, runtime) for k in kinds}
    return Product(paths, coded.shape, head, runtime, True, [(MOST_TOKENS, kinds[0].name)])


def float_product(w: np.ndarray, runtime: Runtime, head: bool = False, use_mkl: bool = True) -> Product:
    """A float32 matrix: its few tokens (FEW_TOKENS) on the few-token kernel, more on MKL's packed
    copy where MKL loads and the matrix is large enough for packing to pay (`use_mkl`), else on
    NumPy's BLAS (no tokens: nothing to compute, the large path's empty result)."""
    runtime.compile()
    few, mkl_path, blas = FLOAT_PATHS
    large = mkl_path if use_mkl and mkl_path.available(runtime) and w.size >= mkl.MIN_PACKED_WEIGHTS else blas
    paths = {k.name: k.of_matrix(w, head, runtime) for k in (few, large)}
    table = [(FEW_TOKENS.start - 1, large.name), (FEW_TOKENS.stop - 1, few.name), (MOST_TOKENS, large.name)]
    return Product(paths, w.shape, head, runtime, False, table)
