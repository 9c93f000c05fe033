"""A request's random stream: counter-based, so a draw is a pure function of its place.

The uniform behind a choice's k-th sampled token is Philox4x32-10 (Salmon et al., "Parallel
random numbers: as easy as 1, 2, 3", SC 2011; the Random123 definition) of

    key     = (seed mod 2**32, seed // 2**32 mod 2**32)      the request's seed, mod 2**64
    counter = (k mod 2**32, k // 2**32, choice, 0)

taking the first output word's top 24 bits: u = (word >> 8) / 2**24, in [0, 1) and exact
in float32. Nothing is consumed: a draw does not depend on which draws came before, which
tokens were thrown away (a rejected speculative position) or where it is computed, so a
device kernel that implements the same function (engine/drivers/wgsl.py, u32 ops only)
draws the same token as the host. A request without a seed gets a random one when the
engine takes it; a request's n choices share the seed and differ in `choice`.

`philox4x32` runs on Python ints (one draw, a few microseconds) and, unchanged, on uint64
NumPy arrays of 32-bit values (any number of draws at once).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import numpy as np

M32 = 0xFFFFFFFF
MASK64 = (1 << 64) - 1
PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57  # round multipliers
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85  # key schedule (golden ratio, sqrt(3) - 1)
ROUNDS = 10
UNIFORM_BITS = 24


def philox4x32(counter, key):
    """Philox4x32-10 of a counter (4 words) under a key (2 words). Words are Python ints or
    uint64 arrays holding 32-bit values; the 32x32 -> 64-bit products are exact in either."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(ROUNDS):
        if r:
            k0, k1 = (k0 + PHILOX_W0) & M32, (k1 + PHILOX_W1) & M32
        p0, p1 = c0 * PHILOX_M0, c2 * PHILOX_M1
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & M32, (p0 >> 32) ^ c3 ^ k1, p0 & M32
    return c0, c1, c2, c3


def uniforms(key: int, choice: int, ks: np.ndarray) -> np.ndarray:
    """The draws at counters `ks` (uint64) of the stream (key, choice), as float64."""
    ks = np.asarray(ks, np.uint64)
    u32 = np.uint64(M32)
    zero = np.zeros_like(ks)
    word = philox4x32((ks & u32, ks >> np.uint64(32), zero + np.uint64(choice), zero),
                      (zero + np.uint64(key & M32), zero + np.uint64(key >> 32)))[0]
    return (word >> np.uint64(32 - UNIFORM_BITS)).astype(np.float64) / 2.0**UNIFORM_BITS


@dataclass(slots=True, frozen=True)
class RandomStream:
    key: int  # the seed modulo 2**64
    choice: int = 0

    def uniform(self, k: int) -> float:
        """The draw behind the k-th sampled token (k = the outputs before it)."""
        word = philox4x32((k & M32, k >> 32, self.choice, 0), (self.key & M32, self.key >> 32))[0]
        return (word >> (32 - UNIFORM_BITS)) / 2.0**UNIFORM_BITS


def random_stream(seed: int | None, choice: int = 0) -> RandomStream:
    """The engine's `random_stream` part: choice `choice`'s stream of a request with `seed`
    (None: a random seed, drawn now)."""
    key = secrets.randbits(64) if seed is None else seed & MASK64
    return RandomStream(key, choice)
