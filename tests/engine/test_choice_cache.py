"""The product choice measured once per machine and kept (engine/drivers/cpu/products/
choice_cache.py): a second start reads it instead of timing, names the same paths and gives
the same logits; a change of anything the choice depends on measures again; a kept file that
cannot be used is ignored, never a failed start."""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import replace

import numpy as np
import pytest

from poot.engine import Engine
from poot.engine.drivers.cpu import CpuDriver
from poot.engine.drivers.cpu.products import choice_cache, model_products
from poot.engine.drivers.cpu.products.choice_cache import ChoiceCache, Stored
from poot.engine.drivers.cpu.products.model_products import ModelProducts
from poot.engine.drivers.cpu.runtime import shared
from poot.engine.models import family
from poot.engine.models.synthetic import synthetic_llama
from poot.engine.step import RowWork, StepPlan


@pytest.fixture(scope="module")
def model():
    if not shared().available():
        pytest.skip(shared().unavailable_reason())
    return synthetic_llama(3, block_coded=True)


def engine(model, cache: ChoiceCache, retune: bool = False) -> Engine:
    driver = CpuDriver(memory_bytes=1 << 30, device_picks=False, choices=cache)
    driver.retune = retune
    return Engine.create(model, driver=driver)


def logits(engine: Engine, prompt: list[int]) -> np.ndarray:
    """The logits of a prompt's step, then of two decode steps, on row 0."""
    driver = engine.driver
    table = list(range(driver.plan.blocks_for(len(prompt) + 2)))
    driver.step(StepPlan.opening({0: table}))
    out = [driver.step(StepPlan([RowWork(0, np.array(prompt, np.int32), 0, table, 1)])).logits[0]]
    for i in range(2):
        token = int(np.argmax(out[-1]))
        out.append(driver.step(StepPlan([RowWork(0, np.array([token], np.int32), len(prompt) + i, table, 1)])).logits[0])
    driver.step(StepPlan.closing([0]))
    return np.stack(out)


def test_a_second_start_reads_the_choice_names_the_same_paths_and_gives_the_same_logits(model, tmp_path):
    cache = ChoiceCache(tmp_path)
    first = engine(model, cache)
    assert first.plan.products and first.plan.products_chosen == "measured" and first.plan.products_measured_at
    # The engine publishes the choice beside the plan; the driver's plan is the one it was given.
    assert first.driver.plan == replace(first.plan, products=(), products_chosen="", products_measured_at="")
    assert len(list(tmp_path.glob("*.json"))) == 1
    second = engine(model, cache)
    assert second.plan.products_chosen == "cached"
    assert second.plan.products_measured_at == first.plan.products_measured_at
    assert second.plan.products == first.plan.products
    for a, b in zip(first.driver.products.on_codes(), second.driver.products.on_codes(), strict=True):
        assert (a.table, a.paths) == (b.table, b.paths)
    prompts = [[5, 6, 7], list(range(40, 40 + 50)), [9]]
    for prompt in prompts:
        np.testing.assert_array_equal(logits(first, prompt), logits(second, prompt))


def test_retune_measures_again_and_keeps_the_new_measurement(model, tmp_path):
    cache = ChoiceCache(tmp_path)
    engine(model, cache)
    (kept,) = tmp_path.glob("*.json")
    stale = json.loads(kept.read_text())
    stale["measured_at"] = "2000-01-01T00:00:00Z"
    kept.write_text(json.dumps(stale))
    assert engine(model, cache).plan.products_measured_at == "2000-01-01T00:00:00Z"
    again = engine(model, cache, retune=True)
    assert again.plan.products_chosen == "measured" and again.plan.products_measured_at != "2000-01-01T00:00:00Z"
    assert json.loads(kept.read_text())["measured_at"] == again.plan.products_measured_at


@pytest.mark.parametrize("contents", [b"", b"{not json", b'{"key": 1}', b"\xff\xfe", None])
def test_a_kept_file_that_cannot_be_used_is_ignored_with_one_log_line(model, tmp_path, caplog, contents):
    cache = ChoiceCache(tmp_path)
    engine(model, cache)
    (kept,) = tmp_path.glob("*.json")
    if contents is None:  # readable JSON with the right key, but choices that fit nothing
        data = json.loads(kept.read_text())
        data["choices"] = [{"shape": [1, 2], "head": False, "matrices": 1, "table": [[4, "int8"]]}]
        kept.write_text(json.dumps(data))
    else:
        kept.write_bytes(contents)
    with caplog.at_level(logging.WARNING, logger="poot.engine"):
        again = engine(model, cache)
    assert again.plan.products_chosen == "measured"
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    if contents == b'{"key": 1}':
        assert warnings == []  # another key's file: measured and replaced without a word
    else:
        assert len(warnings) == 1 and "product choice" in warnings[0], warnings
    assert engine(model, cache).plan.products_chosen == "cached", "the file was replaced by the new measurement"


def test_a_cache_that_cannot_be_written_costs_only_the_next_start(model, tmp_path, caplog):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    with caplog.at_level(logging.WARNING, logger="poot.engine"):
        first = engine(model, ChoiceCache(blocked / "choices"))
    assert first.plan.products_chosen == "measured"
    assert any("cannot keep" in r.getMessage() for r in caplog.records)


def products_of(model, tmp_path, rows=32, token_budget=80, max_step_tokens=176, use_mkl=True, remeasure=False,
                cache=None) -> ModelProducts:
    """The driver's products for the model, made as CpuDriver.prepare makes them."""
    runtime = shared()
    program = family(model.config).program(model.config)
    weights = family(model.config).prepare(model.config, model.weights, 64)
    from poot.engine.ops import unfused

    parts = unfused(program.ops)
    names = sorted({w for op in parts if op.name in ("matmul", "matmul_add") for w in op.weights})
    head = next((op.weights[0] for op in parts if op.name == "head"), None)
    codes = family(model.config).block_codes(model.config, model.weights)
    return ModelProducts.chosen(weights, names, runtime, rows, token_budget, max_step_tokens, head=head, codes=codes,
                                use_mkl=use_mkl, cache=cache or ChoiceCache(tmp_path), remeasure=remeasure)


@pytest.mark.parametrize("change", ["rows", "token_budget", "max_step_tokens", "paths", "library", "cpu", "threads",
                                    "project"])
def test_a_change_of_any_key_part_measures_again(model, tmp_path, monkeypatch, change):
    assert products_of(model, tmp_path).measured_now
    assert not products_of(model, tmp_path).measured_now, "the same conditions read what was kept"
    changed = {"rows": {"rows": 16}, "token_budget": {"token_budget": 64}, "max_step_tokens": {"max_step_tokens": 96},
               "paths": {"use_mkl": False}}.get(change, {})
    if change == "library":
        real = choice_cache._version
        monkeypatch.setattr(choice_cache, "_version", lambda name: "0.0.0" if name == "numba" else real(name))
    elif change == "cpu":
        monkeypatch.setattr(choice_cache, "_cpu_flags", lambda: "fpu sse2")
    elif change == "threads":
        monkeypatch.setenv("OMP_NUM_THREADS", "7")
    elif change == "project":
        real = choice_cache._version
        monkeypatch.setattr(choice_cache, "_version", lambda name: "9.9" if name == "poot" else real(name))
    assert products_of(model, tmp_path, **changed).measured_now
    assert len(list(tmp_path.glob("*.json"))) == 2


def test_a_kept_choice_builds_only_the_paths_it_names(model, tmp_path, monkeypatch):
    """A kept choice that names only the first path of each shape: no other path's layout or
    copy (an MKL packed matrix, float32 values) is made for the products on codes."""
    first = products_of(model, tmp_path)
    (kept,) = tmp_path.glob("*.json")
    data = json.loads(kept.read_text())
    for c, product in zip(data["choices"], first.choices, strict=True):
        c["table"] = [[c["table"][-1][0], next(p for p in first.on_codes() if p.shape == product.shape).path_for(1)]]
    kept.write_text(json.dumps(data))
    built = []
    real = model_products.coded_product

    def spy(codes, colscale, runtime, names=None, head=False):
        built.append(names)
        return real(codes, colscale, runtime, names, head)

    monkeypatch.setattr(model_products, "coded_product", spy)
    read = products_of(model, tmp_path)
    assert not read.measured_now and built
    assert all(len(names) == 1 for names in built), built
    assert all(len(p.paths) == 1 for p in read.on_codes())


def test_the_key_holds_what_it_says(model, tmp_path):
    products_of(model, tmp_path)
    (kept,) = tmp_path.glob("*.json")
    key = json.loads(kept.read_text())["key"]
    assert set(key) == {"format", "poot", "cpu", "flags", "target", "threads", "libraries", "library_settings",
                        "products", "plan"}
    assert set(key["libraries"]) == {"numpy", "numba", "llvmlite", "mkl"}
    assert key["library_settings"] == [os.environ.get(k) for k in ("OPENBLAS_CORETYPE", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR")]
    assert key["plan"] == {"rows": 32, "token_budget": 80, "max_step_tokens": 176}
    assert all({"shape", "head", "matrices", "codes", "paths"} <= set(p) for p in key["products"])
    assert ChoiceCache(tmp_path).read(key) is not None
    assert ChoiceCache(tmp_path).read({**key, "format": -1}) is None


def test_write_is_whole_or_nothing(tmp_path):
    cache = ChoiceCache(tmp_path)
    key = {"k": 1}
    cache.write(key, Stored([{"shape": [1, 1]}], "2026-01-01T00:00:00Z", 1.5))
    assert cache.read(key) == Stored([{"shape": [1, 1]}], "2026-01-01T00:00:00Z", 1.5)
    assert [p.name for p in tmp_path.iterdir()] == [cache.path(key).name], "no temporary file is left"


class Busy:
    """A watch of the machine on which others take `share` of the CPUs."""

    def __init__(self, share):
        self.value = share

    def share(self):
        return self.value


def test_a_machine_too_busy_to_time_keeps_the_preferred_paths_until_a_quieter_start(model, tmp_path, monkeypatch,
                                                                                      caplog):
    from poot.engine.drivers.cpu.products import choice

    monkeypatch.setattr(choice, "Contention", lambda: Busy(0.6))
    with caplog.at_level(logging.WARNING, logger="poot.engine"):
        busy = products_of(model, tmp_path)
    assert busy.origin() == "preferred" and not busy.timed
    assert all(p.table == [(p.table[-1][0], p.paths[0])] and len(p.paths) == 1 for p in busy.on_codes())
    assert [r.getMessage() for r in caplog.records if "took 60% of the CPUs" in r.getMessage()], caplog.records
    monkeypatch.setattr(model_products, "_quiet_now", lambda: False)
    still = products_of(model, tmp_path)
    assert still.origin() == "cached" and not still.timed, "still busy: the kept choice is used"
    monkeypatch.setattr(model_products, "_quiet_now", lambda: True)
    monkeypatch.setattr(choice, "Contention", lambda: Busy(0.0))
    quiet = products_of(model, tmp_path)
    assert quiet.origin() == "measured" and quiet.timed
    monkeypatch.setattr(model_products, "_quiet_now", lambda: pytest.fail("a timed choice is read without a watch"))
    assert products_of(model, tmp_path).origin() == "cached"


@pytest.mark.parametrize("float_wins", [False, True])
def test_a_measurement_copies_one_matrix_a_shape_and_the_rest_only_where_a_copy_wins(model, tmp_path, monkeypatch,
                                                                                     float_wins):
    """Measuring builds the paths that hold a float32 copy (Path.float_copy) for the first
    matrix of each shape only, and times them there from MEMORY_BOUND_TOKENS up; once the
    choice is made every matrix holds exactly the paths its shape's table names, a copy
    where one won a bucket, and computes on it what its own integer path computes."""
    from poot.engine.drivers.cpu.products import choice
    from poot.engine.drivers.cpu.products.registry import CODE_PATHS

    copies = {k.name for k in CODE_PATHS if k.float_copy}
    built = []
    real_build, real_table = model_products.coded_product, choice._table

    def spy(codes, colscale, runtime, names=None, head=False):
        product = real_build(codes, colscale, runtime, names, head)
        built.append(((product.shape, product.head), set(product.paths)))
        return product

    def copy_from_12(seconds, pools, first, margin=choice.KEEP_MARGIN):
        table = real_table(seconds, pools, first, margin)
        timed = sorted(seconds)
        copy = next((p for t in timed if t > choice.MEMORY_BOUND_TOKENS for p in seconds[t] if p in copies), None)
        if not float_wins or copy is None or timed[-1] <= choice.MEMORY_BOUND_TOKENS:
            return table
        return [(choice.MEMORY_BOUND_TOKENS, first), (timed[-1], copy)]

    monkeypatch.setattr(model_products, "coded_product", spy)
    monkeypatch.setattr(choice, "_table", copy_from_12)
    products = products_of(model, tmp_path)
    groups: dict[tuple, list] = {}
    for p in products.on_codes():
        groups.setdefault((p.shape, p.head), []).append(p)
    assert any(len(members) > 1 for members in groups.values())
    # The builds before the choice, in order (the kernels' check on a known input aside).
    first = [(group, paths) for group, paths in built if group in groups][: len(products.on_codes())]
    seen: set[tuple] = set()
    for group, paths in first:
        if group in seen:
            assert not paths & copies, "a copy was built for a matrix that is not its shape's first"
        seen.add(group)
    assert any(paths & copies for _, paths in first), "no shape was offered a path with a copy: nothing shown"
    for c in (c for c in products.choices if c.matrices > 1):  # a lone matrix holds all it may take
        for tokens in (t for t in c.seconds if t <= choice.MEMORY_BOUND_TOKENS):
            assert not set(c.seconds[tokens]) & copies, "a copy is not timed where a pass reads every matrix"
    x = np.random.default_rng(0).standard_normal((products.on_codes()[0].shape[1], 16), dtype=np.float32)
    for (shape, _), members in groups.items():
        for p in members:
            assert set(p.paths) == {path for _, path in p.table}
            if float_wins and p.table[-1][1] in copies and shape[1] == x.shape[0]:
                np.testing.assert_allclose(p.run(x, path=p.table[-1][1]), p.run(x, path=p.table[0][1]),
                                           rtol=1e-4, atol=1e-4)


def test_layouts_made_side_by_side_are_the_ones_made_one_at_a_time(model, tmp_path, monkeypatch):
    """A kept choice's products are laid out on several threads while the block kernels load:
    the same products, in the same order, giving the same results as laid out one by one."""
    first = products_of(model, tmp_path)  # measured and kept
    # A choice of paths without float32 copies (those are packed one at a time): each shape's
    # first path, as a kept choice of the integer path at every count names.
    (kept,) = tmp_path.glob("*.json")
    data = json.loads(kept.read_text())
    for c, product in zip(data["choices"], first.choices, strict=True):
        c["table"] = [[c["table"][-1][0], next(p for p in first.on_codes() if p.shape == product.shape).path_for(1)]]
    kept.write_text(json.dumps(data))
    monkeypatch.setattr(model_products, "layout_workers", lambda: 1)
    alone = products_of(model, tmp_path)
    threads, pools = [], []
    real, real_pool = model_products.coded_product, model_products.ThreadPoolExecutor

    def spy(codes, colscale, runtime, names=None, head=False):
        threads.append(threading.current_thread().name)
        return real(codes, colscale, runtime, names, head)

    def pool_spy(workers, **kwargs):
        pools.append(workers)
        return real_pool(workers, **kwargs)

    monkeypatch.setattr(model_products, "coded_product", spy)
    monkeypatch.setattr(model_products, "ThreadPoolExecutor", pool_spy)
    monkeypatch.setattr(model_products, "layout_workers", lambda: 4)
    beside = products_of(model, tmp_path)
    assert not alone.measured_now and not beside.measured_now
    assert pools == [4] and threads and all(name.startswith("poot-layout") for name in threads), (pools, threads)
    assert list(alone._products) == list(beside._products)
    rng = np.random.default_rng(0)
    for name in alone._products:
        a, b = alone[name], beside[name]
        assert a.paths == b.paths and a.table == b.table
        x = rng.standard_normal((a.shape[1], 5)).astype(np.float32)
        for path in a.paths:
            assert np.array_equal(a.run(x, path=path), b.run(x, path=path)), (name, path)
