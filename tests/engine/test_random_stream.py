"""A request's random stream: the uniform behind its k-th sampled token is a pure function of
(seed, choice, k), Philox4x32-10 as Random123 defines it, so any backend (the host, a WGSL
kernel) that computes the same function draws the same token."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from poot.engine.random_stream import RandomStream, philox4x32, random_stream, uniforms

seeds = st.integers(-(2**70), 2**70)
choices = st.integers(0, 15)
counters = st.integers(0, 2**32 - 1)


# Random123's tests/kat_vectors, the three `philox4x32 10` lines: counter[4] key[2] -> result[4].
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


def test_philox_gives_random123s_known_answers_on_python_ints_and_on_arrays():
    for counter, key, expected in KNOWN_ANSWERS:
        assert philox4x32(counter, key) == expected
    c = np.array([k[0] for k in KNOWN_ANSWERS], np.uint64).T
    k = np.array([k[1] for k in KNOWN_ANSWERS], np.uint64).T
    out = philox4x32(tuple(c), tuple(k))
    assert [tuple(int(w[i]) for w in out) for i in range(3)] == [e for _, _, e in KNOWN_ANSWERS]


@given(seed=seeds, choice=choices, ks=st.lists(counters, min_size=1, max_size=20))
def test_a_draw_is_a_pure_function_of_seed_choice_and_counter(seed, choice, ks):
    stream = random_stream(seed, choice)
    forward = [stream.uniform(k) for k in ks]
    # Drawing in another order, from another object, or all at once changes nothing.
    backward = [random_stream(seed, choice).uniform(k) for k in reversed(ks)][::-1]
    assert forward == backward
    assert uniforms(stream.key, choice, np.array(ks, np.uint64)).tolist() == forward


@given(seed=seeds, choice=choices, ks=st.lists(counters, min_size=1, max_size=50))
def test_draws_lie_in_the_unit_interval_on_a_24_bit_grid(seed, choice, ks):
    u = uniforms(random_stream(seed, choice).key, choice, np.array(ks, np.uint64))
    assert ((0.0 <= u) & (u < 1.0)).all()
    assert (u * 2**24 == np.floor(u * 2**24)).all()  # exact in float32, as a WGSL kernel has it


@settings(max_examples=200)
@given(a=st.tuples(seeds, choices), b=st.tuples(seeds, choices))
def test_distinct_seeds_or_choices_draw_distinct_streams(a, b):
    (sa, ca), (sb, cb) = a, b
    if (sa % 2**64, ca) == (sb % 2**64, cb):  # the same stream: seeds are taken modulo 2**64
        return
    ks = np.arange(8, dtype=np.uint64)
    assert not np.array_equal(uniforms(random_stream(sa, ca).key, ca, ks),
                              uniforms(random_stream(sb, cb).key, cb, ks))


def test_a_stream_is_uniform():
    u = uniforms(random_stream(7).key, 0, np.arange(40_000, dtype=np.uint64))
    counts = np.bincount((u * 20).astype(int), minlength=20)
    expected = len(u) / 20
    assert ((counts - expected) ** 2 / expected).sum() < 60  # chi-square, 19 dof: p < 1e-5 beyond
    assert abs(u.mean() - 0.5) < 0.01


def test_an_unseeded_stream_draws_its_own_key():
    keys = {random_stream(None).key for _ in range(8)}
    assert len(keys) == 8 and all(0 <= k < 2**64 for k in keys)


def test_the_key_is_the_seed_modulo_2_to_the_64():
    assert random_stream(-1) == RandomStream(2**64 - 1, 0)
    assert random_stream(2**64 + 5, 3) == RandomStream(5, 3)
