"""Integer products on block codes (kernels/integer.py), a class per instruction set: the codes
laid out once in the kernel's order (kernels/integer_layout.py), 4-bit codes two a byte (a
one-token product is bound by the bytes it reads), the block scales as float16 where that holds
them exactly (a 4-bit block is 20 bytes instead of 24), and large codes on 2 MiB pages.
Measured on SmolLM2-135M (2-core Zen 4, AVX-512 VNNI): the products of a one-token step take
3-4 ms here against 13 on the float block path and 20 on float32.

The kernel is built for one dot-product route a process (kernels/integer_dot.py: the one
numba's target allows), so at most one of these paths is available in a process. Every route
sums a (row, token) in the same order: a token's logits do not depend on the instruction set.
An Arm NEON path (sdot) would be one more subclass, with its route in integer_dot.py."""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from ..kernels import integer_dot
from ..kernels.integer_layout import arrange_codes, half_scales, lane_scales
from ..platform import huge_pages
from .path import Path
from .quantized import BLOCK, Codes


class IntegerPath(Path):
    """`route`: the dot product (kernels/integer_dot.py) the kernel must have been built on."""

    route: ClassVar[str]
    numba_kernel = True

    @classmethod
    def available(cls, runtime) -> bool:
        return integer_dot.route_for(runtime.features()) == cls.route

    @classmethod
    def fits(cls, shape: tuple[int, int]) -> bool:
        return shape[1] % (2 * BLOCK) == 0  # the integer tile takes blocks in pairs

    @classmethod
    def of_codes(cls, codes: Codes, head: bool, runtime) -> IntegerPath:
        return cls(codes, head, runtime.kernels)

    def __init__(self, codes: Codes, head: bool, kernels):
        super().__init__(head)
        arranged, self.order = arrange_codes(codes.u)
        self.codes = huge_pages.placed(arranged)  # a head's codes span many pages
        self.rows = codes.shape[0]
        self.colscale = codes.colscale
        self.set_scales(*(half_scales(codes.d, codes.m) or (codes.d, codes.m)))
        self._product = kernels.integer.int8_product

    def set_scales(self, d: np.ndarray, m: np.ndarray) -> None:
        """The block scales (d, m as they are, or as float16 bits), and the same laid out in
        the kernel's lanes (kernels/integer_layout.lane_scales) for its tiles of several tokens."""
        self.scales = (d, m)
        self.lane_scales = (lane_scales(d), lane_scales(m, lone=True))

    def share(self, codes: np.ndarray, scales: tuple, lane_scales: tuple, colscale: np.ndarray) -> None:
        """Moves the path onto the same values held elsewhere (views of a stack over a model's
        layers, decoder_stack.py): its own copies are freed."""
        for mine, theirs in zip((self.codes, *self.scales, *self.lane_scales, self.colscale),
                                (codes, *scales, *lane_scales, colscale), strict=True):
            if mine.shape != theirs.shape or mine.dtype != theirs.dtype:
                raise ValueError("shared arrays must match the product's own")
        self.codes, self.scales, self.lane_scales, self.colscale = codes, scales, lane_scales, colscale

    def run(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        tokens = x.shape[1]
        add = out is not None
        if out is None:
            out = np.empty((tokens, self.rows) if self.head else (self.rows, tokens), np.float32)
        self._product(self.codes, *self.scales, *self.lane_scales, self.order, np.ascontiguousarray(x, dtype=np.float32),
                      self.colscale, out, self.head, add)
        return out

    def bytes_read(self, tokens: int) -> int:
        d, m = self.scales if tokens == 1 else self.lane_scales  # a lone token's tiles read the block scales
        return self.codes.nbytes + d.nbytes + m.nbytes


class VnniPath(IntegerPath):
    """AVX-512 VNNI (vpdpwssd on 512-bit vectors)."""

    name = "int8"
    route = "vpdpwssd"


class Avx2Path(IntegerPath):
    """AVX2 (vpmaddwd and vpaddd on 256-bit vectors): Intel since Haswell, AMD since Zen 1."""

    name = "avx2"
    route = "vpmaddwd"


INTEGER_PATHS = (VnniPath, Avx2Path)


def integer_path(runtime) -> type[IntegerPath] | None:
    """The integer path this process has, or None."""
    return next((kind for kind in INTEGER_PATHS if kind.available(runtime)), None)
