"""Block codes (engine/models/block_codes.py) and the CPU driver's products on them
(engine/drivers/cpu/products/), against the float32 weights they reproduce."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poot.engine.models import block_codes

PROMPTS = 64
CONTINUATION = 12
# The compact path against the float32 one. The codes give back the float32 weights bit for
# bit; the products take the activations quantized to 16 bits per block of 32 (cpu/kernels/quantize.py:
# an element off by at most 1/65278 of its block's largest), which alone moved SmolLM2's logits
# by up to 4.6e-4 of the largest; the KV cache in float16 (11 significant bits) alone by up
# to 2.6e-3, both together by 2.1e-3 (63 of 64 continuations the same).
LOGIT_TOLERANCE = 4e-3  # max |difference| over the step's logits, relative to max |logit|


def _q4_1(rng, rows: int, cols: int) -> np.ndarray:
    d = rng.uniform(0.001, 0.1, (rows, cols // 32)).astype(np.float16).astype(np.float32)
    m = -rng.uniform(0, 0.5, (rows, cols // 32)).astype(np.float16).astype(np.float32)
    q = rng.integers(0, 16, (rows, cols // 32, 32)).astype(np.float32)
    q[:, :, 0], q[:, :, 1] = 0, 15  # the quantizer puts a block's minimum at 0, its maximum at 15
    return (q * d[:, :, None] + m[:, :, None]).reshape(rows, cols)


def test_finds_exact_codes_of_q4_1_and_q8_0_values():
    rng = np.random.default_rng(0)
    w = _q4_1(rng, 8, 64)
    found = block_codes.find(w)
    assert found is not None and found.codes.dtype == np.uint8
    assert np.array_equal(found.values(), w)
    d = rng.uniform(0.001, 0.1, (8, 2)).astype(np.float16).astype(np.float32)
    q = rng.integers(-127, 128, (8, 2, 32)).astype(np.float32)
    q[:, :, 0] = 127
    w8 = (q * d[:, :, None]).reshape(8, 64)
    found = block_codes.find(w8)
    assert found is not None and found.codes.dtype == np.int8
    assert np.array_equal(found.values(), w8)


def test_float32_weights_have_no_codes():
    rng = np.random.default_rng(1)
    assert block_codes.find(rng.standard_normal((8, 64)).astype(np.float32)) is None
    assert block_codes.find(np.ascontiguousarray(_q4_1(rng, 8, 64)[:, :48])) is None  # not whole blocks


def _reference_find(w: np.ndarray):
    """find() as whole-matrix passes, the definition written out: the affine form, else the
    symmetric one, each checked on every weight."""
    if w.ndim != 2 or w.dtype != np.float32 or w.shape[1] % 32 or not np.all(np.isfinite(w)):
        return None
    b = w.reshape(w.shape[0], -1, 32)
    lo, hi = b.min(axis=2), b.max(axis=2)
    half = block_codes._half
    for d, m, low, high, dtype in ((half((hi - lo) / np.float32(15)), lo, 0, 15, np.uint8),
                                   (half(np.maximum(-lo, hi) / np.float32(127)), np.zeros_like(lo), -127, 127, np.int8)):
        q = np.rint((b - m[:, :, None]) / np.where(d == 0, np.float32(1), d)[:, :, None])
        if q.min() >= low and q.max() <= high and np.array_equal(q * d[:, :, None] + m[:, :, None], b):
            return q.astype(dtype).reshape(w.shape), d, m
    return None


def _same_as_reference(w: np.ndarray) -> None:
    found, want = block_codes.find(w), _reference_find(w)
    assert (found is None) == (want is None)
    if found is not None:
        for got, expected in zip((found.codes, found.d, found.m), want, strict=True):
            assert got.dtype == expected.dtype and np.array_equal(got, expected)
        assert np.array_equal(found.values(), w)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 40), blocks=st.integers(1, 6), form=st.sampled_from(["q4_1", "q8_0", "float"]),
       run=st.sampled_from([32, 64, 200, 1 << 16]), seed=st.integers(0, 2**32 - 1), spoil=st.booleans())
def test_find_gives_the_bits_of_whole_matrix_passes_whatever_the_runs(rows, blocks, form, run, seed, spoil):
    """Worked through in runs of rows (RUN_WEIGHTS), find() gives the very codes, scales and
    minimums of the passes over the whole matrix, and refuses what they refuse: a matrix
    spoiled in one weight of its last row, whichever run that falls in."""
    rng = np.random.default_rng(seed)
    cols = 32 * blocks
    if form == "q4_1":
        w = _q4_1(rng, rows, cols)
    elif form == "q8_0":
        d = rng.uniform(0.001, 0.1, (rows, blocks)).astype(np.float16).astype(np.float32)
        q = rng.integers(-127, 128, (rows, blocks, 32)).astype(np.float32)
        q[:, :, 0] = 127
        w = (q * d[:, :, None]).reshape(rows, cols)
    else:
        w = rng.standard_normal((rows, cols)).astype(np.float32)
    if spoil:
        w[-1, -1] = np.nextafter(w[-1, -1], np.float32(np.inf))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(block_codes, "RUN_WEIGHTS", run)
        _same_as_reference(w)


def test_values_are_the_codes_times_d_plus_m_in_float32():
    rng = np.random.default_rng(5)
    for codes in (block_codes.find(_q4_1(rng, 70, 2048)), block_codes.find(_q4_1(rng, 3, 32))):
        q = codes.codes.reshape(codes.codes.shape[0], -1, 32).astype(np.float32)
        want = (q * codes.d[:, :, None] + codes.m[:, :, None]).reshape(codes.codes.shape)
        assert np.array_equal(codes.values(), want) and codes.values().dtype == np.float32


@pytest.mark.realmodel
def test_smollm2_codes_are_the_bits_of_whole_matrix_passes(smollm2):
    for w in smollm2.weights.values():
        if w.ndim == 2:
            _same_as_reference(w)


def test_block_product_matches_float32_product():
    """Every path of the product on the codes, against float64 on the float32 weights with the
    norm folded in, as prepare() folds it: apart from the activations' 16-bit quantization,
    the same sums."""
    from poot.engine.drivers.cpu.products import coded_product
    from poot.engine.drivers.cpu.products.model_products import check_code_paths
    from poot.engine.drivers.cpu.products.registry import CODE_PATHS
    from poot.engine.drivers.cpu.runtime import shared

    runtime = shared()
    if not runtime.available():
        pytest.skip(runtime.unavailable_reason())
    paths = tuple(k.name for k in CODE_PATHS if k.available(runtime))
    check_code_paths(runtime, paths)
    rng = np.random.default_rng(2)
    w = _q4_1(rng, 37, 128)
    scale = rng.uniform(0.5, 2, 128).astype(np.float32)
    product = coded_product(block_codes.find(w), scale, runtime, paths)
    for tokens in (1, 3, 20):
        x = rng.standard_normal((128, tokens)).astype(np.float32)
        want = (w.astype(np.float64) * scale) @ x
        for path in product.paths:
            assert np.abs(product.run(x, path=path) - want).max() <= 2e-4 * np.abs(want).max(), path
            acc = np.ones((37, tokens), np.float32)
            product.run(x, out=acc, path=path)
            assert np.abs(acc - (want + 1)).max() <= 2e-4 * np.abs(want).max(), path


def _decode(driver, model, prompt: list[int], steps: int) -> tuple[list[int], list[np.ndarray]]:
    from poot.engine.step import RowWork, StepPlan

    table = list(range(driver.plan.blocks_for(len(prompt) + steps)))
    driver.step(StepPlan.opening({0: table}))
    out = driver.step(StepPlan([RowWork(0, np.array(prompt, np.int32), 0, table, 1)]))
    tokens, logits = [], []
    for i in range(steps):
        token = int(np.argmax(out.logits[0]))
        tokens.append(token)
        out = driver.step(StepPlan([RowWork(0, np.array([token], np.int32), len(prompt) + i, table, 1)]))
        logits.append(np.asarray(out.logits[0]))
    driver.step(StepPlan.closing([0]))
    return tokens, logits


@pytest.mark.realmodel
@pytest.mark.slow
def test_smollm2_decode_on_codes_matches_float32(smollm2):
    """64 prompts, 12 greedy tokens each, on the codes and on the float32 weights."""
    from poot.engine.drivers.cpu import CpuDriver
    from poot.engine.plan import fit_plan

    drivers = []
    for codes in (True, False):
        driver = CpuDriver(memory_bytes=1 << 30, device_picks=False, compact=codes)
        driver.prepare(fit_plan(driver.device(), smollm2.config, 0, smollm2.name), smollm2)
        drivers.append(driver)
    assert drivers[0].products is None or drivers[0].products.coded == 30 * 4 + 1
    words = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The best way to learn",
             "Water boils at", "In 1969, the first", "My favourite colour is", "Translate to French: cat"]
    rng = np.random.default_rng(3)
    agree, worst = 0, 0.0
    for n in range(PROMPTS):
        prompt = smollm2.tokenizer.encode(words[n % len(words)]) + rng.integers(100, 20000, n // 8).tolist()
        (coded, coded_logits), (plain, plain_logits) = (_decode(d, smollm2, prompt, CONTINUATION) for d in drivers)
        # Compare logits where both fed the same tokens (up to the first differing pick).
        same = next((i for i, (a, b) in enumerate(zip(coded, plain, strict=True)) if a != b), CONTINUATION)
        for a, b in zip(coded_logits[:same], plain_logits[:same], strict=True):
            worst = max(worst, float(np.abs(a - b).max() / np.abs(b).max()))
        agree += coded == plain
    assert worst < LOGIT_TOLERANCE
    # Rounding can flip a near-tie between the two best tokens; anything more is a bug.
    assert agree >= PROMPTS - 2, f"{agree}/{PROMPTS} greedy continuations agree; worst logit {worst:.2e}"
    print(f"{agree}/{PROMPTS} agree; worst relative logit difference {worst:.2e}")
