"""The same kernel sources built for AMD GPUs (HIP): the options the driver compiles them
with through hiprtc on the device, and a build of them with `hipcc` that needs no device (the
architecture is named), with the compiler's per-kernel resource report, for the CI check.
Importable without CuPy or a ROCm install.

The options, for hiprtc and hipcc alike (`options`):
- `-DLANES=N`: the target's wavefront size, 64 on CDNA (gfx90a, gfx94x) and 32 on RDNA
  (gfx10xx, gfx11xx) by default; platform.h checks it against the compiler's own where the
  compiler states it, and every cross-lane reduction and lane layout is written against it;
- `-O3`, `-std=c++17`; no fast math, as on CUDA (compile.py says why).
The architecture: hiprtc takes `--gpu-architecture=` the device's gcnArchName (features such
as `:xnack-` included); hipcc `--offload-arch=` a target name.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from .compile import HEADER, SOURCES, CompileError, source

# The targets the CI check builds for, and each one's wavefront size: MI200 (gfx90a), the
# first MI300 target this toolchain knows (gfx940), RDNA2 (gfx1030, wave32).
TARGETS = {"gfx90a": 64, "gfx940": 64, "gfx1030": 32}
HIPCC_TIMEOUT_S = 300

# Per-kernel limits every target shares: 256 architectural VGPRs per lane (gfx90a and gfx94x
# hold as many AGPRs beside them), 102 SGPRs a wave may address on gfx9 (106 on gfx10), and
# 64 KiB of LDS per work-group.
MAX_VGPRS = 256
MAX_SGPRS = 102
MAX_LDS = 64 * 1024


def options(lanes: int) -> list[str]:
    return ["-O3", "-std=c++17", f"-DLANES={lanes}"]


def hiprtc_options(arch: str, lanes: int) -> list[str]:
    """The driver's options for hiprtc on the device (arch: its gcnArchName)."""
    return [f"--gpu-architecture={arch}", *options(lanes)]


@cache
def hipcc() -> str | None:
    return shutil.which("hipcc")


@dataclass(frozen=True)
class HipCompiled:
    name: str  # the source file
    arch: str
    code: bytes  # the code object (ELF for amdgcn)
    log: str  # the compiler's output, the resource report included


def compile_source(code: str, name: str, arch: str, lanes: int | None = None) -> HipCompiled:
    """One source built with hipcc for `arch`; CompileError naming `name` when it fails."""
    tool = hipcc()
    if tool is None:
        raise CompileError("hipcc not found: apt-get install hipcc libamdhip64-dev rocm-device-libs")
    lanes = TARGETS[arch] if lanes is None else lanes
    with tempfile.TemporaryDirectory() as folder:
        src, out = Path(folder) / name, Path(folder) / (name + ".co")
        src.write_text(code)
        (Path(folder) / HEADER).write_text(source(HEADER))
        # HIP_PLATFORM: an nvcc on the PATH would otherwise make hipcc build for NVIDIA.
        cmd = [tool, "-x", "hip", f"--offload-arch={arch}", "--genco", *options(lanes), str(src), "-o", str(out),
               "-Rpass-analysis=kernel-resource-usage"]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=HIPCC_TIMEOUT_S,
                             env={**os.environ, "HIP_PLATFORM": "amd"})
        log = run.stdout + run.stderr
        if run.returncode != 0 or not out.exists():
            raise CompileError(f"hipcc failed to compile {name} for {arch}:\n{log}")
        return HipCompiled(name, arch, out.read_bytes(), log)


def compile_all(arch: str) -> dict[str, HipCompiled]:
    return {name: compile_source(source(name), name, arch) for name in SOURCES}


@dataclass(frozen=True)
class HipUsage:
    vgprs: int
    agprs: int
    sgprs: int
    scratch: int  # bytes per lane
    lds: int  # bytes per block
    vgpr_spill: int
    sgpr_spill: int
    occupancy: int  # waves per SIMD


_FIELDS = {"VGPRs": "vgprs", "AGPRs": "agprs", "SGPRs": "sgprs", "ScratchSize [bytes/lane]": "scratch",
           "LDS Size [bytes/block]": "lds", "VGPRs Spill": "vgpr_spill", "SGPRs Spill": "sgpr_spill",
           "Occupancy [waves/SIMD]": "occupancy"}
_REMARK = re.compile(r"remark:\s+(.+?): (\d+) \[-Rpass-analysis=kernel-resource-usage\]")
_NAME = re.compile(r"remark: Function Name: (\w+) \[-Rpass-analysis")


def resource_usage(log: str) -> dict[str, HipUsage]:
    """Each kernel's resources, from the compiler's kernel-resource-usage remarks (RDNA has no
    AGPRs: 0)."""
    out: dict[str, HipUsage] = {}
    current: str | None = None
    fields: dict[str, int] = {}

    def close():
        if current is not None:
            out[current] = HipUsage(**{"agprs": 0, **fields})

    for line in log.splitlines():
        if m := _NAME.search(line):
            close()
            current, fields = m.group(1), {}
        elif (m := _REMARK.search(line)) and current is not None and m.group(1).strip() in _FIELDS:
            fields[_FIELDS[m.group(1).strip()]] = int(m.group(2))
    close()
    return out


def compile_on_device(name: str, arch: str, lanes: int) -> bytes:
    """One source built by hiprtc (CuPy's NVRTC binding is hiprtc's on ROCm) for the device's
    architecture: the code object CuPy's RawModule loads. CompileError naming `name` on failure."""
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(source(name), name, (source(HEADER).encode(),), (HEADER.encode(),))
    try:
        try:
            nvrtc.compileProgram(prog, hiprtc_options(arch, lanes))
        except nvrtc.NVRTCError as e:
            raise CompileError(f"hiprtc failed to compile {name} for {arch}: {e}\n{nvrtc.getProgramLog(prog)}") \
                from None
        return nvrtc.getPTX(prog)  # hiprtcGetCode on ROCm: the code object, as CuPy's own RawModule takes it
    finally:
        nvrtc.destroyProgram(prog)
