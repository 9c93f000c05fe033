"""Which paths a product may take, in the order a matrix's first (unmeasured) choice takes
them. Adding a way of running products is a Path subclass (path.py) named here; the product
offers it where its `available()` and `fits()` say so, and the measured choice (choice.py)
decides where it runs."""

from __future__ import annotations

from .blas import BlasPath
from .few_tokens import FewTokenPath
from .float_block import FloatBlockPath
from .integer import INTEGER_PATHS
from .mkl import MklPath

# A matrix on block codes: integer dot products first (each instruction set a path of its own,
# products/integer.py; an Arm NEON path, sdot, would go beside them), then the float ones.
CODE_PATHS = (*INTEGER_PATHS, FloatBlockPath, MklPath, BlasPath)
# A float32 matrix: its few tokens, then more on MKL's packed copy or on BLAS (product.py).
FLOAT_PATHS = (FewTokenPath, MklPath, BlasPath)
