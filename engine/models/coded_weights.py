"""A model's weights by canonical name where some are held only as their exact block codes.

A GGUF's Q4_0/Q4_1/Q8_0 matrices are read as codes (one byte a weight, or half of one in the
file) and never dequantized unless someone asks: the CPU driver's products run on the codes,
and a float32 copy of a Llama 3.2 1B shape is 4.7 GB. Reading such a weight by name gives its
float32 values (block_codes.BlockCodes.values), made on that read and not kept, so a driver
that uploads float32 (wgpu, CuPy) or the float32 path still sees every weight; `shapes()`
answers what a plan needs to know without making any.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping

import numpy as np

from .block_codes import BlockCodes


class CodedWeights(MutableMapping):
    """`floats`: weights held as float32 arrays; `codes`: weights held as BlockCodes; a name
    in both reads the float32 array (the embedding: a step looks its rows up). `order`: the
    names in the order iteration gives them."""

    def __init__(self, floats: dict[str, np.ndarray], codes: dict[str, BlockCodes], order: list[str]):
        if set(order) != set(floats) | set(codes):
            raise ValueError("the order must name every weight once")
        self.floats, self.codes, self._order = floats, codes, list(order)

    def __getitem__(self, name: str) -> np.ndarray:
        if name in self.floats:
            return self.floats[name]
        return self.codes[name].values()

    def __setitem__(self, name: str, value: np.ndarray) -> None:
        if name not in self._order:
            self._order.append(name)
        self.codes.pop(name, None)
        self.floats[name] = value

    def __delitem__(self, name: str) -> None:
        if name not in self._order:
            raise KeyError(name)
        self._order.remove(name)
        self.floats.pop(name, None)
        self.codes.pop(name, None)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._order))

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, name: object) -> bool:
        return name in self.floats or name in self.codes

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight's shape, none made."""
        return {name: (self.floats[name].shape if name in self.floats else self.codes[name].codes.shape)
                for name in self._order}
