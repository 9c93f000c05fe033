"""Which CPU numba compiles the kernels for (`choose`): the host as it is, or the host with
fewer instruction sets, asked for by POOT_CPU_ISA, so that one machine can run, test and time
the code a smaller CPU runs:

    native   the host's name and features (the default)
    avx2     the host's name and tuning, with every vector extension past AVX2, FMA and F16C
             off (AVX-512, AVX10, AMX, AVX-VNNI, AVX-IFMA, AVX-NE-CONVERT, and GFNI, VAES and
             VPCLMULQDQ, which Zen 1 and 2 and Intel's cores before Ice Lake lack): the vector
             instructions every AVX2 CPU has. The integer products take AVX2's dot product
             (kernels/integer_dot.py), the same bits as VNNI's.
    x86-64   the x86-64 baseline (SSE2; no AVX, FMA or F16C): no integer products, the products
             on the float paths, the KV cache in float32 (no F16C to widen float16 with).

The host's own name (its tuning, its scheduling model) is kept for avx2: LLVM then tunes for
the core the code runs on, as it would on an AVX2 host, and the two modes differ in the
instruction set alone. The plan names the result (`isa`); rows, positions and every result
bit stay as they were. numba keys its on-disk cache by the CPU name and features, so the
modes' compiled kernels do not mix.
"""

from __future__ import annotations

import os

VARIABLE = "POOT_CPU_ISA"
CHOICES = ("native", "avx2", "x86-64")
# Feature name prefixes (LLVM's) of the vector extensions some AVX2 CPUs lack (LLVM used GFNI to
# shift the 4-bit codes' bytes, an instruction Zen 1 to 3 do not have).
PAST_AVX2 = ("avx512", "avx10", "amx", "avxvnni", "avxifma", "avxneconvert", "evex512", "gfni", "vaes", "vpclmulqdq")
NEEDS = {"avx2": ("+avx2", "+fma", "+f16c")}  # what the host must have for a mode
# NumPy's OpenBLAS picks its kernels by the CPU when NumPy loads, before this module can say
# anything: OPENBLAS_CORETYPE set before then holds it to a mode (poot-serve sets it itself).
# Its cores past AVX2 (DYNAMIC_ARCH's names) and the one to ask for instead.
BLAS_PAST_AVX2 = ("SkylakeX", "Cooperlake", "SapphireRapids")
BLAS_CORE = {"avx2": "Haswell"}


def requested(value: str | None = None) -> str:
    """The mode asked for (`value`, else POOT_CPU_ISA, else native); ValueError if unknown."""
    asked = (value if value is not None else os.environ.get(VARIABLE, "")).strip().lower() or "native"
    if asked not in CHOICES:
        raise ValueError(f"{VARIABLE}={asked!r}: expected one of {', '.join(CHOICES)}")
    return asked


def host_features() -> frozenset[str]:
    """The host CPU's features, whatever numba compiles for (LLVM's names: '+avx2')."""
    import llvmlite.binding as llvm

    return frozenset(llvm.get_host_cpu_features().flatten().split(","))


def avx2_only(features: str) -> str:
    """LLVM's feature string with every vector extension past AVX2 off (PAST_AVX2)."""
    return ",".join("-" + f[1:] if f[1:].startswith(PAST_AVX2) else f for f in features.split(","))


def choose(numba, mode: str) -> None:
    """Sets numba's target for `mode` (see the module), where nothing has set it yet (numba
    fixes it at a process's first compile; NUMBA_CPU_NAME and NUMBA_CPU_FEATURES set it too).
    Raises RuntimeError when the host lacks what the mode needs, or when the target is already
    set and a mode other than native is asked for."""
    import llvmlite.binding as llvm

    if numba.config.CPU_NAME is not None or numba.config.CPU_FEATURES is not None:
        if mode != "native":
            raise RuntimeError(f"{VARIABLE}={mode}: numba's target is already set (NUMBA_CPU_NAME/FEATURES)")
        return
    host = llvm.get_host_cpu_features().flatten()
    missing = [f for f in NEEDS.get(mode, ()) if f not in host.split(",")]
    if missing:
        raise RuntimeError(f"{VARIABLE}={mode}: this CPU lacks {', '.join(f[1:] for f in missing)}")
    if mode == "native":
        prefer_wide_vectors(numba, llvm.get_host_cpu_name(), host)
    elif mode == "avx2":
        numba.config.CPU_NAME = llvm.get_host_cpu_name()
        numba.config.CPU_FEATURES = avx2_only(host)
    else:
        numba.config.CPU_NAME, numba.config.CPU_FEATURES = "x86-64", ""


def prefer_wide_vectors(numba, name: str, features: str) -> None:
    """Lets LLVM use the host's widest vectors. For AVX-512 hosts it prefers 256-bit ones by
    default (older chips slowed their clock for 512-bit work); here the few-token products
    ran 1.3-1.7x faster with 512-bit vectors and single-threaded paged attention 1.4x.
    With VNNI, it also asks for vpdpwssd as one instruction: LLVM's tuning for Intel cores
    (rocketlake, as a Xeon VM reported itself, and sapphirerapids; not znver4) splits it into
    vpmaddwd + vpaddd, which compete for the same two vector ports; the multi-token integer
    products ran 1.5x faster fused (SmolLM2's 32-row products 70 against 43 ms)."""
    have = features.split(",")
    if "+avx512f" in have:
        numba.config.CPU_NAME = name
        numba.config.CPU_FEATURES = features + ",-prefer-256-bit" + (",+fast-dpwssd" if "+avx512vnni" in have else "")


def isa(features: frozenset[str]) -> str:
    """The instruction set the integer products run on, as the plan names it."""
    from .kernels.integer_dot import route_for

    return {"vpdpwssd": "avx512-vnni", "vpmaddwd": "avx2"}.get(route_for(features)) or \
        ("avx" if "+avx" in features else "x86-64")


def blas_warning(mode: str, core: str) -> str:
    """What to tell the operator when NumPy's OpenBLAS (running `core`'s kernels) goes past
    `mode`'s instruction sets; "" when it does not."""
    if mode == "avx2" and core in BLAS_PAST_AVX2:
        return (f"{VARIABLE}=avx2, but NumPy's OpenBLAS runs its {core} kernels (AVX-512): start the "
                f"process with OPENBLAS_CORETYPE={BLAS_CORE['avx2']} for AVX2's")
    return ""
