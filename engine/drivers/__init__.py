"""One driver per backend. `auto` picks the best backend this machine has.

    numpy    the CPU driver (cpu/: NumPy, numba kernels, MKL's packed products)
    wgpu     WebGPU through wgpu-py on any adapter (Vulkan, Metal, DX12, or a CPU one)
    vulkan   the same driver, on a Vulkan adapter only; start-up fails without one
    ptx      CUDA through CuPy: engine/drivers/cuda's kernels and cuBLAS (pip install 'poot[ptx]')
    rocm     the CuPy driver on ROCm (HIP): the same kernels built by hiprtc, hipBLAS (pip install 'poot[rocm]')
    auto     a CUDA device through CuPy, else a hardware GPU adapter through wgpu, else numpy (never
             rocm, which has not yet run on AMD hardware). On Linux a machine with no GPU device
             file goes straight to numpy: probing CuPy and wgpu costs a start about two seconds
             of CPU (wgpu-py parses its C headers, Mesa loads its drivers) to find nothing.
"""

from __future__ import annotations

import glob
import logging
import sys

from ..step import DeviceFault, RowOpen, RowWork, StepArrays, StepOutput, StepPlan, StepRefused
from .base import Driver

BACKENDS = ("auto", "numpy", "wgpu", "vulkan", "ptx", "rocm")
log = logging.getLogger("poot.engine")


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
    if backend == "auto" and gpu_device_files() == []:
        log.info("backend auto: no GPU device file (%s): numpy, the CPU", ", ".join(GPU_DEVICE_FILES))
    elif backend == "auto":
        cuda, why_not = _cuda_driver()
        if cuda is not None:
            log.info("backend auto: a CUDA device: ptx")
            return cuda
        from .wgpu_driver import WgpuDriver, adapters, describe, is_hardware

        found = adapters()
        hardware = [a for a in found if is_hardware(a)]
        seen = "; ".join(describe(a) for a in found) or "none"
        if hardware:
            log.info("backend auto: no CUDA device (%s); WebGPU adapters: %s: wgpu on %s", why_not, seen,
                     describe(hardware[0]))
            return WgpuDriver("wgpu", hardware[0])
        log.info("backend auto: no CUDA device (%s); WebGPU adapters: %s; no hardware GPU: numpy, the CPU",
                 why_not, seen)
    from .cpu import CpuDriver

    return CpuDriver()


# What a hardware GPU's driver exposes on Linux, whichever API reaches it: DRM render nodes
# (Mesa's Vulkan and GL drivers, AMD's and Intel's), NVIDIA's own device files, AMD's compute
# node, and WSL's paravirtual GPU.
GPU_DEVICE_FILES = ("/dev/dri/renderD*", "/dev/nvidia[0-9]*", "/dev/kfd", "/dev/dxg")


def gpu_device_files() -> list[str] | None:
    """The GPU device files present (GPU_DEVICE_FILES), or None where the platform does not
    say (not Linux: Metal, DirectX)."""
    if not sys.platform.startswith("linux"):
        return None
    return sorted(f for pattern in GPU_DEVICE_FILES for f in glob.glob(pattern))


def _cuda_driver() -> tuple[Driver | None, str]:
    """The CuPy driver on a CUDA device, or None and why not: a missing, broken or
    device-less CuPy never stops `auto` from falling back."""
    try:
        from .cupy_driver import CupyDriver

        return CupyDriver("ptx"), ""
    except ImportError:
        return None, "CuPy is not installed"
    except Exception as e:  # noqa: BLE001 - any failure means no CUDA device for auto
        return None, " ".join(str(e).split())[:120] or type(e).__name__


__all__ = ["BACKENDS", "DeviceFault", "Driver", "RowOpen", "RowWork", "StepArrays", "StepOutput", "StepPlan", "StepRefused",
           "make_driver"]
