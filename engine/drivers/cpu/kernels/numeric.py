"""What every kernel of this folder shares: numba's float flags and error model, and the
float32 helpers compiled into the kernels (exp, float bits, a KV element's storage).

LLVM has no vector exp here (numba's SVML path needs Intel's patched LLVM), so the kernels use
their own: a float32 Cephes-style polynomial whose 2^n is built from exponent bits, which
vectorizes (about 10x a scalar libm call per element).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

ROWS_PER_TASK = 32  # weight rows per parallel task: enough work to hide the task's start-up
# No nnan/ninf: the running maximum of the softmax starts at -inf.
FASTMATH = {"nsz", "arcp", "contract", "afn", "reassoc"}
# NumPy's error model: a float division by zero gives inf instead of raising. Python's model
# puts a zero check before every division, which keeps the loop around it scalar (SiLU's
# divide ran 6x slower).
ERRORS = "numpy"


@intrinsic
def float_from_bits(typingctx, bits):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


@intrinsic
def kv_element(typingctx, value, cache):
    """`value` as `cache` holds it: rounded to float16's bits (round to nearest even) for a
    uint16 cache, which numba reads as float16 bits since it has no float16 of its own;
    unchanged for a float32 one."""
    half = cache.dtype == types.uint16

    def codegen(context, builder, signature, args):
        if half:
            return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
        return args[0]

    return (types.uint16 if half else types.float32)(types.float32, cache), codegen


@njit(inline="always", fastmath=FASTMATH, error_model=ERRORS)
def exp(x):
    """float32 e^x, relative error under 1e-6; inputs outside [-87, 88] saturate there
    (so e^-inf is about 1e-38, not 0: callers that need an exact 0 mask explicitly)."""
    x = x if x > np.float32(-87.0) else np.float32(-87.0)  # selects vectorize; min/max do not
    x = x if x < np.float32(88.0) else np.float32(88.0)
    n = np.float32(np.floor(x * np.float32(1.44269504) + np.float32(0.5)))
    r = x - n * np.float32(0.693359375) + n * np.float32(2.12194440e-4)  # x - n ln2, in two parts
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1)
    return p * float_from_bits((np.int32(n) + np.int32(127)) << np.int32(23))  # times 2^n
