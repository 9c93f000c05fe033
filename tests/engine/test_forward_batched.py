"""Batched equals alone at the driver level: per-row positions and length masks."""

import numpy as np
import pytest
from poot_mutants.engine_parts import NoLengthMask, SharedPosition

from poot.engine.drivers.base import RowWork, StepPlan
from poot.engine.drivers.cpu import CpuDriver
from poot.engine.models.synthetic import synthetic_llama
from poot.engine.plan import fit_plan

from .harness import HALF_KV_RELATIVE, half_kv, logit_tolerance

BS = 16


def make_driver(cls=CpuDriver, compact=True):
    model = synthetic_llama(3)
    driver = cls(memory_bytes=1 << 30, compact=compact)
    plan = fit_plan(driver.device(), model.config, 0, model.name)
    driver.prepare(plan, model)
    return driver, plan


def run_alone(driver, tokens, table, chunk):
    """Prefill in chunks then return the logits after the whole prompt."""
    out = None
    driver.step(StepPlan.opening({0: table}))
    for start in range(0, len(tokens), chunk):
        piece = tokens[start : start + chunk]
        last = start + len(piece) == len(tokens)
        out = driver.step(StepPlan([RowWork(0, np.array(piece, np.int32), start, table, 1 if last else 0)]))
    return out.logits[0]


def prompts(seed, n, lo=3, hi=60):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, rng.integers(lo, hi)).tolist() for _ in range(n)]


def tables(plan, ps, extra=4):
    tabs, nxt = [], 0
    for p in ps:
        need = plan.blocks_for(len(p) + extra)
        tabs.append(list(range(nxt, nxt + need)))
        nxt += need
    return tabs


def mixed_run(driver, ps, tabs):
    """Row 0 prefills in one chunk while the others, already prefilled, decode one token."""
    driver.step(StepPlan.opening({0: tabs[0]}))
    for i, (p, t) in enumerate(zip(ps[1:], tabs[1:], strict=True), start=1):
        driver.step(StepPlan.opening({i: t}))
        driver.step(StepPlan([RowWork(i, np.array(p[:-1], np.int32), 0, t, 0)]))
    batch = [RowWork(0, np.array(ps[0], np.int32), 0, tabs[0], 1)]
    batch += [RowWork(i, np.array(p[-1:], np.int32), len(p) - 1, t, 1)
              for i, (p, t) in enumerate(zip(ps[1:], tabs[1:], strict=True), start=1)]
    return driver.step(StepPlan(batch)).logits


def test_each_row_in_a_mixed_batch_matches_its_logits_alone():
    driver, plan = make_driver()
    ps = prompts(0, 6)
    tabs = tables(plan, ps)
    alone = [run_alone(driver, p, t, 1000) for p, t in zip(ps, tabs, strict=True)]
    batched = mixed_run(driver, ps, tabs)
    np.testing.assert_allclose(batched, np.stack(alone), atol=1e-5, rtol=0)


@pytest.mark.parametrize("compact", [False, True], ids=["float32_kv", "float16_kv"])
def test_chunked_prefill_equals_one_shot_prefill(compact):
    driver, plan = make_driver(compact=compact)
    (p,) = prompts(1, 1, 40, 90)
    (t,) = tables(plan, [p])
    one_shot = run_alone(driver, p, t, 1000)
    atol = logit_tolerance(driver, synthetic_llama(3).config, 1e-5)
    for chunk in (1, 7, 16, 33):
        np.testing.assert_allclose(run_alone(driver, p, t, chunk), one_shot, atol=atol, rtol=0)


@pytest.mark.parametrize("mutant", [SharedPosition, NoLengthMask], ids=["shared_position", "no_length_mask"])
def test_breaking_positions_or_masks_breaks_batched_equals_alone(mutant):
    """The check above is only worth something if a wrong position or a missing mask fails it."""
    good, plan = make_driver()
    bad, _ = make_driver(mutant)
    ps = prompts(2, 6)
    tabs = tables(plan, ps)
    alone = np.stack([run_alone(good, p, t, 1000) for p, t in zip(ps, tabs, strict=True)])
    batched = mixed_run(bad, ps, tabs)
    assert np.abs(batched - alone).max() > 1e-3


@pytest.mark.parametrize("compact", [False, True], ids=["float32_kv", "float16_kv"])
@pytest.mark.parametrize("mkl", [False, True], ids=["blas", "mkl"])
def test_compiled_kernels_and_the_numpy_path_give_the_same_logits(mkl, compact, monkeypatch):
    """The CPU kernels (paged attention in place, few-token products, MKL's packed products
    for the many-token ones) change how a step is computed, never what: a mixed step of a
    prefill chunk, short multi-token rows (the verification shape) and decode rows, with
    scattered block tables, agrees with the plain NumPy path."""
    from poot.engine.drivers.cpu.platform import mkl as mkl_products
    from poot.engine.drivers.cpu.runtime import shared

    if not shared().available():
        pytest.skip(shared().unavailable_reason())
    if mkl and not mkl_products.available():
        pytest.skip(mkl_products.unavailable_reason())
    monkeypatch.setattr(mkl_products, "MIN_PACKED_WEIGHTS", 1)  # the tiny model's weights too
    model = synthetic_llama(5)
    drivers = []
    for kernels in (True, False):
        d = CpuDriver(memory_bytes=1 << 30, kernels=kernels, mkl=mkl, compact=compact)
        d.prepare(fit_plan(d.device(), model.config, 0, model.name), model)
        drivers.append(d)
    assert drivers[0].products is not None and drivers[1].products is None
    assert (drivers[0].products.packed == 4 * model.config.num_layers + 1) == mkl
    rng = np.random.default_rng(4)
    blocks = rng.permutation(drivers[0].plan.num_blocks)
    ps = prompts(7, 6, lo=30, hi=70)
    tabs, used = [], 0
    for p in ps:
        need = drivers[0].plan.blocks_for(len(p) + 12)
        tabs.append(blocks[used : used + need].tolist())
        used += need
    results = []
    for d in drivers:
        for i, (p, t) in enumerate(zip(ps, tabs, strict=True)):
            d.step(StepPlan.opening({i: t}))
            d.step(StepPlan([RowWork(i, np.array(p[: -22 if i == 0 else -9], np.int32), 0, t, 0)]))
        # 32 tokens in all: MKL's products need no padding, so the residual adds go in place.
        batch = [RowWork(0, np.array(ps[0][-22:], np.int32), len(ps[0]) - 22, tabs[0], 9),  # a chunk: causal tiles
                 RowWork(1, np.array(ps[1][-9:-4], np.int32), len(ps[1]) - 9, tabs[1], 5),  # short: paged
                 RowWork(2, np.array(ps[2][-9:-7], np.int32), len(ps[2]) - 9, tabs[2], 2)]
        batch += [RowWork(i, np.array(ps[i][-9:-8], np.int32), len(ps[i]) - 9, tabs[i], 1) for i in range(3, 6)]
        mixed = d.step(StepPlan(batch)).logits
        # Then a step of paged queries only (the fused decode path): rows 3-5 decode their
        # next token, row 1 verifies its last four.
        batch = [RowWork(1, np.array(ps[1][-4:], np.int32), len(ps[1]) - 4, tabs[1], 4)]
        batch += [RowWork(i, np.array(ps[i][-8:-7], np.int32), len(ps[i]) - 8, tabs[i], 1) for i in range(3, 6)]
        results.append(np.concatenate([mixed, d.step(StepPlan(batch)).logits]))
    if not compact:
        np.testing.assert_allclose(results[0], results[1], atol=1e-4, rtol=1e-4)
        return
    # A float16 cache on the kernels' side: the same logits up to K and V's rounding.
    assert half_kv(drivers[0], model.config) and drivers[0].kv[0].dtype == np.uint16
    moved = np.abs(results[0] - results[1]).max() / np.abs(results[1]).max()
    assert 0 < moved < HALF_KV_RELATIVE, moved
