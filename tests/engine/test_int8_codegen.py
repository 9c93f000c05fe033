"""What the compiler makes of the integer tile (engine/drivers/cpu/kernels/integer_tile.py).

LLVM's tuning for Intel cores with VNNI (rocketlake, the name a Xeon VM reported, and
sapphirerapids; not znver4) rewrites each vpdpwssd into vpmaddwd + vpaddd, two instructions on
the same two vector ports: the multi-token products ran at two thirds of their speed there.
The runtime asks for the fused instruction. Built for a CPU without AVX-512 (POOT_CPU_ISA=avx2),
the tile must hold no instruction past AVX2 (AVX-512's, or GFNI's, which LLVM had used to shift
the 4-bit codes): on a CPU without them one would stop the process.
These checks read the tile's machine code in a fresh interpreter (the target is fixed by the
first compile in a process, and cached code cannot be disassembled). The code is compiled,
never run, so a CPU with AVX-512 VNNI is checked on any x86-64 host: LLVM is told the features
of one (VNNI_FEATURES), as the runtime would find them on such a host, and the host tuning the
runtime keeps is one of the named cores."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from poot.engine.drivers.cpu import target
from poot.engine.drivers.cpu.kernels.integer_dot import route_for
from poot.engine.drivers.cpu.runtime import shared

runtime = shared()
pytestmark = pytest.mark.skipif(not runtime.available(), reason=runtime.unavailable_reason())

_PROGRAM = """
import collections, json, re, sys
import numba
import numpy as np
from poot.engine.drivers.cpu import target
mode, tuning, features = sys.argv[1:]
if mode == "vnni":  # a host with AVX-512 VNNI, as target.choose() would see one named `tuning`
    target.prefer_wide_vectors(numba, tuning, features)
else:
    target.choose(numba, mode)
    if tuning != "host":  # the mode's features, another core's tuning
        numba.config.CPU_NAME = tuning
from poot.engine.drivers.cpu.kernels import integer_layout
from poot.engine.drivers.cpu.kernels import integer_tile as k

rows, tokens = k.SHAPE.many

@numba.njit  # no cache: its machine code must be readable
def many(codes, dw, mw, v, dx, c, out):
    k.tile_many_4(codes, dw, mw, v, dx, c, out, 0, 0, tokens, 1, 0)

lanes = integer_layout.lane_width(18)
scales = np.zeros((rows, lanes), np.float32)
args = (np.zeros((rows, 288), np.uint8), scales, scales, np.zeros((tokens, 576), np.int16), scales, scales,
        np.zeros(rows * tokens, np.float32))
signature = tuple(numba.typeof(a) for a in args)
many.compile(signature)  # compiled only: the host need not run it
asm = many.inspect_asm(signature)
counts = collections.Counter(re.findall(r"^\\s+(v\\w+)\\s", asm, re.M))
# Registers and instructions past AVX2: 512-bit or mask registers, VNNI, GFNI, VAES, VPCLMULQDQ.
counts["past_avx2"] = len(re.findall(r"%zmm|%k[0-7]|vpdp|vgf2p8|vaes|vpclmul", asm))
counts["sums"] = rows * tokens
print(json.dumps(counts))
"""


# What LLVM reports for a Xeon with AVX-512 VNNI (Sapphire Rapids, Ice Lake, Zen 4 alike), in
# the part the tile's code can use.
VNNI_FEATURES = ",".join("+" + f for f in (
    "sse2", "ssse3", "sse4.1", "sse4.2", "popcnt", "avx", "avx2", "fma", "f16c", "bmi", "bmi2", "avx512f",
    "avx512cd", "avx512dq", "avx512bw", "avx512vl", "avx512vnni", "evex512"))


def _tile_instructions(mode: str, tuning: str, features: str = "") -> dict[str, int]:
    done = subprocess.run([sys.executable, "-c", _PROGRAM, mode, tuning, features], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("tuning", ["host", "sapphirerapids", "rocketlake", "znver4"])
def test_the_tiles_dot_products_stay_one_instruction_each(tuning):
    """On any host, for each named core's tuning (LLVM's for rocketlake and sapphirerapids
    split the instruction unless asked not to); and on this host, where it has VNNI. A host
    without it takes the AVX2 route (the next test holds that route to AVX2)."""
    if tuning == "host":
        if route_for(target.host_features()) != "vpdpwssd":
            assert route_for(target.host_features()) in ("vpmaddwd", None)
            return
        counts = _tile_instructions("native", "host")
    else:
        counts = _tile_instructions("vnni", tuning, VNNI_FEATURES)
    # A tile over 576 codes: 18 blocks, 9 chunks of 64, two dot products a chunk for each of
    # its (row, token) sums.
    assert counts.get("vpdpwssd", 0) == counts["sums"] * 9 * 2, counts
    assert counts.get("vpmaddwd", 0) == 0, counts


@pytest.mark.parametrize("tuning", ["host", "znver1"])
def test_the_avx2_tile_holds_no_instruction_past_avx2(tuning):
    host = target.host_features()
    if not all(f in host for f in target.NEEDS["avx2"]):
        pytest.skip("this CPU has no AVX2")
    counts = _tile_instructions("avx2", tuning)
    # Each dot product of 32 word pairs: vpmaddwd on each 256-bit half, then vpaddd; two a
    # chunk of 64 codes for each sum (the tile's chunks loop: how many the code writes out is
    # LLVM's choice).
    assert counts.get("vpmaddwd", 0) > 0 and counts["vpmaddwd"] % (counts["sums"] * 2 * 2) == 0, counts
    assert counts["past_avx2"] == 0, counts
