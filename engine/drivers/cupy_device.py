"""Which device CuPy offers (`probe`), what the plan may take of it (`device_info`), and how
its errors split into the loop's two failures (`error_kinds`). Importable without CuPy: a
missing or broken CuPy is a NoDevice with what to install, never an ImportError.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..plan import DeviceInfo

PLATFORM = {"ptx": "CUDA", "rocm": "ROCm (HIP)"}
INSTALL = {"ptx": "pip install 'poot[ptx]'",
           "rocm": "pip install 'poot[rocm]' (CuPy for ROCm 7.0) on a machine with ROCm 7 and an AMD GPU"}

# The plan takes this share of the memory free when the driver starts: cuBLAS keeps a
# workspace per handle and stream, the loaded kernels and the CUDA context grow after the
# plan is fitted (as would a captured CUDA graph), and CuPy's pool rounds each allocation
# up; a tenth of the free memory covers them.
MEMORY_SHARE = 0.9
# Rows: a step of R decoding rows reads every weight once whatever R is, so R rows cost about
# one row's time while the products stay bound by reading weights. Two rows per
# multiprocessor keeps every SM busy in the attention kernel (one block per token and head)
# and the row count a multiple of 32 keeps the products' N dimension on whole tensor-core
# tiles; past 512 the decode step's attention over long rows outweighs the weight read. The
# rows come from the device alone, never from an option.
ROWS_PER_SM = 2
ROW_MULTIPLE = 32
MAX_ROWS = 512
# Dense fp16 tensor-core FLOPs per byte of memory bandwidth, by compute capability major
# (H100/H200: ~990 TFLOP/s over 3.35-4.8 TB/s, about 200; A100: 312 over 2.0, about 150).
FLOPS_PER_BYTE = {10: 250.0, 9: 200.0, 8: 150.0, 7: 100.0}
HIP_FLOPS_PER_BYTE = 240.0  # MI300X: ~1300 TFLOP/s fp16 over 5.3 TB/s
DEFAULT_FLOPS_PER_BYTE = 100.0

KERNEL_CC = (9, 0)  # the oldest device engine/drivers/cuda/compile.py's ARCH (sm_90) runs on

# CUDA/HIP error codes (the runtime's and the driver API's agree on these) of a launch that
# was refused before the kernel ran: the kernel changed nothing, and the error is not sticky.
# Launches before it in the step wrote only the step's own rows (their new tokens' KV or
# state), and the requests of a refused step fail, so nothing another request reads moved.
REFUSED_CODES = {
    1: "invalid value",  # cudaErrorInvalidValue / CUDA_ERROR_INVALID_VALUE: a grid dimension out of range
    9: "invalid configuration",  # cudaErrorInvalidConfiguration
    701: "launch out of resources",  # cudaErrorLaunchOutOfResources / CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES
}


class NoDevice(RuntimeError):
    """No device for the backend asked for; the message says what is missing."""


class LaunchRefused(RuntimeError):
    """A kernel launch the device refused before running it (REFUSED_CODES)."""


@dataclass(slots=True, frozen=True)
class Probe:
    name: str
    total_bytes: int
    free_bytes: int
    multiprocessors: int
    compute_capability: tuple[int, int]
    hip: bool = False
    lanes: int = 32  # threads of a warp (CUDA) or wavefront (HIP: 64 on CDNA, 32 on RDNA)
    arch: str = ""  # HIP: the gcnArchName hiprtc builds for (gfx90a:sramecc+:xnack-, ...)


def _cupy(backend: str):
    try:
        import cupy
    except ModuleNotFoundError as e:
        if e.name != "cupy":
            raise NoDevice(f"--backend {backend}: CuPy does not import ({_last_line(e)}); {INSTALL[backend]}") \
                from None
        raise NoDevice(f"--backend {backend}: CuPy is not installed; {INSTALL[backend]}") from None
    except Exception as e:  # a wheel for another CUDA or ROCm, a missing shared library
        raise NoDevice(f"--backend {backend}: CuPy does not import ({_last_line(e)}); {INSTALL[backend]}") from None
    return cupy


def _last_line(error: BaseException) -> str:
    """An error's gist on one line: CuPy's import failure is a framed paragraph whose last
    line is the original error (the shared library that did not load)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip() and not line.strip().startswith("==")]
    return lines[-1][:200] if lines else type(error).__name__


def probe(backend: str) -> Probe:
    """Device 0 of the platform the backend names (CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES
    choose it); raises NoDevice naming what is missing."""
    if backend not in PLATFORM:
        raise ValueError(f"no CuPy backend {backend!r}")
    cupy = _cupy(backend)
    runtime = cupy.cuda.runtime
    hip = bool(runtime.is_hip)
    if hip != (backend == "rocm"):
        built = "ROCm (HIP)" if hip else "CUDA"
        raise NoDevice(f"--backend {backend}: the installed CuPy is built for {built}, not "
                       f"{PLATFORM[backend]}; {INSTALL[backend]}")
    try:
        count = runtime.getDeviceCount()
        if count < 1:
            raise NoDevice(f"--backend {backend}: no {PLATFORM[backend]} device found")
        props = runtime.getDeviceProperties(0)
        with cupy.cuda.Device(0):
            free, total = runtime.memGetInfo()
    except NoDevice:
        raise
    except Exception as e:  # CUDARuntimeError: cudaErrorInsufficientDriver, cudaErrorNoDevice, ...
        raise NoDevice(f"--backend {backend}: no usable {PLATFORM[backend]} device: {e}") from None
    return Probe(_text(props["name"]), int(total), int(free), int(props["multiProcessorCount"]),
                 (int(props["major"]), int(props["minor"])), hip, int(props.get("warpSize", 32)),
                 _text(props.get("gcnArchName", "")) if hip else "")


def _text(value) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def gcn_arch(cupy) -> str:
    """The current HIP device's architecture as hiprtc names it."""
    return _text(cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["gcnArchName"])


def check_toolchain(backend: str) -> None:
    """What prepare() needs besides the device, checked at start-up so that `auto` never
    picks a driver that cannot prepare: cuBLAS or hipBLAS (the products), and the kernels'
    compiler: NVRTC and the CUDA headers, or hiprtc."""
    try:
        from cupy_backends.cuda.libs import cublas  # noqa: F401  (loads libcublas)
    except Exception as e:
        hint = "pip install 'poot[ptx]' (it brings CUDA 13's cuBLAS)" if backend == "ptx" else INSTALL[backend]
        raise NoDevice(f"--backend {backend}: cuBLAS does not load ({' '.join(str(e).split())[:200]}); {hint}") \
            from None
    if backend == "ptx":
        from .cuda import compile as cc

        try:
            from cuda.bindings import nvrtc  # noqa: F401

            cc.include_dir()
        except Exception as e:
            raise NoDevice(f"--backend {backend}: the kernels cannot be compiled here ({e}); "
                           f"{INSTALL[backend]}") from None
    else:
        try:
            from cupy_backends.cuda.libs import nvrtc  # hiprtc's binding on ROCm

            nvrtc.getVersion()
        except Exception as e:
            raise NoDevice(f"--backend {backend}: hiprtc does not load ({' '.join(str(e).split())[:200]}); "
                           f"{INSTALL[backend]}") from None


def check_arch(found: Probe, backend: str) -> None:
    """The CUDA kernels are sm_90 cubin plus compute_90 PTX (cuda/compile.py): Hopper runs the
    cubin, a later GPU JIT-compiles the PTX, an earlier one runs neither. On HIP hiprtc builds
    them for the device itself, whose wavefront must be one the kernels are written for."""
    if found.hip and found.lanes not in (32, 64):
        raise NoDevice(f"--backend {backend}: {found.name} has a wavefront of {found.lanes} lanes; the kernels "
                       f"are written for 32 or 64")
    if not found.hip and found.compute_capability < KERNEL_CC:
        major, minor = found.compute_capability
        raise NoDevice(f"--backend {backend}: {found.name} is compute capability {major}.{minor}; the kernels "
                       f"are built for {KERNEL_CC[0]}.{KERNEL_CC[1]} (Hopper) and later")


def parallel_rows(multiprocessors: int) -> int:
    rows = ROWS_PER_SM * multiprocessors // ROW_MULTIPLE * ROW_MULTIPLE
    return min(MAX_ROWS, max(ROW_MULTIPLE, rows))


def flops_per_byte(found: Probe) -> float:
    if found.hip:
        return HIP_FLOPS_PER_BYTE
    return FLOPS_PER_BYTE.get(found.compute_capability[0], DEFAULT_FLOPS_PER_BYTE)


def device_info(found: Probe, backend: str, memory_bytes: int | None = None) -> DeviceInfo:
    """The plan's view of the device; `memory_bytes` (tests) replaces the free-memory share."""
    memory = memory_bytes if memory_bytes is not None else int(found.free_bytes * MEMORY_SHARE)
    major, minor = found.compute_capability
    if found.hip:
        adapter = f"{found.name} ({PLATFORM[backend]}, {found.arch}, wave{found.lanes}, {found.multiprocessors} CUs, " \
                  f"{found.total_bytes >> 20} MiB)"
    else:
        adapter = f"{found.name} ({PLATFORM[backend]}, {found.multiprocessors} SMs, cc {major}.{minor}, " \
                  f"{found.total_bytes >> 20} MiB)"
    return DeviceInfo(backend, found.name, memory, parallel_rows(found.multiprocessors), flops_per_byte(found),
                      adapter=adapter)


def cuda_errors() -> tuple[type[BaseException], ...]:
    """CuPy's device error types (runtime, driver API, cuBLAS, out of memory); none without CuPy."""
    try:
        from cupy.cuda.memory import OutOfMemoryError
        from cupy_backends.cuda.api.driver import CUDADriverError
        from cupy_backends.cuda.api.runtime import CUDARuntimeError
    except Exception:
        return ()
    found: tuple[type[BaseException], ...] = (CUDARuntimeError, CUDADriverError, OutOfMemoryError)
    try:
        from cupy_backends.cuda.libs.cublas import CUBLASError
    except Exception:  # cuBLAS's library absent: nothing of it can be raised either
        return found
    return (*found, CUBLASError)


def refused(error: BaseException) -> bool:
    """Whether a CUDA error raised by a launch call says the launch never ran."""
    return getattr(error, "status", None) in REFUSED_CODES


def error_kinds() -> tuple[tuple[type[BaseException], ...], tuple[type[BaseException], ...]]:
    """(refused, fault) for Driver.refused_errors / fault_errors. A launch the device turned
    down (the launcher raises LaunchRefused for REFUSED_CODES at the launch call) ran
    nothing; every other device error (illegal address, launch failure, ECC, an out-of-memory
    or cuBLAS failure) may come after queued work ran, and CUDA's are sticky: a fault."""
    return (LaunchRefused,), cuda_errors()
