"""Compiles the CUDA driver's kernels with NVRTC (the `cuda.bindings.nvrtc` API), with no
device needed: the architecture is named, not probed. Importable without CuPy. The sources
are shared with the HIP build (compile_hip.py): platform.h, handed to the compiler by name,
holds what differs between the platforms; the kernels' names, signatures and launch bounds
are read from the sources here for both.

OPTIONS is the one option list, shared by the driver and the CI compile checks:
- `-arch=sm_90`: cubin for Hopper (H100/H200), plus its compute_90 PTX. The driver loads
  the cubin: NVRTC 13.x writes PTX of its own ISA version, which an older driver's JIT
  rejects, while sm_90 cubin from any 13.x loads on a CUDA 13.0 driver.
- `--std=c++17`, `-default-device` (helpers need no `__device__`).
- no `--use_fast_math`: expf, division and rsqrtf stay IEEE-accurate and denormals are kept,
  so the pick's weights and thresholds (and softmax) stay within an ulp or two of the
  float32 reference; these kernels are memory-bound, fast math would buy nothing.
- `--ptxas-options=-v`: ptxas's register/shared-memory/spill report lands in the log,
  which the tests read; `-lineinfo` for profilers (no effect on code).
- `-I` the CUDA runtime wheel's include folder, for cuda_fp16.h and cuda_bf16.h.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

HERE = Path(__file__).parent
SOURCES = ("kernels.cu", "pick.cu", "mamba.cu")
HEADER = "platform.h"  # what differs between CUDA and HIP; handed to the compiler by name
ARCH = "sm_90"

# Threads per block of each kernel (the launch geometry's block size; each kernel's
# __launch_bounds__ says the same). A kernel that gives each warp its own share of the work
# is sized in warps: its block is that many times the target's lane count (32 on CUDA, the
# wavefront's 64 or 32 on HIP).
BLOCK_THREADS = {"embed": 256, "rms_norm": 256, "final_norm": 256, "rope_kv_write": 128, "silu_mul": 256, "add": 256,
                 "pick": 1024, "pick_uniform": 256, "mamba_conv": 128, "mamba_conv_state": 128, "mamba_scan": 64}
BLOCK_WARPS = {"paged_attention": 4}
CUDA_LANES = 32


class CompileError(RuntimeError):
    """NVRTC rejected a kernel source: the message names the file and holds NVRTC's log."""


@dataclass(frozen=True)
class Compiled:
    name: str  # the source file
    cubin: bytes
    ptx: str
    log: str  # NVRTC's log, ptxas's -v report included


@cache
def include_dir() -> str:
    """The folder holding cuda_fp16.h, from the nvidia-cuda-runtime wheel."""
    import nvidia

    for root in nvidia.__path__:
        for found in sorted(Path(root).glob("*/include/cuda_fp16.h")):
            return str(found.parent)
    raise CompileError("cuda_fp16.h not found: install nvidia-cuda-runtime (the 'ptx' extra)")


def options() -> list[str]:
    return ["--std=c++17", f"-arch={ARCH}", "-default-device", "--ptxas-options=-v", "-lineinfo",
            f"-I{include_dir()}"]


def _check(result, what: str) -> None:
    from cuda.bindings import nvrtc

    if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CompileError(f"{what}: {result}")


def compile_source(code: str, name: str) -> Compiled:
    """cubin, PTX and log of one source; CompileError (naming `name`) when NVRTC fails."""
    from cuda.bindings import nvrtc

    header = source(HEADER).encode()
    err, prog = nvrtc.nvrtcCreateProgram(code.encode(), name.encode(), 1, [header], [HEADER.encode()])
    _check(err, f"nvrtcCreateProgram({name})")
    try:
        opts = [o.encode() for o in options()]
        (result,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        err, size = nvrtc.nvrtcGetProgramLogSize(prog)
        _check(err, "nvrtcGetProgramLogSize")
        buf = b" " * size
        _check(nvrtc.nvrtcGetProgramLog(prog, buf)[0], "nvrtcGetProgramLog")
        log = buf.rstrip(b"\0 ").decode(errors="replace")
        if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(f"NVRTC failed to compile {name} ({result.name}):\n{log}")
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        _check(err, "nvrtcGetCUBINSize")
        cubin = b" " * size
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin)[0], "nvrtcGetCUBIN")
        err, size = nvrtc.nvrtcGetPTXSize(prog)
        _check(err, "nvrtcGetPTXSize")
        ptx = b" " * size
        _check(nvrtc.nvrtcGetPTX(prog, ptx)[0], "nvrtcGetPTX")
        return Compiled(name, cubin, ptx.rstrip(b"\0").decode(), log)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def source(name: str) -> str:
    return (HERE / name).read_text()


@cache
def compile_all() -> dict[str, Compiled]:
    """Every kernel source, compiled (once per process)."""
    return {name: compile_source(source(name), name) for name in SOURCES}


_ENTRY = re.compile(r'extern "C" __global__ void(?: __launch_bounds__\([^)]*\))?\s+(?!__launch_bounds__)(\w+)\(')
_SUFFIXED = re.compile(r"^\s*(\w+)_##SUFFIX\(", re.M)
_INSTANCES = re.compile(r"^[A-Z]+_KERNELS\((\w+),", re.M)


def kernel_names(name: str | None = None) -> list[str]:
    """The entry points (extern "C" __global__) the sources define, as the cubin names them."""
    names: list[str] = []
    for file in (name,) if name else SOURCES:
        code = source(file)
        names += _ENTRY.findall(code)
        names += [f"{base}_{suffix}" for suffix in _INSTANCES.findall(code) for base in _SUFFIXED.findall(code)]
    return names


def kernel_files() -> dict[str, str]:
    """Each entry point's source file."""
    return {kernel: file for file in SOURCES for kernel in kernel_names(file)}


def block_threads(kernel: str, lanes: int = CUDA_LANES) -> int:
    """The block size a kernel is launched with on a target of `lanes` lanes a warp (its name
    without the _f16/_bf16/_f32 suffix)."""
    base = re.sub(r"_(f16|bf16|f32)$", "", kernel)
    return BLOCK_WARPS[base] * lanes if base in BLOCK_WARPS else BLOCK_THREADS[base]


_BOUNDS = re.compile(r"__launch_bounds__\(([^)]*)\)\s*(?:\\\s*)*(\w+?)(?:_##SUFFIX)?\(")
_DEFINE = re.compile(r"^#define (\w+) (.+)$", re.M)


def _product(expr: str, macros: dict[str, str]) -> int:
    """A number, a macro or a product of them, as a launch bound states it."""
    expr = expr.strip().strip("()")
    if "*" in expr:
        return math.prod(_product(term, macros) for term in expr.split("*"))
    return int(expr) if expr.isdigit() else _product(macros[expr], macros)


@cache
def launch_bounds(lanes: int) -> dict[str, int]:
    """Each kernel's __launch_bounds__ as the sources state it, evaluated for `lanes` (LANES
    and the sources' own macros): what a launch's block must equal."""
    out = {}
    for file in SOURCES:
        code = source(file)
        macros = {"LANES": str(lanes)} | dict(_DEFINE.findall(code))
        for expr, name in _BOUNDS.findall(code):
            suffixed = f"{name}_##SUFFIX" in code
            for kernel in [f"{name}_{s}" for s in _INSTANCES.findall(code)] if suffixed else [name]:
                out[kernel] = _product(expr, macros)
    return out


@dataclass(frozen=True)
class Usage:
    registers: int
    shared: int  # static shared memory, bytes
    stack: int
    spill_stores: int
    spill_loads: int


_FUNC = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def ptxas_usage(log: str) -> dict[str, Usage]:
    """Each entry function's resources, from ptxas's -v report in an NVRTC log."""
    out: dict[str, Usage] = {}
    current, props = None, (0, 0, 0)
    for line in log.splitlines():
        if m := _FUNC.search(line):
            current, props = m.group(1), (0, 0, 0)
        elif (m := _PROPS.search(line)) and current:
            props = tuple(int(g) for g in m.groups())
        elif (m := _USED.search(line)) and current:
            out[current] = Usage(int(m.group(1)), int(m.group(2) or 0), *props)
            current = None
    return out
