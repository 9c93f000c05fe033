"""What the compiler makes of the integer tile (engine/drivers/cpu/kernels/vnni_tile.py).

LLVM's tuning for Intel cores with VNNI (rocketlake, the name a Xeon VM reported, and
sapphirerapids; not znver4) rewrites each vpdpwssd into vpmaddwd + vpaddd, two instructions on
the same two vector ports: the multi-token products ran at two thirds of their speed there.
The runtime asks for the fused instruction; these checks read the tile's machine code, for this
CPU and for an Intel core's tuning, in a fresh interpreter (the target is fixed by the first
compile in a process, and cached code cannot be disassembled)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from poot.engine.drivers.cpu.products.vnni import VnniPath
from poot.engine.drivers.cpu.runtime import shared

runtime = shared()
pytestmark = pytest.mark.skipif(not runtime.available(), reason=runtime.unavailable_reason())

_PROGRAM = """
import collections, json, re, sys
import numba
import numpy as np
from poot.engine.drivers.cpu import runtime
tuning = sys.argv[1]
if tuning == "host":
    runtime.shared().compile()
else:  # the driver's features, another core's tuning (this host must run the code)
    runtime.prefer_wide_vectors(numba)
    numba.config.CPU_NAME = tuning
from poot.engine.drivers.cpu.kernels import vnni_layout
from poot.engine.drivers.cpu.kernels import vnni_tile as k

@numba.njit  # no cache: its machine code must be readable
def wide(codes, dw, mw, v, dx, c, out):
    k.tile_wide_4(codes, dw, mw, v, dx, c, out, 0, 0, 4, 1, 0)

lanes = vnni_layout.lane_width(18)
scales = np.zeros((4, lanes), np.float32)
wide(np.zeros((4, 288), np.uint8), scales, scales, np.zeros((4, 576), np.int16), scales, scales,
     np.zeros(16, np.float32))
asm = wide.inspect_asm(wide.signatures[0])
print(json.dumps(collections.Counter(re.findall(r"^\\s+(v\\w+)\\s", asm, re.M))))
"""


def _tile_instructions(tuning: str) -> dict[str, int]:
    done = subprocess.run([sys.executable, "-c", _PROGRAM, tuning], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("tuning", ["host", "sapphirerapids"])
def test_the_tiles_dot_products_stay_one_instruction_each(tuning):
    if not VnniPath.available(runtime):
        pytest.skip("this CPU has no AVX-512 VNNI")
    counts = _tile_instructions(tuning)
    # A 4 x 4 tile over 576 codes: 18 blocks, 9 chunks of 64, two dot products a chunk for
    # each of its 16 (row, token) sums.
    assert counts.get("vpdpwssd", 0) == 4 * 4 * 9 * 2, counts
    assert counts.get("vpmaddwd", 0) == 0, counts
