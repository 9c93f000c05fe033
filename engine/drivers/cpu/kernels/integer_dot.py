"""The integer kernels' dot product on the instruction set this process compiles for (`route`):
16 int32 lanes, each adding the products of its two pairs of 16-bit words, as LLVM IR
(`emitter`). The sums are exact integers, so every route gives the same bits; what differs is
the instructions, and how many sums a tile can keep in registers (integer_tile.py's SHAPES).

    vpdpwssd    AVX-512 VNNI: multiplies, pairs and adds into the 16 lanes in one instruction
    vpmaddwd    AVX2: vpmaddwd multiplies and pairs into 8 lanes, twice (one 256-bit half of
                the words each), then vpaddd adds; only the add depends on the sum before
    sdot        (Arm NEON's dot product: a place for it here, not written)

numba fixes its target at a process's first compile, and the runtime chooses it before any
kernel is imported (runtime.py, POOT_CPU_ISA), so a process has one route, read from numba's
configuration at import (`target_features`). Importing this compiles nothing and needs
neither numba nor llvmlite (the driver reads ROUTES without them).
"""

from __future__ import annotations

# The CPU features each route needs, in LLVM's names, best first. vpmaddwd's tiles also use
# FMA (llvm.fma) and F16C (block scales kept as float16): every AVX2 CPU has them.
ROUTES = {
    "vpdpwssd": ("+avx512bw", "+avx512vnni"),
    "vpmaddwd": ("+avx2", "+fma", "+f16c"),
}

def target_features() -> frozenset[str]:
    """The CPU features numba compiles for in this process: those its configuration names (the
    runtime sets them before building any kernel), else the host's, as numba itself reads them."""
    import llvmlite.binding as llvm
    import numba

    features = numba.config.CPU_FEATURES
    return frozenset((features if features is not None else llvm.get_host_cpu_features().flatten()).split(","))


def route_for(features: frozenset[str]) -> str | None:
    """The best route `features` allow, or None (no integer products: the float paths run)."""
    return next((name for name, needs in ROUTES.items() if all(f in features for f in needs)), None)


def route() -> str | None:
    """This process's route."""
    return route_for(target_features())


def emitter(builder, name: str):
    """dot(acc, u, a) -> acc + the pairwise products of u and a (each <16 x i32> holding 32
    words), as `name`'s instructions."""
    from llvmlite import ir

    i32, i16 = ir.IntType(32), ir.IntType(16)
    v16i, v32w = ir.VectorType(i32, 16), ir.VectorType(i16, 32)
    module = builder.module
    if name == "vpdpwssd":
        fused = _function(module, "llvm.x86.avx512.vpdpwssd.512", v16i, [v16i] * 3)
        return lambda acc, u, a: builder.call(fused, [acc, u, a])
    if name != "vpmaddwd":
        raise ValueError(f"no integer dot product for route {name!r}")
    v16w = ir.VectorType(i16, 16)
    pairs = _function(module, "llvm.x86.avx2.pmadd.wd", ir.VectorType(i32, 8), [v16w, v16w])
    undefined = ir.Constant(v32w, None)
    halves = [ir.Constant(v16i, list(range(k, k + 16))) for k in (0, 16)]
    join = ir.Constant(v16i, list(range(16)))

    def dot(acc, u, a):
        uw, aw = builder.bitcast(u, v32w), builder.bitcast(a, v32w)
        low, high = (builder.call(pairs, [builder.shuffle_vector(uw, undefined, h),
                                          builder.shuffle_vector(aw, undefined, h)]) for h in halves)
        return builder.add(acc, builder.shuffle_vector(low, high, join))

    return dot


def _function(module, name, result, arguments):
    from llvmlite import ir
    from numba.core import cgutils

    return cgutils.get_or_insert_function(module, ir.FunctionType(result, arguments), name)
