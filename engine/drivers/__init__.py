"""One driver per backend. `auto` picks the best backend this machine has.

    numpy    the CPU driver (cpu/: NumPy, numba kernels, MKL's packed products)
    wgpu     WebGPU through wgpu-py on any adapter (Vulkan, Metal, DX12, or a CPU one)
    vulkan   the same driver, on a Vulkan adapter only; start-up fails without one
    ptx      CUDA through CuPy: engine/drivers/cuda's kernels and cuBLAS (pip install 'poot[ptx]')
    rocm     the CuPy driver on ROCm (HIP): the same kernels built by hiprtc, hipBLAS (pip install 'poot[rocm]')
    auto     a CUDA device through CuPy, else a hardware GPU adapter through wgpu, else numpy (never
             rocm, which has not yet run on AMD hardware)
"""

from __future__ import annotations

from ..step import DeviceFault, RowWork, StepArrays, StepOutput, StepRefused
from .base import Driver

BACKENDS = ("auto", "numpy", "wgpu", "vulkan", "ptx", "rocm")


def make_driver(backend: str = "auto") -> Driver:
    """Raises ValueError for an unknown backend, and NoAdapter or NoDevice (RuntimeErrors
    naming what to install or what is missing) when the backend asked for has no device here."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; this build has: {', '.join(BACKENDS)}")
    if backend in ("wgpu", "vulkan"):
        from .wgpu_driver import WgpuDriver

        return WgpuDriver(backend)
    if backend in ("ptx", "rocm"):
        from .cupy_driver import CupyDriver

        return CupyDriver(backend)
    if backend == "auto":
        cuda = _cuda_driver()
        if cuda is not None:
            return cuda
        from .wgpu_driver import adapters, is_hardware

        hardware = [a for a in adapters() if is_hardware(a)]
        if hardware:
            from .wgpu_driver import WgpuDriver

            return WgpuDriver("wgpu", hardware[0])
    from .cpu import CpuDriver

    return CpuDriver()


def _cuda_driver() -> Driver | None:
    """The CuPy driver on a CUDA device, or None: a missing, broken or device-less CuPy
    never stops `auto` from falling back."""
    try:
        from .cupy_driver import CupyDriver

        return CupyDriver("ptx")
    except Exception:
        return None


__all__ = ["BACKENDS", "DeviceFault", "Driver", "RowWork", "StepArrays", "StepOutput", "StepRefused", "make_driver"]
