"""Every weight product of one prepared model, by weight name (`ModelProducts`): the matrices
the family found block codes for on their paths (measured when the driver prepares, choice.py),
the rest in float32, the large ones packed once for MKL where it loads. Built once per
prepare; a step asks it for a product by the name its op gives."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np

from ..runtime import Runtime
from . import choice
from .integer import INTEGER_PATHS
from .product import Product, coded_product, float_product
from .registry import CODE_PATHS


class ModelProducts:
    def __init__(self, weights: dict[str, np.ndarray], names: list[str], runtime: Runtime, head: str | None = None,
                 codes: dict | None = None, use_mkl: bool = True, int8: bool = True):
        """`names`: the weights the program's products read; `head`: the output head's, whose
        products return token-major logits; `codes`: {name: (BlockCodes, colscale or None)} for
        the matrices whose products run on block codes, on the paths this machine has: integer
        dot products where the CPU has them (and `int8`), MKL where it loads (and `use_mkl`)."""
        codes = codes or {}
        allowed = tuple(k.name for k in CODE_PATHS if (k.name != "mkl" or use_mkl) and (int8 or k not in INTEGER_PATHS))
        if codes:
            check_code_paths(runtime, allowed)
        self.runtime = runtime
        wanted = {*names, *([head] if head is not None else [])}
        self._products: dict[str, Product] = {
            name: coded_product(c, scale, runtime, allowed, head=name == head)
            for name, (c, scale) in codes.items() if name in wanted}
        for name in sorted(wanted - set(codes)):
            self._products[name] = float_product(weights[name], runtime, head=name == head, use_mkl=use_mkl)
        self.choices: list[choice.ShapeChoice] = []  # once measure() or restore() has run
        self.measure_seconds = 0.0

    def __getitem__(self, name: str) -> Product:
        return self._products[name]

    def get(self, name: str) -> Product | None:
        return self._products.get(name)

    def on_codes(self) -> list[Product]:
        """The products on block codes."""
        return [p for p in self._products.values() if p.quantized]

    @property
    def coded(self) -> int:
        """How many weight matrices run their products on block codes."""
        return len(self.on_codes())

    @property
    def packed(self) -> int:
        """How many float32 weight matrices run on MKL's packed products."""
        return sum(1 for p in self._products.values() if not p.quantized and "mkl" in p.paths)

    def measure(self, max_tokens: int, head_tokens: int) -> list[choice.ShapeChoice]:
        """Times each product on block codes on each of its paths for steps of up to
        `max_tokens` tokens (the head: `head_tokens`) and keeps the fastest per shape and
        token count (choice.py); returns the measurements."""
        start = time.perf_counter()
        self.choices = choice.choose(self.on_codes(), max_tokens, head_tokens,
                                     lambda product, path, x: product.run(x, path=path), self.runtime.settle)
        self.measure_seconds = time.perf_counter() - start
        return self.choices

    def choices_data(self) -> list[dict]:
        """The choice made, as plain data, for restore()."""
        return [c.as_data() for c in self.choices]

    def restore(self, data: list[dict]) -> bool:
        """Sets the choice from choices_data() without timing anything; False, and nothing set,
        where it does not fit these products (choice.restore)."""
        choices = [choice.ShapeChoice.from_data(d) for d in data]
        if not choice.restore(self.on_codes(), choices):
            return False
        self.choices = choices
        return True


def check_code_paths(runtime: Runtime, names: tuple[str, ...]) -> None:
    """Runs every path on block codes that compiles a kernel of its own, among `names` and
    those this machine has, on a known input; raises RuntimeError on a wrong result."""
    codes = SimpleNamespace(codes=np.full((5, 64), 2, np.uint8), d=np.full((5, 2), 0.5, np.float32),
                            m=np.full((5, 2), 1.0, np.float32), values=lambda: np.full((5, 64), 2, np.float32))
    for kind in CODE_PATHS:
        if kind.name in names and kind.numba_kernel and kind.available(runtime):
            out = np.full((5, 3), 1.0, np.float32)
            coded_product(codes, None, runtime, (kind.name,)).run(np.ones((64, 3), np.float32), out=out)
            if not np.allclose(out, 129, rtol=1e-5):
                raise RuntimeError(f"the {kind.name} block kernels gave wrong results on a known input")
