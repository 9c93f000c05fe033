"""engine/drivers/cuda's kernel sources built for the CPU with the host C++ compiler over
runtime.h (one fiber per GPU thread), at a chosen lane count, and a Launcher that runs them:
the real kernel code, its warp shuffles and lane layouts included, at LANES = 32 (a CUDA warp,
an RDNA wavefront) and 64 (a CDNA wavefront), with no GPU. Test-only.

`build` takes sources to use in place of the files (a deliberately broken variant), so a test
can show that a check fails on a kernel that is wrong for one lane count."""

from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
import threading
from pathlib import Path

import numpy as np

from poot.engine.drivers.cuda import compile as cc
from poot.engine.drivers.cupy_launch import Launcher, ReferenceLauncher

HERE = Path(__file__).parent
CXX = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++-15")  # clang 15 comes with hipcc


# Each library keeps its own symbols: kernel names such as `pick` are also exported by other
# libraries a test process loads (MKL's core has a `pick`), and the runtime's state, C++
# inline variables, would otherwise be one GNU-unique object shared by the 32- and 64-lane
# builds. Only the sim_ entries are exported.
HERMETIC = ("-fvisibility=hidden", "-fvisibility-inlines-hidden")  # hidden symbols are never GNU-unique


def _wrappers(code: str, name: str) -> str:
    """An exported entry per kernel: sim_NAME(geometry, args) launches NAME on the runtime."""
    return "\n".join(f'extern "C" __attribute__((visibility("default"))) int sim_{k}(const unsigned* g, void** a) '
                     f'{{ return sim::launch({k}, g, a); }}' for k in cc.kernel_names(name))


def build(folder: Path, lanes: int, sources: dict[str, str] | None = None) -> ctypes.CDLL:
    """One shared library of every kernel source for `lanes`, cached in `folder` by content."""
    if CXX is None:
        raise RuntimeError("no host C++ compiler (g++) to build the kernels for the CPU")
    texts = {name: (sources or {}).get(name, cc.source(name)) for name in cc.SOURCES}
    units = {name: text + "\n" + _wrappers(text, name) + "\n" for name, text in texts.items()}
    runtime, header = (HERE / "runtime.h").read_text(), cc.source(cc.HEADER)
    key = hashlib.sha256(repr((lanes, runtime, header, sorted(units.items()))).encode()).hexdigest()[:16]
    lib = folder / f"kernels-{lanes}-{key}.so"
    if not lib.exists():
        work = folder / f"src-{key}"
        work.mkdir(parents=True, exist_ok=True)
        (work / cc.HEADER).write_text(header)
        objects = []
        for name, text in units.items():
            (work / name).write_text(text)
            obj = work / (name + ".o")
            run = subprocess.run([CXX, "-std=c++20", "-O2", "-fPIC", *HERMETIC, "-c", "-x", "c++", f"-DLANES={lanes}",
                                  "-include", str(HERE / "runtime.h"), f"-I{work}", str(work / name), "-o", str(obj)],
                                 capture_output=True, text=True, timeout=300)
            if run.returncode:
                raise RuntimeError(f"the host build of {name} failed:\n{run.stderr}")
            objects.append(str(obj))
        subprocess.run([CXX, "-shared", "-Wl,-Bsymbolic", "-o", str(lib), *objects], check=True, timeout=120)
    return ctypes.CDLL(str(lib))


# The runtime's state (the fibers, the shuffle exchange, `__shared__` as statics) is global to
# the library, and ctypes lets go of the GIL during a call: launches from two threads (an
# engine thread and a test's) must not overlap.
_ONE_LAUNCH = threading.Lock()
_SCALAR = {np.int32: ctypes.c_int32, np.float32: ctypes.c_float, np.int64: ctypes.c_int64,
           np.uint32: ctypes.c_uint32}


def launch(lib: ctypes.CDLL, name: str, grid: tuple, block: tuple, args: tuple) -> None:
    """One kernel over the grid, its arguments as a device launch passes them (arrays, NumPy
    scalars of the parameters' types)."""
    values = [ctypes.c_void_p(a.ctypes.data) if isinstance(a, np.ndarray) else _SCALAR[type(a)](a) for a in args]
    pointers = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
    geometry = (ctypes.c_uint * 6)(*grid, *(1,) * (3 - len(grid)), *block, *(1,) * (3 - len(block)))
    with _ONE_LAUNCH:
        status = getattr(lib, f"sim_{name}")(geometry, pointers)
    if status:
        raise RuntimeError(f"{name} grid {grid} block {block}: the block deadlocked or is too large ({status})")


class HostLauncher(Launcher):
    """The kernels as compiled for the CPU, launched from the same packed arguments as on a
    device (checked against the sources' signatures and launch bounds first); the products in
    float32 NumPy, as ReferenceLauncher runs them."""

    def __init__(self, wtype: str, lanes: int, lib: ctypes.CDLL):
        super().__init__(wtype, lanes)
        self.lib = lib
        self.checker = ReferenceLauncher(wtype, lanes)
        self.launches: list[str] = []

    def launch(self, name, grid, block, args):
        self.checker._check(name, block, args)
        self.launches.append(name)
        launch(self.lib, name, grid, block, args)

    def gemm(self, *args):
        self.checker.gemm(*args)
