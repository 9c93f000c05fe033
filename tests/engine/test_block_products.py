"""The CPU driver's products on block codes (engine/drivers/cpu/products/, the integer kernels
of cpu/kernels/integer.py): every path against float64 on the same quantized activations,
a token's result independent of the rest of the step, and the quantization's error bound."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poot.engine.drivers.cpu.products import coded_product
from poot.engine.drivers.cpu.products.integer import integer_path
from poot.engine.drivers.cpu.products.quantized import Quantized
from poot.engine.drivers.cpu.runtime import shared

runtime = shared()
INTEGER = integer_path(runtime)  # the integer path this process has (AVX-512 VNNI, AVX2), or None
pytestmark = pytest.mark.skipif(not runtime.available(), reason=runtime.unavailable_reason())

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
    from poot.engine.drivers.cpu.platform import mkl as mkl_products
    from poot.engine.drivers.cpu.products.model_products import check_code_paths

    paths = ["blocks", "openblas"]
    if INTEGER is not None:
        paths.insert(0, INTEGER.name)
    if mkl_products.available():
        paths.append("mkl")
    check_code_paths(runtime, tuple(paths))
    return tuple(paths)


def _reference(codes, colscale, x):
    """float64 product of the codes' values with the activations each path takes."""
    return codes.values().astype(np.float64) @ Quantized(x, colscale, runtime.kernels.quantize).values().astype(np.float64)


def _term_sizes(product, x):
    """Per (row, token), the sum of the magnitudes of the terms the integer kernel adds:
    d |u . v| dx and |m' c| per block (as the product's result, token-major for the head)."""
    codes = product.path("blocks")  # the unsigned codes and their scales
    q = Quantized(x, codes.colscale, runtime.kernels.quantize)
    tokens, i = q.qh.shape
    v = (q.qh.astype(np.int64) * 256 + q.ql).reshape(tokens, i // BLOCK, BLOCK)
    u = codes.u.astype(np.int64).reshape(product.shape[0], i // BLOCK, BLOCK)
    exact = np.abs(np.einsum("rbk,tbk->rtb", u, v)).astype(np.float64)
    sizes = (exact * codes.d[:, None, :] * q.dx[None]).sum(-1) + np.abs(codes.m) @ np.abs(q.c).T
    return sizes.T if product.head else sizes


@pytest.mark.parametrize("signed", [False, True], ids=["q4_1", "q8_0"])
@pytest.mark.parametrize("head", [False, True], ids=["matrix", "head"])
@pytest.mark.parametrize("tokens", [1, 2, 3, 5, 16, 17, 37])
def test_every_path_gives_the_product_of_the_quantized_activations(signed, head, tokens):
    rng = np.random.default_rng(tokens + 100 * signed + 1000 * head)
    codes = _codes(rng, 41, 192, signed)
    colscale = rng.uniform(0.5, 2, 192).astype(np.float32)
    paths = _paths()
    product = coded_product(codes, colscale, runtime, paths, head=head)
    x = rng.standard_normal((192, tokens)).astype(np.float32)
    want = _reference(codes, colscale, x)
    want = want.T if head else want
    scale = np.abs(want).max()
    for path in paths:
        got = product.run(x, path=path)
        # The logits come back one C-contiguous row per token; a matrix's result may be the
        # leading columns of MKL's padded one (the kernels read those through cpu/glue.py's rows_of).
        assert got.shape == want.shape and (got.flags.c_contiguous or not head), path
        assert np.abs(got - want).max() <= 1e-5 * scale, path
        if not head:  # the residual adds: into the array given
            acc = np.full(want.shape, 3.0, np.float32)
            assert product.run(x, out=acc, path=path) is acc
            assert np.abs(acc - (want + 3)).max() <= 1e-5 * scale, path


def test_a_tokens_result_does_not_depend_on_the_rest_of_the_step():
    """The integer path computes each (row, token) in one order whatever the tile, so a
    token's result is bit for bit the same alone, in a pair, or in a step of 37 tokens."""
    if INTEGER is None:
        pytest.skip("no integer path on this CPU")
    rng = np.random.default_rng(5)
    product = coded_product(_codes(rng, 67, 576, False), None, runtime, _paths())  # a group of 16 blocks and a pair
    x = rng.standard_normal((576, 37)).astype(np.float32)
    together = product.run(x, path=INTEGER.name)
    for t in (0, 5, 36):
        assert np.array_equal(product.run(x[:, t : t + 1], path=INTEGER.name)[:, 0], together[:, t])
        assert np.array_equal(product.run(x[:, t : t + 2], path=INTEGER.name)[:, 0], together[:, t])


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 13), pairs=st.integers(1, 20), tokens=st.integers(1, 20), signed=st.booleans(),
       head=st.booleans(), add=st.booleans(), seed=st.integers(0, 2**16))
def test_the_integer_kernel_covers_every_tile_edge(rows, pairs, tokens, signed, head, add, seed):
    """Row and token counts on either side of every tile size (1, 2 and 4 rows by tokens), and
    widths with and without whole groups of 16 blocks and pairs left after them."""
    if INTEGER is None:
        pytest.skip("no integer path on this CPU")
    rng = np.random.default_rng(seed)
    cols = 2 * BLOCK * pairs
    codes = _codes(rng, rows, cols, signed)
    product = coded_product(codes, None, runtime, _paths(), head=head)
    x = rng.standard_normal((cols, tokens)).astype(np.float32)
    want = _reference(codes, np.ones(cols, np.float32), x)
    want = want.T if head else want
    out = np.full(want.shape, 1.5, np.float32) if add else None
    got = product.run(x, out=out, path=INTEGER.name)
    # float32's error grows with the terms the kernel sums, not with their (possibly cancelling)
    # total: a signed code is summed as code + 128 with -128 d taken back in the offset term.
    terms = _term_sizes(product, x)
    np.testing.assert_allclose(got, want + (1.5 if add else 0), rtol=0, atol=1e-6 * max(1.0, terms.max()))


@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(2, 70), width=st.sampled_from([64, 576, 1536]), seed=st.integers(0, 2**16))
def test_each_token_quantizes_the_same_alone_or_among_many(tokens, width, seed):
    """quantize_words takes few tokens one by one and more across tokens, in vector lanes
    (tasks of 16): a token's int16 values and scales must be the same bits either way."""
    from poot.engine.drivers.cpu.kernels import quantize as k
    from poot.engine.drivers.cpu.kernels.integer_layout import kernel_order, lane_width

    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((width, tokens)) * 10.0 ** rng.integers(-3, 4, (width, 1))).astype(np.float32)
    x[: 2 * BLOCK, tokens // 2] = 0  # a token's all-zero blocks
    colscale = rng.uniform(0.5, 2.0, width).astype(np.float32)
    order, lanes = kernel_order(width), lane_width(width // BLOCK)

    def quantized(xs):
        v = np.empty((xs.shape[1], width), np.int16)
        dx, c = (np.empty((xs.shape[1], lanes), np.float32) for _ in range(2))
        k.quantize_words(np.ascontiguousarray(xs), colscale, order, v, dx, c)
        return v, dx, c

    together = quantized(x)
    for t in {0, tokens // 2, tokens - 1}:
        alone = quantized(x[:, t : t + 1])
        for mine, theirs in zip(alone, together, strict=True):
            assert np.array_equal(mine[0], theirs[t])


@settings(max_examples=80, deadline=None)
@given(tokens=st.integers(1, 6), magnitude=st.sampled_from([1e-30, 1e-3, 1.0, 1e4, 1e30]),
       zero_block=st.booleans(), seed=st.integers(0, 2**16))
def test_quantized_activations_are_within_half_a_level_of_each_block_largest(tokens, magnitude, zero_block, seed):
    from poot.engine.drivers.cpu.kernels.quantize import LEVELS

    _paths()
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((128, tokens)) * magnitude).astype(np.float32)
    if zero_block:
        x[32:64] = 0
    colscale = rng.uniform(0.5, 2, 128).astype(np.float32)
    q = Quantized(x, colscale, runtime.kernels.quantize)
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
    from poot.engine.drivers.cpu.products.quantized import SHIFT, unsigned

    rng = np.random.default_rng(1)
    codes = _codes(rng, 9, 64, signed=True)
    u, d, m = unsigned(codes)
    assert u.dtype == np.uint8 and np.array_equal(u.astype(np.int16) - SHIFT, codes.codes)
    values = u.reshape(9, 2, BLOCK).astype(np.float32) * d[:, :, None] + m[:, :, None]
    np.testing.assert_allclose(values.reshape(9, 64), codes.values(), rtol=0, atol=1e-6)
    plain = _codes(rng, 3, 64, signed=False)
    assert unsigned(plain)[0] is plain.codes


def test_paths_a_matrix_cannot_take_are_not_offered():
    """The integer tile takes blocks in pairs: a width of an odd number of blocks has no integer path."""
    rng = np.random.default_rng(2)
    odd = coded_product(_codes(rng, 5, 96, False), None, runtime, ("int8", "avx2", "blocks", "openblas"))
    assert odd.paths == ("blocks", "openblas")
    x = rng.standard_normal((96, 2)).astype(np.float32)
    assert odd.path_for(2) == "blocks"
    np.testing.assert_allclose(odd.run(x, path="blocks"), _reference(_codes(np.random.default_rng(2), 5, 96, False),
                                                               np.ones(96, np.float32), x), rtol=1e-5, atol=1e-5)


def test_four_bit_codes_are_read_two_a_byte_in_the_kernels_order():
    """Runs of 16 blocks, block x's codes on lane x (two 16-bit words a lane in each chunk of 32
    words), the blocks left over in pairs (8 lanes a block); 4-bit codes two a byte."""
    from poot.engine.drivers.cpu.kernels.integer_layout import GROUP, kernel_order, pack_nibbles

    if INTEGER is None:
        pytest.skip("no integer path on this CPU")
    rng = np.random.default_rng(8)
    width = 576  # SmolLM2's: one run of 16 blocks, then a pair
    product = coded_product(_codes(rng, 19, width, False), None, runtime, _paths())
    order = kernel_order(width)
    vnni = product.path(INTEGER.name)
    assert np.array_equal(np.sort(order), np.arange(width)) and np.array_equal(vnni.order, order)
    e = np.arange(width)
    lane = order % 32 // 2
    in_group = e < GROUP * BLOCK
    assert np.array_equal(lane[in_group], e[in_group] // BLOCK)  # a block a lane
    assert np.array_equal(lane[~in_group] // 8, (e[~in_group] - GROUP * BLOCK) // BLOCK)  # 8 lanes a block
    arranged = np.empty_like(product.path("blocks").u)
    arranged[:, order] = product.path("blocks").u
    assert vnni.codes.shape == (19, width // 2)
    assert np.array_equal(vnni.codes, pack_nibbles(arranged))
    # Byte j of a chunk of 64 codes: code j low, code 32 + j high.
    assert np.array_equal(vnni.codes[:, :32] & 15, arranged[:, :32])
    assert np.array_equal(vnni.codes[:, :32] >> 4, arranged[:, 32:64])
    signed = coded_product(_codes(rng, 3, width, True), None, runtime, _paths()).path(INTEGER.name)  # a byte a code
    assert signed.codes.shape == (3, width) and np.array_equal(signed.order, order)


@pytest.mark.parametrize("signed", [False, True], ids=["q4_1", "q8_0"])
def test_the_largest_codes_and_activations_sum_without_overflow(signed):
    """Every code at its largest (15, or 255 once shifted) against every activation at LEVELS:
    the exact int32 sums must not wrap (a lane holds one block's; 16 blocks of 255s would)."""
    if INTEGER is None:
        pytest.skip("no integer path on this CPU")
    width = 2048
    codes = _codes(np.random.default_rng(3), 4, width, signed)
    codes.codes[...] = 127 if signed else 15
    codes.d[...] = 1.0
    codes.m[...] = 0.0
    product = coded_product(codes, None, runtime, _paths())
    x = np.ones((width, 3), np.float32)
    want = _reference(codes, np.ones(width, np.float32), x)
    np.testing.assert_allclose(product.run(x, path=INTEGER.name), want, rtol=1e-5)


@pytest.mark.parametrize("signed", [False, True], ids=["q4_1", "q8_0"])
def test_scales_are_read_as_float16_only_where_it_holds_them_exactly(signed):
    """A GGUF's block scales are float16: the integer path reads them so (fewer bytes a
    block), bit for bit the float32 scales' result; scales float16 cannot hold stay float32."""
    if INTEGER is None:
        pytest.skip("no integer path on this CPU")
    rng = np.random.default_rng(9)
    codes = _codes(rng, 37, 192, signed)
    product = coded_product(codes, None, runtime, _paths())
    vnni = product.path(INTEGER.name)
    assert vnni.scales[0].dtype == np.uint16 and vnni.scales[1].dtype == np.uint16
    assert product.bytes_read(1) < coded_product(codes, None, runtime, ("blocks",)).bytes_read(1)
    x = rng.standard_normal((192, 6)).astype(np.float32)
    half = product.run(x, path=INTEGER.name)
    vnni.set_scales(product.path("blocks").d, product.path("blocks").m)
    assert np.array_equal(product.run(x, path=INTEGER.name), half)

    codes.d[3, 1] = np.float32(0.1)  # not a float16 value
    codes.d[5, 2] = np.float32(1e-9)  # below float16's smallest
    inexact = coded_product(codes, None, runtime, _paths())
    scales = inexact.path(INTEGER.name).scales
    assert scales[0].dtype == np.float32 and scales[0] is inexact.path("blocks").d
    want = _reference(codes, np.ones(192, np.float32), x)
    np.testing.assert_allclose(inexact.run(x, path=INTEGER.name), want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_lane_scales_spread_a_tail_runs_two_blocks_over_eight_lanes_each():
    """Several tokens' tiles read d and m laid out as their lanes hold the blocks: a run of 16
    blocks as it is, each 2-block tail run over 16 lanes (m' on a block's first lane only)."""
    from poot.engine.drivers.cpu.kernels.integer_layout import lane_scales, lane_width

    blocks = 20  # a run of 16, then two tail runs
    s = np.arange(1, 2 * blocks + 1, dtype=np.float32).reshape(2, blocks)
    assert lane_width(blocks) == 48
    spread, lone = lane_scales(s), lane_scales(s, lone=True)
    assert np.array_equal(spread[:, :16], s[:, :16]) and np.array_equal(lone[:, :16], s[:, :16])
    for run, first in ((1, 16), (2, 18)):
        lanes = slice(16 * run, 16 * run + 16)
        assert np.array_equal(spread[:, lanes], np.repeat(s[:, first : first + 2], 8, axis=1))
        want = np.zeros((2, 16), np.float32)
        want[:, 0], want[:, 8] = s[:, first], s[:, first + 1]
        assert np.array_equal(lone[:, lanes], want)


def test_lane_scales_of_whole_runs_are_the_block_scales_themselves():
    """Runs of 16 blocks only: one lane a block, so the lane layout is the scales as they are,
    returned without a copy (a second copy of every scale was 0.15 GB at a 1B shape)."""
    from poot.engine.drivers.cpu.kernels.integer_layout import lane_scales, lane_width

    s = np.arange(1, 2 * 64 + 1, dtype=np.float32).reshape(2, 64)
    assert lane_width(64) == 64
    assert lane_scales(s) is s and lane_scales(s, lone=True) is s


@pytest.mark.parametrize("width", [64, 128, 512, 576, 1088, 2048, 8192])
@pytest.mark.parametrize("levels", [16, 256])
def test_codes_are_moved_to_the_kernels_order_as_the_order_says(width, levels):
    """in_kernel_order moves whole axes; it must put every code where kernel_order says, for
    runs of 16 blocks, pairs left over, and both together; 4-bit codes are then packed."""
    from poot.engine.drivers.cpu.kernels.integer_layout import (
        arrange_codes,
        in_kernel_order,
        kernel_order,
        pack_nibbles,
    )

    u = np.random.default_rng(width).integers(0, levels, (5, width), dtype=np.uint8)
    scattered = np.empty_like(u)
    scattered[:, kernel_order(width)] = u
    assert np.array_equal(in_kernel_order(u), scattered)
    codes, order = arrange_codes(u)
    assert np.array_equal(order, kernel_order(width))
    assert np.array_equal(codes, pack_nibbles(scattered) if levels == 16 else scattered)
