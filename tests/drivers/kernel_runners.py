"""Where the kernels' tests launch engine/drivers/cuda's kernels, each as (xp, launch):

- `device`: a GPU through CuPy, CUDA (the NVRTC sm_90 cubin) or ROCm (hiprtc's code object for
  the device, at its wavefront); skipped, saying why, where CuPy sees no device;
- `lanes32`, `lanes64`: the same sources built for the CPU (host_kernels), with warps of 32
  lanes (CUDA, RDNA) and wavefronts of 64 (CDNA); these run on every machine.

`xp` makes and reads arrays as CuPy does (asarray, zeros, .get()); `launch(kernel, grid,
*args)` sizes the block as the driver does for that lane count and waits for the kernel."""

from __future__ import annotations

import numpy as np
import pytest

from engine.drivers.cuda import compile as cc
from engine.drivers.cupy_launch import ReferenceLauncher

from .host_kernels import build
from .host_kernels import launch as host_launch

RUNNERS = ("device", "lanes32", "lanes64")


class HostArray(np.ndarray):
    """A NumPy array that reads back as a CuPy array does."""

    def get(self) -> np.ndarray:
        return np.array(self)


class HostXp:
    float32, int32 = np.float32, np.int32

    @staticmethod
    def asarray(a) -> HostArray:
        return np.array(a).view(HostArray)  # a copy, as an upload is

    @staticmethod
    def zeros(shape, dtype) -> HostArray:
        return np.zeros(shape, dtype).view(HostArray)


def host_runner(folder, lanes: int, sources: dict[str, str] | None = None):
    lib = build(folder, lanes, sources)

    def launch(kernel: str, grid, *args):
        wtype = "bf16" if kernel.endswith("_bf16") else "f16"
        block = (cc.block_threads(kernel, lanes),)
        ReferenceLauncher(wtype, lanes)._check(kernel, block, args)  # the packing a device launch would get
        host_launch(lib, kernel, tuple(grid), block, args)

    return HostXp, launch


def device_runner(folder):
    try:
        import cupy as cp
    except Exception as e:  # not installed, or built for a platform this machine lacks
        pytest.skip(f"CuPy does not import here ({type(e).__name__})")
    if not cp.is_available():
        pytest.skip("CuPy sees no GPU here")
    from engine.drivers import cupy_device

    hip = bool(cp.cuda.runtime.is_hip)
    lanes = int(cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["warpSize"])
    modules, files = {}, cc.kernel_files()
    for name in cc.SOURCES:
        if hip:
            from engine.drivers.cuda import compile_hip

            path = folder / (name + ".hsaco")
            path.write_bytes(compile_hip.compile_on_device(name, cupy_device.gcn_arch(cp), lanes))
        else:
            path = folder / (name + ".cubin")
            path.write_bytes(cc.compile_all()[name].cubin)
        modules[name] = cp.RawModule(path=str(path))

    def launch(kernel: str, grid, *args):
        module = modules[files[kernel]]
        module.get_function(kernel)(tuple(grid), (cc.block_threads(kernel, lanes),), args)
        cp.cuda.Device().synchronize()

    return cp, launch


@pytest.fixture(scope="module", params=RUNNERS)
def runner(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("kernels")
    if request.param == "device":
        return device_runner(folder)
    return host_runner(tmp_path_factory.getbasetemp(), int(request.param.removeprefix("lanes")))
