"""One driver per backend. `auto` picks the best backend this machine has."""

from __future__ import annotations

from .base import DeviceFault, Driver, RowWork, StepOutput, StepRefused

BACKENDS = ("auto", "numpy")  # ptx, rocm (CuPy) and wgpu, vulkan (wgpu) join as their drivers land


def make_driver(backend: str = "auto") -> Driver:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; this build has: {', '.join(BACKENDS)}")
    from .numpy_driver import NumpyDriver

    return NumpyDriver()


__all__ = ["BACKENDS", "DeviceFault", "Driver", "RowWork", "StepOutput", "StepRefused", "make_driver"]
