"""Integer products on AVX-512 VNNI (kernels/vnni.py): the codes laid out once in the kernel's
order (kernels/vnni_layout.py), 4-bit codes two a byte (a one-token product is bound by the
bytes it reads), the block scales as float16 where that holds them exactly (a 4-bit block is
20 bytes instead of 24), and large codes on 2 MiB pages. Measured on SmolLM2-135M (2-core Zen
4): the products of a one-token step take 3-4 ms here against 13 on the float block path and
20 on float32."""

from __future__ import annotations

import numpy as np

from ..kernels.vnni_layout import arrange_codes, half_scales, lane_scales
from ..platform import huge_pages
from .path import Path
from .quantized import BLOCK, Codes

FEATURES = ("+avx512bw", "+avx512vnni")


class VnniPath(Path):
    name = "int8"
    numba_kernel = True

    @classmethod
    def available(cls, runtime) -> bool:
        features = runtime.features()
        return all(f in features for f in FEATURES)

    @classmethod
    def fits(cls, shape: tuple[int, int]) -> bool:
        return shape[1] % (2 * BLOCK) == 0  # the integer tile takes blocks in pairs

    @classmethod
    def of_codes(cls, codes: Codes, head: bool, runtime) -> VnniPath:
        return cls(codes, head, runtime.kernels)

    def __init__(self, codes: Codes, head: bool, kernels):
        super().__init__(head)
        arranged, self.order = arrange_codes(codes.u)
        self.codes = huge_pages.placed(arranged)  # a head's codes span many pages
        self.rows = codes.shape[0]
        self.colscale = codes.colscale
        self.set_scales(*(half_scales(codes.d, codes.m) or (codes.d, codes.m)))
        self._product = kernels.vnni.int8_product

    def set_scales(self, d: np.ndarray, m: np.ndarray) -> None:
        """The block scales (d, m as they are, or as float16 bits), and the same laid out in
        the kernel's lanes (kernels/vnni_layout.lane_scales) for its tiles of several tokens."""
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
