"""What the compiler makes of the integer tile (engine/drivers/cpu/kernels/integer_tile.py).

LLVM's tuning for Intel cores with VNNI (rocketlake, the name a Xeon VM reported, and
sapphirerapids; not znver4) rewrites each vpdpwssd into vpmaddwd + vpaddd, two instructions on
the same two vector ports: the multi-token products ran at two thirds of their speed there.
The runtime asks for the fused instruction. Built for a CPU without AVX-512 (POOT_CPU_ISA=avx2),
the tile must hold no instruction past AVX2 (AVX-512's, or GFNI's, which LLVM had used to shift
the 4-bit codes): on a CPU without them one would stop the process.
These checks read the tile's machine code in a fresh interpreter (the target is fixed by the
first compile in a process, and cached code cannot be disassembled)."""

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
mode, tuning = sys.argv[1:]
target.choose(numba, mode)
if tuning != "host":  # the mode's features, another core's tuning (this host must run the code)
    numba.config.CPU_NAME = tuning
from poot.engine.drivers.cpu.kernels import integer_layout
from poot.engine.drivers.cpu.kernels import integer_tile as k

rows, tokens = k.SHAPE.many

@numba.njit  # no cache: its machine code must be readable
def many(codes, dw, mw, v, dx, c, out):
    k.tile_many_4(codes, dw, mw, v, dx, c, out, 0, 0, tokens, 1, 0)

lanes = integer_layout.lane_width(18)
scales = np.zeros((rows, lanes), np.float32)
many(np.zeros((rows, 288), np.uint8), scales, scales, np.zeros((tokens, 576), np.int16), scales, scales,
     np.zeros(rows * tokens, np.float32))
asm = many.inspect_asm(many.signatures[0])
counts = collections.Counter(re.findall(r"^\\s+(v\\w+)\\s", asm, re.M))
# Registers and instructions past AVX2: 512-bit or mask registers, VNNI, GFNI, VAES, VPCLMULQDQ.
counts["past_avx2"] = len(re.findall(r"%zmm|%k[0-7]|vpdp|vgf2p8|vaes|vpclmul", asm))
counts["sums"] = rows * tokens
print(json.dumps(counts))
"""


def _tile_instructions(mode: str, tuning: str) -> dict[str, int]:
    done = subprocess.run([sys.executable, "-c", _PROGRAM, mode, tuning], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("tuning", ["host", "sapphirerapids"])
def test_the_tiles_dot_products_stay_one_instruction_each(tuning):
    if route_for(target.host_features()) != "vpdpwssd":
        pytest.skip("this CPU has no AVX-512 VNNI")
    counts = _tile_instructions("native", tuning)
    # A tile over 576 codes: 18 blocks, 9 chunks of 64, two dot products a chunk for each of
    # its (row, token) sums.
    assert counts.get("vpdpwssd", 0) == counts["sums"] * 9 * 2, counts
    assert counts.get("vpmaddwd", 0) == 0, counts


@pytest.mark.parametrize("tuning", ["host", "znver1"])
def test_the_avx2_tile_holds_no_instruction_past_avx2(tuning):
    host = target.host_features()
    if not all(f in host for f in target.NEEDS["avx2"]):
        pytest.skip("this CPU has no AVX2")
    if tuning == "znver1" and "+sse4a" not in host:
        tuning = "haswell"  # the host must run what it compiles: Zen's SSE4a is AMD's alone
    counts = _tile_instructions("avx2", tuning)
    # Each dot product of 32 word pairs: vpmaddwd on each 256-bit half, then vpaddd; two a
    # chunk of 64 codes for each sum (the tile's chunks loop: how many the code writes out is
    # LLVM's choice).
    assert counts.get("vpmaddwd", 0) > 0 and counts["vpmaddwd"] % (counts["sums"] * 2 * 2) == 0, counts
    assert counts["past_avx2"] == 0, counts
