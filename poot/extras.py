"""The optional parts of poot and the extras that install them.

`pip install poot` installs the conformance suite alone. The reference server and the load
tests need more; their commands start here, so one whose extra is missing says which to install
instead of failing on an import.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

# extra -> modules it installs (import names)
EXTRAS: dict[str, tuple[str, ...]] = {
    "serve": ("numpy", "numba", "gguf", "tokenizers", "safetensors", "jinja2", "starlette", "uvicorn",
              "prometheus_client"),
    "load": ("locust", "matplotlib", "prometheus_client"),
}


def missing(extra: str) -> list[str]:
    """The modules of `extra` that cannot be imported here."""
    return [m for m in EXTRAS[extra] if importlib.util.find_spec(m) is None]


def _run(command: str, extra: str, module: str) -> int:
    if lacking := missing(extra):
        print(f"{command}: needs the {extra} extra ({', '.join(lacking)} not installed): "
              f"pip install 'poot[{extra}]'", file=sys.stderr)
        return 2
    return importlib.import_module(module).main()


def serve() -> int:
    # NumPy's OpenBLAS picks its kernels by the CPU as it loads, before any engine code runs:
    # a server held to AVX2 (POOT_CPU_ISA, engine/drivers/cpu/target.py) asks it for AVX2's here.
    if os.environ.get("POOT_CPU_ISA", "").strip().lower() == "avx2":
        os.environ.setdefault("OPENBLAS_CORETYPE", "Haswell")
    return _run("poot-serve", "serve", "poot.server.cli")


def load() -> int:
    return _run("poot-load", "load", "poot.loadtests.cli")
