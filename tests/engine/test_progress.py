"""A starting engine says what it is doing (engine/progress.py): loading the model, preparing
the driver, warming up, in that order, with how far it has got where it counts."""

from __future__ import annotations

import threading

import pytest

from poot.engine import Engine
from poot.engine.drivers.cpu import CpuDriver
from poot.engine.drivers.warm_up import warm_up_shapes
from poot.engine.models import load_model
from poot.engine.progress import PHASES, Progress


def recorded() -> tuple[Progress, list]:
    progress, seen = Progress(), []
    progress.listen(seen.append)
    return progress, seen


def test_a_report_says_which_item_is_under_way_and_how_far_the_phase_is():
    progress, seen = recorded()
    assert progress.now.as_dict() == {"status": "loading", "phase": "model", "detail": "starting", "progress": None}
    progress.report("compile", "compiling CPU kernels", 2, 11)
    assert progress.now.as_dict() == {"status": "loading", "phase": "compile",
                                      "detail": "compiling CPU kernels (3 of 11)", "progress": 0.182}
    progress.report("measure", "timing products")
    assert progress.now.as_dict()["progress"] is None and progress.now.detail == "timing products"
    assert [s.phase for s in seen] == ["compile", "measure"]
    with pytest.raises(ValueError, match="phase"):
        progress.report("linking", "x")


def test_each_reports_every_item_before_it_and_the_whole_after():
    progress, seen = recorded()
    items = list(progress.each("warm_up", "warm-up steps", "abc"))
    assert items == ["a", "b", "c"]
    assert [(s.detail, s.fraction) for s in seen] == [
        ("warm-up steps (1 of 3)", 0.0), ("warm-up steps (2 of 3)", 1 / 3), ("warm-up steps (3 of 3)", 2 / 3),
        ("warm-up steps (3 of 3)", 1.0)]


def test_finish_tells_the_listeners_once_more():
    progress, seen = recorded()
    progress.report("warm_up", "w", 1, 1)
    progress.finish()
    assert progress.finished == "ready" and len(seen) == 2 and seen[-1] is progress.now


def test_a_reader_on_another_thread_always_sees_a_whole_stage():
    progress = Progress()
    stop = threading.Event()
    torn = []

    def read():
        while not stop.is_set():
            s = progress.now
            if s.fraction is not None and s.detail != f"step ({round(s.fraction * 1000) + 1} of 1000)":
                torn.append(s)

    reader = threading.Thread(target=read)
    reader.start()
    for i in range(1000):
        progress.report("warm_up", "step", i, 1000)
    stop.set()
    reader.join()
    assert not torn


def test_engine_create_reports_the_phases_in_order_and_every_warm_up_step():
    progress, seen = recorded()
    model = load_model("synthetic", progress=progress)
    engine = Engine.create(model, driver=CpuDriver(memory_bytes=1 << 30), progress=progress)
    phases = [s.phase for s in seen]
    order = [p for i, p in enumerate(phases) if i == 0 or phases[i - 1] != p]
    assert order == [p for p in PHASES if p in order] and order[0] == "model" and order[-1] == "warm_up"
    assert "compile" in order
    steps = [s for s in seen if s.phase == "warm_up"]
    assert len(steps) == len(warm_up_shapes(engine.plan)) + 1 and steps[-1].fraction == 1.0
    assert engine.driver.progress is progress


def test_a_driver_made_without_a_progress_reports_to_nobody():
    engine = Engine.create(load_model("synthetic"), driver=CpuDriver(memory_bytes=1 << 30))
    assert engine.driver.progress.now.phase == "warm_up"  # its own, which nobody reads


def test_a_cpu_driver_that_measures_says_so_shape_by_shape(tmp_path):
    from poot.engine.drivers.cpu.products.choice_cache import ChoiceCache
    from poot.engine.models.synthetic import synthetic_llama

    for kept in (False, True):
        progress, seen = recorded()
        driver = CpuDriver(memory_bytes=1 << 30, choices=ChoiceCache(tmp_path))
        Engine.create(synthetic_llama(3, block_coded=True), driver=driver, progress=progress)
        phases = [s.phase for s in seen]
        order = [p for i, p in enumerate(phases) if i == 0 or phases[i - 1] != p]
        assert order == (["model", "compile", "warm_up"] if kept else ["model", "compile", "measure", "warm_up"])
        assert any(s.detail.startswith("laying out the weights") for s in seen)
        shapes = [s for s in seen if s.phase == "measure"]
        assert not kept or not shapes, "a kept choice is read, not measured"
        if not kept:
            n = len(driver.products.choices)
            assert [s.fraction for s in shapes] == [k / n for k in range(n)] and len({s.detail for s in shapes}) == n
