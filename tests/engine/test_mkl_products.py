"""MKL's packed products agree with a float64 reference for every shape the CPU driver
gives them, and the driver's kernels send many-token products there (and few-token ones
not)."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poot.engine.drivers.cpu.platform import mkl as mkl_products
from poot.engine.drivers.cpu.products.few_tokens import FEW_TOKENS
from poot.engine.drivers.cpu.runtime import shared

runtime = shared()

needs_mkl = pytest.mark.skipif(not mkl_products.available(), reason=mkl_products.unavailable_reason())


def _mkl_installed() -> bool:
    try:
        importlib.metadata.distribution("mkl")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(not _mkl_installed(), reason="the mkl wheel is not installed (not a Linux x86-64 machine)")
def test_installed_mkl_loads_and_passes_its_known_product():
    """Where the project's dependencies brought the mkl wheel, the products must load: a
    library that fails its smoke product would otherwise only turn the MKL tests into skips."""
    assert mkl_products.available(), mkl_products.unavailable_reason()


@needs_mkl
@settings(max_examples=40, deadline=None)
@given(o=st.integers(1, 300), i=st.integers(1, 200), tokens=st.integers(0, 90), seed=st.integers(0, 2**16))
def test_packed_products_match_a_float64_reference(o, i, tokens, seed):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((o, i), dtype=np.float32)
    x = rng.standard_normal((i, tokens), dtype=np.float32)
    ref = w.astype(np.float64) @ x
    packed = mkl_products.PackedWeight(w)
    w[...] = 0  # the packed copy is the packing's own
    got = mkl_products.matmul(packed, x)
    assert got.shape == (o, tokens)
    np.testing.assert_allclose(got, ref, atol=1e-3, rtol=1e-4)
    # Token-major activations (the attention output) as a transposed view, no copy asked.
    np.testing.assert_allclose(mkl_products.matmul(packed, np.ascontiguousarray(x.T).T), ref, atol=1e-3, rtol=1e-4)


@needs_mkl
@settings(max_examples=30, deadline=None)
@given(o=st.integers(1, 300), i=st.integers(1, 120), tokens=st.integers(0, 70), seed=st.integers(0, 2**16))
def test_output_head_products_come_out_token_major(o, i, tokens, seed):
    """The output head packed as the right-hand matrix gives (tokens, vocab) logits as
    they are returned, with no transposing copy of the largest array of the step."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((o, i), dtype=np.float32)
    x = rng.standard_normal((i, tokens), dtype=np.float32)
    ref = (w.astype(np.float64) @ x).T
    packed = mkl_products.PackedWeight(w, right=True)
    w[...] = 0  # the packed copy is the packing's own
    got = mkl_products.matmul_token_major(packed, x)
    assert got.shape == (tokens, o) and got.flags.c_contiguous
    np.testing.assert_allclose(got, ref, atol=1e-3, rtol=1e-4)


@needs_mkl
@settings(max_examples=30, deadline=None)
@given(o=st.integers(1, 100), i=st.integers(1, 80), tokens=st.integers(0, 70), seed=st.integers(0, 2**16),
       token_major=st.booleans())
def test_packed_products_accumulate_into_the_residual(o, i, tokens, seed, token_major):
    """acc += w @ x, in place on acc (MKL adds into it when its width needs no padding)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((o, i), dtype=np.float32)
    x = rng.standard_normal((i, tokens), dtype=np.float32)
    if token_major:
        x = np.ascontiguousarray(x.T).T
    acc = rng.standard_normal((o, tokens), dtype=np.float32)
    want = acc.astype(np.float64) + w.astype(np.float64) @ x
    before = acc.ctypes.data
    mkl_products.matmul_add(mkl_products.PackedWeight(w), x, acc)
    assert acc.ctypes.data == before
    np.testing.assert_allclose(acc, want, atol=1e-3, rtol=1e-4)


@needs_mkl
def test_packed_products_take_strided_inputs():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 48), dtype=np.float32)
    a = rng.standard_normal((20, 48), dtype=np.float32)
    np.testing.assert_allclose(mkl_products.matmul(mkl_products.PackedWeight(w), a.T), w @ a.T, atol=1e-4)


def _leading_part(x: np.ndarray, rng) -> np.ndarray:
    """x as the leading rows and columns of a larger array (attention reads the keys up to
    a tile's end out of the row's whole context): items spaced wider than they are."""
    big = rng.standard_normal((x.shape[0], x.shape[1] + 5, x.shape[2] + 3), dtype=np.float32)
    big[:, : x.shape[1], : x.shape[2]] = x
    return big[:, : x.shape[1], : x.shape[2]]


@needs_mkl
@pytest.mark.parametrize("transpose_a", [False, True])
@pytest.mark.parametrize("transpose_b", [False, True])
@pytest.mark.parametrize("sliced", [False, True])
def test_batched_products_match_numpy_for_plain_and_transposed_views(transpose_a, transpose_b, sliced):
    rng = np.random.default_rng(2)
    a = rng.standard_normal((3, 37, 16), dtype=np.float32)
    b = rng.standard_normal((3, 16, 29), dtype=np.float32)
    if transpose_a:
        a = np.ascontiguousarray(a.swapaxes(1, 2)).swapaxes(1, 2)
    if transpose_b:
        b = np.ascontiguousarray(b.swapaxes(1, 2)).swapaxes(1, 2)
    if sliced:
        a = _leading_part(a.swapaxes(1, 2), rng).swapaxes(1, 2) if transpose_a else _leading_part(a, rng)
        b = _leading_part(b.swapaxes(1, 2), rng).swapaxes(1, 2) if transpose_b else _leading_part(b, rng)
    np.testing.assert_allclose(mkl_products.batched_matmul(a, b), np.matmul(a, b), atol=1e-4)
    assert mkl_products.batched_matmul(a[:, :0], b).shape == (3, 0, 29)


@needs_mkl
def test_the_kernels_send_many_token_products_to_mkl_and_few_token_ones_not(monkeypatch):
    from poot.engine.drivers.cpu.products import ModelProducts

    if not runtime.available():
        pytest.skip(runtime.unavailable_reason())
    rng = np.random.default_rng(3)
    w = rng.standard_normal((512, 256), dtype=np.float32)  # above MIN_PACKED_WEIGHTS
    small = rng.standard_normal((8, 8), dtype=np.float32)
    products = ModelProducts({"w": w, "small": small}, ["w", "small"], runtime)
    assert products.packed == 1
    calls = []
    real = mkl_products.matmul
    monkeypatch.setattr(mkl_products, "matmul", lambda p, x: calls.append(x.shape[1]) or real(p, x))
    for tokens in (1, max(FEW_TOKENS), max(FEW_TOKENS) + 1, 64):
        x = rng.standard_normal((256, tokens), dtype=np.float32)
        np.testing.assert_allclose(products["w"].run(x), w.astype(np.float64) @ x, atol=1e-3, rtol=1e-4)
    assert calls == [max(FEW_TOKENS) + 1, 64]
    products["small"].run(rng.standard_normal((8, 20), dtype=np.float32))  # not packed: not on MKL
    assert calls == [max(FEW_TOKENS) + 1, 64]


@needs_mkl
def test_the_plan_counts_the_packed_copies_of_the_weights(monkeypatch):
    """The packed copies live beside the originals (the few-token kernel reads those), so
    the memory the plan fits the KV pool into must leave room for both."""
    from poot.engine.drivers.cpu import CpuDriver
    from poot.engine.models.synthetic import synthetic_llama

    if not runtime.available():
        pytest.skip(runtime.unavailable_reason())
    monkeypatch.setattr(mkl_products, "MIN_PACKED_WEIGHTS", 1)
    model = synthetic_llama(5)
    raw = sum(w.nbytes for w in model.weights.values())
    matrices = sum(w.nbytes for w in model.weights.values() if w.ndim == 2)
    assert CpuDriver(mkl=False).weight_bytes(model) == raw
    assert CpuDriver().weight_bytes(model) == raw + matrices


def test_the_token_budget_is_a_whole_number_of_product_widths():
    """MKL computes a product of T tokens on T rounded up to PAD_TOKENS columns, so a step just
    over a width costs a whole width more: a plan whose driver pads that way rounds its budget
    down to whole widths (Plan.step_budget)."""
    from poot.engine.drivers.cpu import CpuDriver
    from poot.engine.models.synthetic import synthetic_llama
    from poot.engine.plan import fit_plan

    model = synthetic_llama(5)
    plain = CpuDriver(memory_bytes=1 << 30, mkl=False).device()
    assert plain.token_multiple == 1
    budget = fit_plan(plain, model.config, 0).token_budget
    rounded = fit_plan(dataclasses.replace(plain, token_multiple=16), model.config, 0).token_budget
    assert rounded % 16 == 0 and budget - 16 < rounded <= budget
    if mkl_products.available() and runtime.available():
        assert CpuDriver(memory_bytes=1 << 30).device().token_multiple == mkl_products.PAD_TOKENS


def _mapping_flags(address: int) -> list[str]:
    """The VmFlags of the /proc/self/smaps mapping that holds `address`."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def _resident_bytes(a: np.ndarray) -> int:
    """Bytes of the pages under `a` that are in memory (/proc/self/pagemap's present bit)."""
    page = os.sysconf("SC_PAGE_SIZE")
    first, last = a.ctypes.data // page, (a.ctypes.data + a.nbytes - 1) // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = np.frombuffer(f.read((last - first + 1) * 8), np.uint64)
    return int((entries >> np.uint64(63)).sum()) * page


@needs_mkl
@pytest.mark.skipif(not os.path.exists("/proc/self/pagemap"), reason="needs Linux's /proc/self/smaps and pagemap")
@pytest.mark.parametrize("right", [False, True], ids=["left", "head"])
def test_a_packed_weight_keeps_resident_only_what_mkl_wrote(right):
    """MKL asks for 2-3.4x a weight's size and writes about its size. Where the rest may be
    merged into transparent huge pages, khugepaged fills it in over the first minutes of
    serving and the process grows by that much; the buffer is advised against huge pages."""
    w = np.random.default_rng(0).standard_normal((576, 1536), dtype=np.float32)
    packed = mkl_products.PackedWeight(w, right=right)
    assert packed.buffer.nbytes > 1.5 * w.nbytes  # the slack this is about
    assert "nh" in _mapping_flags(packed.buffer.ctypes.data)  # MADV_NOHUGEPAGE
    # Nor is the slack written through (as the KV pool is): it would stay resident for nothing.
    assert _resident_bytes(packed.buffer) < 0.8 * packed.buffer.nbytes
