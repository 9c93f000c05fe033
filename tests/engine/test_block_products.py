"""The CPU driver's products on block codes (engine/drivers/cpu_block_products.py, the integer
kernels of cpu_int8_kernels.py): every path against float64 on the same quantized activations,
a token's result independent of the rest of the step, and the quantization's error bound."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poot.engine.drivers import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason=cpu_kernels.unavailable_reason())

BLOCK = 32


def _codes(rng, rows: int, cols: int, signed: bool):
    """Q8_0-like (signed bytes, no offset) or Q4_1-like (0..15 with a per-block minimum) codes."""
    blocks = cols // BLOCK
    d = rng.uniform(0.001, 0.1, (rows, blocks)).astype(np.float16).astype(np.float32)
    if signed:
        q = rng.integers(-127, 128, (rows, cols)).astype(np.int8)
        m = np.zeros((rows, blocks), np.float32)
    else:
        q = rng.integers(0, 16, (rows, cols)).astype(np.uint8)
        m = -rng.uniform(0, 0.5, (rows, blocks)).astype(np.float16).astype(np.float32)

    def values():
        w = q.reshape(rows, blocks, BLOCK).astype(np.float32) * d[:, :, None] + m[:, :, None]
        return w.reshape(rows, cols)

    return SimpleNamespace(codes=q, d=d, m=m, values=values)


def _paths() -> tuple[str, ...]:
    from poot.engine.drivers import cpu_block_products, mkl_products

    paths = ["blocks", "openblas"]
    if cpu_kernels.int8_supported():
        paths.insert(0, "int8")
    if mkl_products.available():
        paths.append("mkl")
    cpu_block_products.compile(int8="int8" in paths)
    return tuple(paths)


def _reference(codes, colscale, x):
    """float64 product of the codes' values with the activations each path takes."""
    from poot.engine.drivers.cpu_block_products import Quantized

    return codes.values().astype(np.float64) @ Quantized(x, colscale).values().astype(np.float64)


@pytest.mark.parametrize("signed", [False, True], ids=["q4_1", "q8_0"])
@pytest.mark.parametrize("head", [False, True], ids=["matrix", "head"])
@pytest.mark.parametrize("tokens", [1, 2, 3, 5, 16, 17, 37])
def test_every_path_gives_the_product_of_the_quantized_activations(signed, head, tokens):
    from poot.engine.drivers.cpu_block_products import BlockProduct

    rng = np.random.default_rng(tokens + 100 * signed + 1000 * head)
    codes = _codes(rng, 41, 192, signed)
    colscale = rng.uniform(0.5, 2, 192).astype(np.float32)
    paths = _paths()
    product = BlockProduct(codes, colscale, paths, head=head)
    x = rng.standard_normal((192, tokens)).astype(np.float32)
    want = _reference(codes, colscale, x)
    want = want.T if head else want
    scale = np.abs(want).max()
    for path in paths:
        got = product.run(path, x)
        # The logits come back one C-contiguous row per token; a matrix's result may be the
        # leading columns of MKL's padded one (the kernels read those through cpu_kernels._rows_of).
        assert got.shape == want.shape and (got.flags.c_contiguous or not head), path
        assert np.abs(got - want).max() <= 1e-5 * scale, path
        if not head:  # the residual adds: into the array given
            acc = np.full(want.shape, 3.0, np.float32)
            assert product.run(path, x, out=acc) is acc
            assert np.abs(acc - (want + 3)).max() <= 1e-5 * scale, path


def test_a_tokens_result_does_not_depend_on_the_rest_of_the_step():
    """The integer path computes each (row, token) in one order whatever the tile, so a
    token's result is bit for bit the same alone, in a pair, or in a step of 37 tokens."""
    from poot.engine.drivers.cpu_block_products import BlockProduct

    if not cpu_kernels.int8_supported():
        pytest.skip("this CPU has no AVX-512 VNNI")
    rng = np.random.default_rng(5)
    product = BlockProduct(_codes(rng, 67, 256, False), None, _paths())
    x = rng.standard_normal((256, 37)).astype(np.float32)
    together = product.run("int8", x)
    for t in (0, 5, 36):
        assert np.array_equal(product.run("int8", x[:, t : t + 1])[:, 0], together[:, t])
        assert np.array_equal(product.run("int8", x[:, t : t + 2])[:, 0], together[:, t])


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 13), pairs=st.integers(1, 4), tokens=st.integers(1, 20), signed=st.booleans(),
       head=st.booleans(), add=st.booleans(), seed=st.integers(0, 2**16))
def test_the_integer_kernel_covers_every_tile_edge(rows, pairs, tokens, signed, head, add, seed):
    """Row and token counts on either side of every tile size (1, 2 and 4 rows by tokens)."""
    from poot.engine.drivers.cpu_block_products import BlockProduct

    if not cpu_kernels.int8_supported():
        pytest.skip("this CPU has no AVX-512 VNNI")
    rng = np.random.default_rng(seed)
    cols = 2 * BLOCK * pairs
    codes = _codes(rng, rows, cols, signed)
    product = BlockProduct(codes, None, _paths(), head=head)
    x = rng.standard_normal((cols, tokens)).astype(np.float32)
    want = _reference(codes, np.ones(cols, np.float32), x)
    want = want.T if head else want
    out = np.full(want.shape, 1.5, np.float32) if add else None
    got = product.run("int8", x, out=out)
    np.testing.assert_allclose(got, want + (1.5 if add else 0), rtol=0, atol=1e-5 * max(1.0, np.abs(want).max()))


@settings(max_examples=80, deadline=None)
@given(tokens=st.integers(1, 6), magnitude=st.sampled_from([1e-30, 1e-3, 1.0, 1e4, 1e30]),
       zero_block=st.booleans(), seed=st.integers(0, 2**16))
def test_quantized_activations_are_within_half_a_level_of_each_block_largest(tokens, magnitude, zero_block, seed):
    from poot.engine.drivers.cpu_block_products import Quantized
    from poot.engine.drivers.cpu_int8_kernels import LEVELS

    _paths()
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((128, tokens)) * magnitude).astype(np.float32)
    if zero_block:
        x[32:64] = 0
    colscale = rng.uniform(0.5, 2, 128).astype(np.float32)
    q = Quantized(x, colscale)
    scaled = (x * colscale[:, None]).astype(np.float64)
    top = np.abs(scaled).reshape(4, BLOCK, tokens).max(axis=1)  # (blocks, T)
    error = np.abs(q.values() - scaled).reshape(4, BLOCK, tokens).max(axis=1)
    assert np.all(error <= top * (0.5 / LEVELS + 1e-6))
    v = q.qh.astype(np.int32) * 256 + q.ql
    assert np.abs(v).max() <= LEVELS
    if zero_block:
        assert not v[:, 32:64].any() and not q.c[:, 1].any()
    np.testing.assert_allclose(q.c, q.dx * v.reshape(tokens, 4, BLOCK).sum(axis=2), rtol=1e-6)


def test_signed_codes_become_unsigned_bytes_with_the_offset_taken_back():
    from poot.engine.drivers.cpu_block_products import SHIFT, unsigned

    rng = np.random.default_rng(1)
    codes = _codes(rng, 9, 64, signed=True)
    u, d, m = unsigned(codes)
    assert u.dtype == np.uint8 and np.array_equal(u.astype(np.int16) - SHIFT, codes.codes)
    values = u.reshape(9, 2, BLOCK).astype(np.float32) * d[:, :, None] + m[:, :, None]
    np.testing.assert_allclose(values.reshape(9, 64), codes.values(), rtol=0, atol=1e-6)
    plain = _codes(rng, 3, 64, signed=False)
    assert unsigned(plain)[0] is plain.codes


def test_paths_a_matrix_cannot_take_are_not_offered():
    """The integer tile takes blocks in pairs: a width of an odd number of blocks has no int8 path."""
    from poot.engine.drivers.cpu_block_products import BlockProduct

    rng = np.random.default_rng(2)
    odd = BlockProduct(_codes(rng, 5, 96, False), None, ("int8", "blocks", "openblas"))
    assert odd.paths == ("blocks", "openblas")
    x = rng.standard_normal((96, 2)).astype(np.float32)
    assert odd.path_for(2) == "blocks"
    np.testing.assert_allclose(odd.run("blocks", x), _reference(_codes(np.random.default_rng(2), 5, 96, False),
                                                               np.ones(96, np.float32), x), rtol=1e-5, atol=1e-5)


def test_four_bit_codes_are_read_two_a_byte_with_the_same_result():
    from poot.engine.drivers.cpu_block_products import BlockProduct
    from poot.engine.drivers.cpu_int8_kernels import pack_nibbles

    if not cpu_kernels.int8_supported():
        pytest.skip("this CPU has no AVX-512 VNNI")
    rng = np.random.default_rng(8)
    product = BlockProduct(_codes(rng, 19, 128, False), None, _paths())
    assert product.u4 is not None and product.u4.shape == (19, 64)
    # Byte j of a 64-code pair: code j low, code 32 + j high.
    assert np.array_equal(product.u4[:, :32] & 15, product.u[:, :32])
    assert np.array_equal(product.u4[:, :32] >> 4, product.u[:, 32:64])
    assert np.array_equal(pack_nibbles(product.u), product.u4)
    x = rng.standard_normal((128, 5)).astype(np.float32)
    packed = product.run("int8", x)
    product.u4 = None
    assert np.array_equal(product.run("int8", x), packed)
    assert BlockProduct(_codes(rng, 3, 64, True), None, _paths()).u4 is None  # signed codes stay bytes


@pytest.mark.parametrize("signed", [False, True], ids=["q4_1", "q8_0"])
def test_scales_are_read_as_float16_only_where_it_holds_them_exactly(signed):
    """A GGUF's block scales are float16: the integer path reads them so (fewer bytes a
    block), bit for bit the float32 scales' result; scales float16 cannot hold stay float32."""
    from poot.engine.drivers.cpu_block_products import BlockProduct

    if not cpu_kernels.int8_supported():
        pytest.skip("this CPU has no AVX-512 VNNI")
    rng = np.random.default_rng(9)
    codes = _codes(rng, 37, 192, signed)
    product = BlockProduct(codes, None, _paths())
    assert product.scales[0].dtype == np.uint16 and product.scales[1].dtype == np.uint16
    assert product.bytes_read(1) < BlockProduct(codes, None, ("blocks",)).bytes_read(1)
    x = rng.standard_normal((192, 6)).astype(np.float32)
    half = product.run("int8", x)
    product.scales = (product.d, product.m)
    assert np.array_equal(product.run("int8", x), half)

    codes.d[3, 1] = np.float32(0.1)  # not a float16 value
    codes.d[5, 2] = np.float32(1e-9)  # below float16's smallest
    inexact = BlockProduct(codes, None, _paths())
    assert inexact.scales[0].dtype == np.float32 and inexact.scales[0] is inexact.d
    want = _reference(codes, np.ones(192, np.float32), x)
    np.testing.assert_allclose(inexact.run("int8", x), want, rtol=0, atol=1e-5 * np.abs(want).max())
