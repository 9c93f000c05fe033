"""The driver interface: one implementation per backend.

A driver prepares every entry its steps will use once, in `prepare(plan, model)`, and counts
each build as a compile; a step never builds another, whatever the batch looks like.

What the engine tells a driver, and when: one `step(plan)` per step, nothing else. The plan
(engine/step.py's `StepPlan`) carries
- the rows left since the last plan (`closes`), which the base class applies first
  (`_close_row`);
- the rows taken since, each with its block table (`opens`), applied next (`_open_row`): a
  block table never changes while its row is open (the whole max_tokens is reserved at open),
  so a device keeps it resident, and a recurrent family starts the row from zero state here;
- the rows that compute, which the base class turns into flat arrays sized to the plan
  (`StepArrays`: tokens, positions, KV slots, sequence lengths, logit indices), so a device
  uploads a handful of arrays once per step, whatever the rows. A plan with no rows only
  opens and closes.

What a step returns, per logit index: the token picked where the logits are, or the host
logits (float32, the whole vocabulary). The engine marks each row whose tokens may be picked
there (`RowWork.pick`): a request that asks for nothing but greedy, or temperature with
top-k and top-p, from its counter-based random stream (engine/picker.py's plain case:
no logprobs, no penalty, bias or min_tokens mask, no prompt to score). A driver returns
`token_ids` for such rows and logits only for the others, and says which rows it picked
(`StepOutput.picked`, one flag per row), so a device that picks needs to read back L token
ids instead of L x vocab floats. A driver that picks nothing on its device returns every
row's logits (`host_logits`); the base class then picks the marked rows from them with the
engine's own sampler (engine/sampler.py), so a marked row's token is the same function of
its logits, parameters and stream on every backend. `device_picks = False` turns picking
off: every row's logits come back.

The KV cache's layout and dtype belong to the driver: `kv_bytes_per_token(config)` is what
the plan sizes the pool with.

A driver fails in one of two ways, and the loop treats them differently:
- StepRefused: raised before anything ran; no state changed, only this step's requests fail.
- DeviceFault: raised after work may have been half applied; the engine must stop serving.
A driver names its own device's errors (`refused_errors`: raised before any work was
submitted; `fault_errors`: any time after) and the base class maps them to these two, so a
device error never reaches the loop as a crash.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from ..plan import DeviceInfo, Plan
from ..progress import Progress
from ..step import (
    PICK_GREEDY,
    PICK_HOST,
    PICK_SAMPLE,
    PICK_WORDS,
    DeviceFault,
    Pick,
    RowOpen,
    RowWork,
    StepArrays,
    StepOutput,
    StepPlan,
    StepRefused,
    host_logits,
    marked_rows,
    pick_words,
    step_arrays,
)
from .fault_injection import ArmedFailure
from .host_pick import pick_from_logits
from .warm_up import warm_up

# The step's types live in engine/step.py; named here too, for code that reaches them through the driver.
__all__ = ["PICK_GREEDY", "PICK_HOST", "PICK_SAMPLE", "PICK_WORDS", "DeviceFault", "Driver", "Pick", "RowOpen",
           "RowWork", "StepArrays", "StepOutput", "StepPlan", "StepRefused", "host_logits", "marked_rows", "pick_from_logits",
           "pick_words", "step_arrays"]


class Driver(ABC):
    backend: str = ""
    refused_errors: tuple[type[BaseException], ...] = ()  # device errors raised before any work ran
    fault_errors: tuple[type[BaseException], ...] = ()  # device errors after work may have run

    def __init__(self) -> None:
        self.compiles = 0
        self.device_picks = True  # False: every row's logits come back, and the engine picks
        self.plan: Plan | None = None
        self.armed = ArmedFailure()  # behind --fault-injection: what the next step must do
        self.open_rows: dict[int, list[int]] = {}
        # Every open row's block table as one (rows, blocks) host array, padded with the
        # row's first block; None until a row with blocks opens (recurrent families have none).
        self.tables: np.ndarray | None = None
        # Where preparing and warming up say what they are doing (engine/progress.py); the
        # engine hands its own in before prepare(). Nobody listens to this default one.
        self.progress = Progress()
        # True: measure afresh what a driver measures of this machine when preparing (the CPU
        # driver's product choice) instead of reading what an earlier start kept.
        self.retune = False

    @abstractmethod
    def device(self) -> DeviceInfo: ...

    def preload(self) -> None:
        """Work that needs neither the model nor the plan (the CPU driver loads or builds its
        kernels), which a caller may run beside loading the model; else it happens in the
        first call that needs it. Nothing, for a driver with no such work."""
        return None

    def weight_bytes(self, model) -> int:
        """Device memory the model's weights will take once prepared, for fitting the plan
        before prepare() runs: the weights themselves, plus any copy a driver keeps."""
        return sum(4 * int(np.prod(shape)) for shape in model.weight_shapes().values())  # float32

    def product_choice(self) -> tuple[str, ...]:
        """What runs each weight product, where the driver measured it while preparing (for
        the plan /health publishes); empty for a driver that chooses nothing at run time."""
        return ()

    def product_choice_origin(self) -> tuple[str, str]:
        """("measured", when) where prepare() measured the product choice, ("preferred",
        when) where it set it without timing (the machine too busy to tell), ("cached",
        when) where it read what an earlier start made then (UTC, ISO 8601); ("", "") where
        nothing was measured."""
        return "", ""

    def kv_bytes_per_token(self, config) -> int:
        """KV cache bytes one token takes in this driver's layout and dtype (float32 here)."""
        return config.kv_bytes_per_token(4)

    @abstractmethod
    def prepare(self, plan: Plan, model) -> None:
        """Builds every entry a step will use (weights, caches, kernels)."""

    @abstractmethod
    def run_step(self, step: StepArrays, batch: list[RowWork]) -> StepOutput:
        """Runs the step. Returns every logit index's logits (`host_logits`), or (a device
        that picks) the ids of the rows `step.picks` marks, `picked` saying which, and the
        other rows' logits."""

    def _open_row(self, row: int, block_table: tuple[int, ...]) -> None:
        """A plan opened `row` with this block table, fixed until a plan closes it. A driver
        that keeps more per row extends this; opening a row again with the same table must
        leave it as one opening did (the engine resends a refused step's opens)."""
        self.open_rows[row] = list(block_table)
        if block_table:
            if self.tables is None:
                plan = self.plan
                self.tables = np.zeros((plan.rows, plan.blocks_for(plan.positions)), np.int64)
            width = self.tables.shape[1]
            self.tables[row, : len(block_table)] = block_table[:width]
            self.tables[row, len(block_table):] = block_table[0]

    def _close_row(self, row: int) -> None:
        self.open_rows.pop(row, None)

    def step(self, plan: StepPlan) -> StepOutput:
        """Applies the plan's closes and opens, then runs its rows. Refused (StepRefused)
        before any of it is applied where the plan does not fit."""
        if self.plan is None:
            raise StepRefused("the driver was not prepared")
        armed = self.armed.take() if plan.rows else None
        if armed == "refuse":
            raise StepRefused("injected: the driver refused the step")
        self.check_plan(plan)
        for row in plan.closes:
            self._close_row(row)
        for opened in plan.opens:
            self._open_row(opened.row, opened.block_table)
        if not plan.rows:
            return StepOutput([], np.zeros((0, 0), np.float32))
        batch = list(plan.rows)
        arrays = step_arrays(batch, self.plan.block_size, self.tables, self.device_picks)
        try:
            out = self.run_step(arrays, batch)
        except (StepRefused, DeviceFault):
            raise
        except self.refused_errors as e:
            raise StepRefused(f"{self.backend}: {type(e).__name__}: {e}") from e
        except self.fault_errors as e:
            raise DeviceFault(f"{self.backend}: {type(e).__name__}: {e}") from e
        if armed == "fault":
            raise DeviceFault("injected: device fault after the step ran")
        return out if any(out.picked) else pick_from_logits(out.logits, arrays, batch)

    def arm_failure(self, kind: str) -> None:
        """Behind --fault-injection: the next step is refused or faults."""
        self.armed.arm(kind)

    def check_plan(self, plan: StepPlan) -> None:
        limits = self.plan
        total = sum(len(w.tokens) for w in plan.rows)
        if len(plan.rows) > limits.rows or total > limits.max_step_tokens:
            raise StepRefused(f"step of {len(plan.rows)} rows and {total} tokens exceeds the plan")
        if any(not 0 <= o.row < limits.rows for o in plan.opens):
            raise StepRefused(f"a plan opens a row outside 0..{limits.rows - 1}")
        open_rows = plan.open_after(self.open_rows) if plan.opens or plan.closes else self.open_rows
        for w in plan.rows:
            if w.row not in open_rows:
                raise StepRefused(f"row {w.row} was not opened")

    def warm_up(self) -> None:
        """Part of preparing: the engine calls it right after prepare(), before it serves
        (engine/drivers/warm_up.py says what it runs)."""
        warm_up(self)

    def _built(self) -> None:
        """Every entry build goes through here, so the compile count is honest."""
        self.compiles += 1
