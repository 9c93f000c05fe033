"""This CPU's integer dot-product ceiling: the dot product the compact path's integer products
run on (engine/drivers/cpu/kernels/integer_dot.py: AVX-512 VNNI's vpdpwssd, 32 multiply-adds
of 16-bit words an instruction, or AVX2's vpmaddwd and vpaddd) on registers alone, on every
numba thread. No product on that path can beat it, so a step's
integer products are reported as a share of it (bench_smollm2.py's %dot), the way a one-row
step is reported against the bandwidth bound.

    .venv/bin/python benchmarks/dot_ceiling.py

Eight independent sums a thread: fewer leave the core waiting on each instruction's latency.
Each sum is also the next round's first operand: with operands fixed, LLVM computed AVX2's
vpmaddwd once, outside the loop, and counted only the adds (a ceiling of 340 G on one core).
`measure()` is None where the CPU has no integer path (the compact path then runs without one).
"""

from __future__ import annotations

import time

import numpy as np

CHAINS = 8  # independent sums in flight a thread
LANES = 16  # int32 lanes of a 512-bit vector
_kernel = None


def kernel():
    """The probe, built once: kernel()(seed, n, out) runs n rounds on each of out's rows (one a
    thread); seed holds the two operand vectors (2 x 16 int32)."""
    global _kernel
    if _kernel is None:
        _kernel = _build()
    return _kernel


def _build():
    """The probe: for each thread, `n` rounds of CHAINS dot products on register operands,
    s = s + dot(s, b) for each sum s, the sums stored at the end (else the compiler drops the
    loop)."""
    from llvmlite import ir
    from numba import njit, prange, types
    from numba.core import cgutils
    from numba.extending import intrinsic

    from poot.engine.drivers.cpu.kernels import integer_dot

    i32 = ir.IntType(32)
    vector = ir.VectorType(i32, LANES)

    @intrinsic
    def dots(typingctx, seed, n, out):
        sig = types.void(seed, types.intp, out)

        def codegen(context, builder, signature, args):
            seed_a = context.make_array(signature.args[0])(context, builder, args[0])
            out_a = context.make_array(signature.args[2])(context, builder, args[2])
            words = builder.bitcast(seed_a.data, vector.as_pointer())
            a = builder.load(words, align=4)
            b = builder.load(builder.gep(words, [ir.Constant(i32, 1)]), align=4)
            dot = integer_dot.emitter(builder, integer_dot.route())
            sums = [cgutils.alloca_once_value(builder, builder.add(a, ir.Constant(vector, [k] * LANES)))
                    for k in range(CHAINS)]
            with cgutils.for_range(builder, args[1]):
                for s in sums:
                    value = builder.load(s)
                    builder.store(dot(value, value, b), s)
            total = builder.load(sums[0])
            for s in sums[1:]:
                total = builder.add(total, builder.load(s))
            builder.store(total, builder.bitcast(out_a.data, vector.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    @njit(parallel=True, nogil=True)
    def run(seed, n, out):
        for thread in prange(out.shape[0]):
            dots(seed, n, out[thread])

    return run


def supported() -> bool:
    from poot.engine.drivers.cpu.products.integer import integer_path
    from poot.engine.drivers.cpu.runtime import shared

    return integer_path(shared()) is not None


def measure(seconds: float = 0.3) -> float | None:
    """Multiply-adds per second of the dot product alone on every numba thread (the best of a
    few timings within `seconds`), or None without an integer path."""
    if not supported():
        return None
    import numba

    run = kernel()
    threads = numba.get_num_threads()
    seed = np.arange(2 * LANES, dtype=np.int32)
    out = np.zeros((threads, LANES), np.int32)
    run(seed, 10, out)
    rounds, best = 1 << 16, 0.0
    deadline = time.perf_counter() + seconds
    while True:
        t = time.perf_counter()
        run(seed, rounds, out)
        took = time.perf_counter() - t
        best = max(best, threads * rounds * CHAINS * LANES * 2 / took)
        if took < 0.02:
            rounds *= 4  # too short to time against the threads' wake-up
        elif time.perf_counter() > deadline:
            return best


if __name__ == "__main__":
    import numba

    rate = measure(1.0)
    if rate is None:
        print("no integer path on this CPU: the compact path's integer products do not run here")
    else:
        from poot.engine.drivers.cpu.kernels.integer_dot import route

        print(f"{route()} alone: {rate / 1e9:.0f} G multiply-adds/s on {numba.get_num_threads()} threads")
