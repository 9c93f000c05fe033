"""Preparing warms every kind of step the loop can send, so nothing is built, loaded or first
touched while the first request waits."""

from __future__ import annotations

from poot.engine import Engine
from poot.engine.drivers.cpu import CpuDriver
from poot.engine.models.synthetic import synthetic_llama

from .harness import greedy, run_until_idle, submit


class RecordingDriver(CpuDriver):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.shapes: list[list[int]] = []

    def run_step(self, step, batch):
        self.shapes.append([len(w.tokens) for w in batch])
        return super().run_step(step, batch)


def test_warm_up_steps_every_kind_the_loop_sends_and_leaves_no_row_open():
    driver = RecordingDriver(memory_bytes=1 << 30)
    engine = Engine.create(synthetic_llama(0), driver=driver)
    plan = engine.plan
    shapes = driver.shapes
    assert [1] in shapes, "one decoding row"
    assert [1] * plan.rows in shapes, "every row decoding"
    assert any(len(s) > 1 and s[0] == 1 and sum(s) == plan.token_budget for s in shapes), \
        "a decoding row beside a prefill chunk of the budget"
    assert [plan.max_step_tokens] in shapes, "the longest chunk, with no row decoding"
    assert any(len(s) == 1 and 1 < s[0] <= 12 for s in shapes), "a few-token row (speculative drafts)"
    assert driver.open_rows == {}, "warm-up rows stay open"
    assert engine.pool.num_free == plan.num_blocks, "warm-up took blocks"


def test_nothing_is_built_after_preparing():
    """The compile count after preparing (warm-up included) is the count after serving."""
    driver = RecordingDriver(memory_bytes=1 << 30)
    engine = Engine.create(synthetic_llama(0), driver=driver)
    prepared = driver.compiles
    recs = [submit(engine, [40 + i] * (5 + 37 * i), greedy(9, ignore_eos=True))[0] for i in range(5)]
    run_until_idle(engine)
    assert all(r.finished.reason == "length" for r in recs)
    assert driver.compiles == prepared
