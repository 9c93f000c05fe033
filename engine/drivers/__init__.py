"""One driver per backend. `auto` picks the best backend this machine has.

    numpy    the CPU driver (NumPy, numba kernels, MKL's packed products)
    wgpu     WebGPU through wgpu-py on any adapter (Vulkan, Metal, DX12, or a CPU one)
    vulkan   the same driver, on a Vulkan adapter only; start-up fails without one
    auto     a hardware GPU adapter through wgpu when there is one, else numpy
"""

from __future__ import annotations

from .base import DeviceFault, Driver, RowWork, StepArrays, StepOutput, StepRefused

BACKENDS = ("auto", "numpy", "wgpu", "vulkan")  # ptx and rocm (CuPy) join as their driver lands


def make_driver(backend: str = "auto") -> Driver:
    """Raises ValueError for an unknown backend and NoAdapter (a RuntimeError naming what to
    install) when the backend asked for has no device here."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; this build has: {', '.join(BACKENDS)}")
    if backend in ("wgpu", "vulkan"):
        from .wgpu_driver import WgpuDriver

        return WgpuDriver(backend)
    if backend == "auto":
        from .wgpu_driver import adapters, is_hardware

        hardware = [a for a in adapters() if is_hardware(a)]
        if hardware:
            from .wgpu_driver import WgpuDriver

            return WgpuDriver("wgpu", hardware[0])
    from .numpy_driver import NumpyDriver

    return NumpyDriver()


__all__ = ["BACKENDS", "DeviceFault", "Driver", "RowWork", "StepArrays", "StepOutput", "StepRefused", "make_driver"]
