"""The integer dot ceiling (benchmarks/dot_ceiling.py) is a rate: it is only honest if the probe
really runs every instruction it counts."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import dot_ceiling


@pytest.mark.parametrize("rounds", [1, 7, 1000])
def test_the_probe_runs_every_round_of_its_dot_products_on_every_thread(rounds):
    if not dot_ceiling.supported():
        pytest.skip("no integer path on this CPU")
    import numba

    rng = np.random.default_rng(rounds)
    seed = rng.integers(-2**31, 2**31, 2 * dot_ceiling.LANES, dtype=np.int64).astype(np.int32)
    out = np.zeros((numba.get_num_threads(), dot_ceiling.LANES), np.int32)
    dot_ceiling.kernel()(seed, rounds, out)
    # Each round adds to every int32 lane the products of its two 16-bit word pairs, the sum's
    # own words times the second operand's (wrapping as the instructions do).
    b = seed[16:].view(np.int16).astype(np.int64).reshape(16, 2)
    sums = [seed[:16] + np.int32(k) for k in range(dot_ceiling.CHAINS)]
    for _ in range(rounds):
        sums = [(s.astype(np.int64) + (s.view(np.int16).astype(np.int64).reshape(16, 2) * b).sum(axis=1)) % 2**32
                for s in sums]
        sums = [s.astype(np.uint32).view(np.int32) for s in sums]
    want = (sum(s.astype(np.int64) for s in sums) % 2**32).astype(np.uint32).view(np.int32)
    assert all(np.array_equal(row, want) for row in out)


def test_the_ceiling_is_a_rate_within_what_one_instruction_a_cycle_allows():
    if not dot_ceiling.supported():
        pytest.skip("no integer path on this CPU")
    import numba

    rate = dot_ceiling.measure(0.1)
    # 32 multiply-adds an instruction, at most two instructions a cycle, at most 6 GHz
    assert 0 < rate <= numba.get_num_threads() * 2 * 32 * 6e9
