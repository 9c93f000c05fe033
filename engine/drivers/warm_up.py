"""The warm-up: one step of every kind the loop can send, run once after prepare() on
scratch rows, so that nothing is built, loaded or first touched while a request waits and the
first request is served as fast as the next."""

from __future__ import annotations

import numpy as np

from ..plan import Plan
from ..step import RowWork, StepPlan


def warm_up_shapes(plan: Plan) -> list[list[int]]:
    """Tokens per row of each warm-up step: one decode row, every row decoding, a few-token
    row (speculative drafts), a decode row beside a prefill chunk, the longest chunks; each
    within the rows, the step's tokens and the room one row's blocks give."""
    room = min(plan.blocks_for(plan.positions), plan.num_blocks) * plan.block_size if plan.num_blocks \
        else plan.positions
    budget, most = plan.token_budget, plan.max_step_tokens
    shapes = []
    for shape in ([1], [1] * plan.rows, [min(12, budget)], [1, max(1, budget - 1)], [budget], [most]):
        shape = [min(n, room) for n in shape[: plan.rows]]
        while sum(shape) > most:
            shape.pop()
        shapes.append(shape)
    return shapes


def warm_up(driver) -> None:
    """Runs the warm-up steps on `driver`, every row over the same scratch blocks. The KV
    written here is never read: a row attends only to positions its own sequence wrote first."""
    plan = driver.plan
    blocks = list(range(min(plan.blocks_for(plan.positions), plan.num_blocks))) if plan.num_blocks else []
    for shape in driver.progress.each("warm_up", "warm-up steps", warm_up_shapes(plan)):
        rows = range(len(shape))
        try:
            driver.step(StepPlan.opening({row: blocks for row in rows},
                                         [RowWork(row, np.zeros(n, np.int32), 0, blocks, 1) for row, n in enumerate(shape)]))
        finally:
            driver.step(StepPlan.closing(rows))
