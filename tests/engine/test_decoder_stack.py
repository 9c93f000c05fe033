"""The CPU driver's decoder stack (engine/drivers/cpu/decoder_stack.py, cpu/kernels/decoder.py): a
program's Llama layers (its llama_layer ops) in one compiled call. It changes how a step is run, never what: the
same logits and the same KV cache, bit for bit, as the op-by-op walk, for any mix of rows."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poot.engine.drivers.cpu import CpuDriver
from poot.engine.drivers.cpu.products.integer import integer_path
from poot.engine.drivers.cpu.runtime import shared
from poot.engine.models import family
from poot.engine.models.synthetic import synthetic_llama, synthetic_mamba
from poot.engine.plan import fit_plan

from .harness import feed_steps

INTEGER = integer_path(shared())  # the integer path this process has (AVX-512 VNNI, AVX2)
pytestmark = pytest.mark.skipif(INTEGER is None, reason="the decoder stack runs the integer products")


def _driver(model, stack: bool, every_count: bool = True) -> CpuDriver:
    """A prepared driver; `every_count`: every layer product on the integer path at every token
    count (the tiny model's measured choice may put some on a float path), so the stack takes
    every step."""
    driver = CpuDriver(memory_bytes=1 << 30, stack=stack)
    driver.retune = True  # every path built and timed, whatever an earlier driver kept
    driver.prepare(fit_plan(driver.device(), model.config, 0, model.name), model)
    if every_count:
        for product in driver.products.on_codes():
            product.table = [(1 << 30, INTEGER.name)]
    return driver


@pytest.fixture(scope="module")
def model():
    return synthetic_llama(7, block_coded=True)


@pytest.fixture(scope="module")
def pair(model):
    """(stacked, op by op): the same model, the same plan, each fed the same steps."""
    return _driver(model, True), _driver(model, False)


def test_the_stack_is_built_for_a_block_coded_llama_only(model, pair):
    stacked, walked = pair
    assert stacked.stack is not None and walked.stack is None
    assert stacked.stack.layers == model.config.num_layers
    assert _driver(synthetic_llama(7), True).stack is None, "float32 weights have no integer products"
    assert _driver(synthetic_mamba(1), True, every_count=False).stack is None, "not the Llama layer"


def test_the_stack_takes_the_llama_layer_ops_the_program_names(model):
    from poot.engine.drivers.cpu.decoder_stack import layer_span

    program = family(model.config).program(model.config)
    layers = model.config.num_layers
    assert layer_span(program) == (1, 1 + layers, layers)
    assert layer_span(program.unfused()) is None, "the parts alone are not the op"
    ops = list(program.ops)
    swapped = ops[:]
    swapped[1], swapped[2] = ops[2], ops[1]  # layer 1 first: layer i is not the pool's entry i
    assert layer_span(dataclasses.replace(program, ops=tuple(swapped))) is None


def test_a_layer_edited_inside_its_op_keeps_the_stack_and_differs_from_its_parts(model, monkeypatch):
    """The stack runs the op the program names, whatever its parts say: an edit to the parts
    does not quietly send every step to the walk, and the walk's logits tell the two apart."""
    from poot.engine.models import llama

    program = llama.program

    def edited(config):
        p = program(config)
        first = p.ops[1]
        parts = first.parts[:5] + first.parts[6:]  # layer 0's second norm left out
        return dataclasses.replace(p, ops=(p.ops[0], dataclasses.replace(first, parts=parts), *p.ops[2:]))

    monkeypatch.setattr(llama, "program", edited)
    stacked, walked = _driver(model, True), _driver(model, False)
    assert stacked.stack is not None
    ours, theirs = feed_steps(stacked, [0], [[(0, [1, 2, 3])]]), feed_steps(walked, [0], [[(0, [1, 2, 3])]])
    assert not np.array_equal(ours[0], theirs[0])


def _stack_runs(driver, monkeypatch) -> list[int]:
    calls = []
    run = driver.stack.run

    def counting(x, *args):
        calls.append(x.shape[1])
        return run(x, *args)

    monkeypatch.setattr(driver.stack, "run", counting)
    return calls


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_stacked_layers_give_the_op_walks_logits_and_cache_bit_for_bit(pair, data, monkeypatch):
    stacked, walked = pair
    rows = data.draw(st.lists(st.integers(0, stacked.plan.rows - 1), min_size=1, max_size=6, unique=True))
    steps = []
    for _ in range(data.draw(st.integers(1, 4))):
        live = data.draw(st.lists(st.sampled_from(rows), min_size=1, unique=True))
        steps.append([(row, data.draw(st.lists(st.integers(0, 255), min_size=1, max_size=20))) for row in live])
    steps = [s for s in steps if sum(len(t) for _, t in s) <= stacked.plan.max_step_tokens]
    runs = _stack_runs(stacked, monkeypatch)
    ours, theirs = feed_steps(stacked, rows, steps), feed_steps(walked, rows, steps)
    assert len(runs) == len(steps), "every step ran on the stack"
    for a, b in zip(ours, theirs, strict=True):
        assert np.array_equal(a, b)
    assert np.array_equal(stacked.kv_pool, walked.kv_pool)


def test_a_width_of_whole_runs_holds_its_scales_once_and_keeps_the_walks_logits():
    """At widths a multiple of 512 (every Llama 3.2 matrix) the tiles' lane layout of the block
    scales is the scales themselves (integer_layout.lane_scales): the stack keeps one array for
    both, not a copy, and still gives the op walk's logits and cache bit for bit."""
    wide = synthetic_llama(3, block_coded=True, hidden_size=512, intermediate_size=1024, num_heads=8,
                           num_kv_heads=2, head_dim=64, num_layers=2)
    stacked, walked = _driver(wide, True), _driver(wide, False)
    for role in stacked.stack.roles:
        codes, d, m, dw, mw = role[:5]
        assert dw is d and mw is m
    for product in stacked.stack.products:
        path = product.path(INTEGER.name)
        assert all(np.shares_memory(a, b) for a, b in zip(path.scales, path.lane_scales, strict=True))
    steps = [[(0, list(range(1, 40))), (1, [7, 8])], [(0, [41]), (1, [9])], [(1, [10, 11, 12])]]
    for a, b in zip(feed_steps(stacked, [0, 1], steps), feed_steps(walked, [0, 1], steps), strict=True):
        assert np.array_equal(a, b)
    assert np.array_equal(stacked.kv_pool, walked.kv_pool)


def test_a_step_the_stack_does_not_take_walks_the_ops(model, monkeypatch):
    from poot.engine.drivers.cpu.products import Product

    monkeypatch.setattr(Product, "keep_only", lambda self, paths: None)  # every path kept
    driver = _driver(model, True, every_count=False)
    for product in driver.products.on_codes():  # two tokens and more on a float path
        product.table = [(1, INTEGER.name), (1 << 30, "blocks")]
    runs = _stack_runs(driver, monkeypatch)
    feed_steps(driver, [0, 1], [[(0, [5, 6, 7])], [(0, [8])], [(0, [9]), (1, [10, 11])], [(1, [12])]])
    assert runs == [1, 1], "the one-token steps on the stack, the others op by op"


def test_nothing_is_built_after_the_warm_up_whatever_the_token_counts(model):
    driver = CpuDriver(memory_bytes=1 << 30)
    driver.prepare(fit_plan(driver.device(), model.config, 0, model.name), model)
    driver.warm_up()
    assert driver.stack is not None
    built = driver.compiles
    counts = [1, 2, 5, 12, 13, 31, 32, 33, 64, driver.plan.max_step_tokens]
    feed_steps(driver, [0], [[(0, [3] * n)] for n in counts if n <= driver.plan.max_step_tokens // 2])
    assert driver.compiles == built


def test_a_callee_file_changes_the_stacks_cache_stamp(tmp_path, monkeypatch):
    """numba checks a cached kernel against its own file; the stack's machine code also holds
    its callees', so their files are in its stamp."""
    import os

    from poot.engine.drivers.cpu import runtime
    from poot.engine.drivers.cpu.kernels import decoder

    callee = tmp_path / "callee.py"
    callee.write_text("x = 1\n")
    rule = runtime.KernelCacheStamp(os.path.dirname(decoder.__file__), (str(callee),))
    locator = rule.locator(decoder.decoder_layers.py_func)
    before = locator.get_source_stamp()
    callee.write_text("x = 2\n")
    assert locator.get_source_stamp() != before
    assert rule.locator(runtime.Runtime.compile) is None, "other modules' functions keep numba's own locators"
    shared().compile()  # the runtime applies its rule to every kernel of the folder
    assert isinstance(decoder.decoder_layers._cache._impl.locator, runtime.StampedLocator)


def test_a_product_shares_only_arrays_like_its_own(pair):
    product = pair[0].stack.products[0].path(INTEGER.name)
    codes = product.codes
    with pytest.raises(ValueError, match="must match"):
        product.share(codes[:, 1:], product.scales, product.lane_scales, product.colscale)


def test_products_on_block_codes_never_make_their_float32_copies(model):
    """The family prepares each weight on its first read (engine/models/prepared.py): a driver
    whose every product runs on the file's block codes, stacked or op by op, reads only the
    embedding, the final norm and the rotary table, not a float32 copy of any matrix (on
    SmolLM2 those took 540 MB and most of a warm start)."""
    fed = [[(0, [1, 2, 3])], [(0, [4])]]
    for driver in (_driver(model, True), _driver(model, False)):
        feed_steps(driver, [0], fed)
        assert sorted(driver.weights.made()) == ["embed", "norm", "rope"], driver.weights.made()
    plain = CpuDriver(memory_bytes=1 << 30, compact=False)
    plain.prepare(fit_plan(plain.device(), model.config, 0, model.name), model)
    feed_steps(plain, [0], fed)
    assert set(plain.weights.made()) == set(plain.weights), "the float32 path reads every weight"
