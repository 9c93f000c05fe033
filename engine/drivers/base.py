"""The driver interface: one implementation per backend.

A driver prepares every entry its steps will use once, in `prepare(plan, model)`, and counts
each build as a compile; a step never builds another, whatever the batch looks like.

What the engine tells a driver, and when:
- `open_row(row, block_table)` once when a sequence takes a row: its block table never
  changes afterwards (the whole max_tokens is reserved at open), so a device keeps it
  resident, and a recurrent family starts the row from zero state here.
- `step(batch)` once per step. The base class turns the batch into flat arrays sized to the
  plan (`StepArrays`: tokens, positions, KV slots, sequence lengths, logit indices), so a
  device uploads a handful of arrays once per step, whatever the rows.
- `close_row(row)` once when the sequence leaves the row.

A step returns host logits (float32, the whole vocabulary), one row per logit index.

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
from dataclasses import dataclass

import numpy as np

from ..plan import DeviceInfo, Plan


class StepRefused(Exception):
    """The driver refused the step before running any of it."""


class DeviceFault(Exception):
    """The step may have been half applied; device state can no longer be trusted."""


@dataclass(slots=True)
class RowWork:
    """One row's share of a step: tokens at consecutive positions from `start`."""

    row: int  # the row's slot, as opened with open_row
    tokens: np.ndarray  # int32 token ids to feed
    start: int  # position of tokens[0]
    block_table: list[int]  # physical blocks of positions 0.. (covers start + len(tokens))
    num_logits: int  # logits wanted for the last num_logits positions (0: mid-prefill chunk)


@dataclass(slots=True)
class StepArrays:
    """One step as flat int32 arrays, built once on the host: T tokens, R rows, L logits.
    A device uploads them as they are into buffers sized to the plan (max_step_tokens
    tokens, rows rows)."""

    tokens: np.ndarray  # (T,) token ids
    positions: np.ndarray  # (T,) position of each token in its sequence
    kv_slots: np.ndarray  # (T,) where each token's K/V goes: block * block_size + offset
    token_row: np.ndarray  # (T,) which of the step's rows each token belongs to (0..R-1)
    row_ids: np.ndarray  # (R,) each step row's row slot (as opened)
    row_first: np.ndarray  # (R,) index of the row's first token
    row_tokens: np.ndarray  # (R,) tokens the row feeds
    seq_lens: np.ndarray  # (R,) the row's context after this step: start + tokens
    logit_idx: np.ndarray  # (L,) tokens whose logits (or picked ids) are returned, in row order
    block_size: int

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_rows(self) -> int:
        return len(self.row_ids)


def step_arrays(batch: list[RowWork], block_size: int, tables: np.ndarray | None) -> StepArrays:
    """The flat arrays of a batch, vectorized over its tokens. `tables` holds each open row's
    block table (rows, blocks), as told by open_row; None for a family without KV blocks
    (recurrent state), whose slots are -1."""
    n = len(batch)
    counts = np.fromiter((len(w.tokens) for w in batch), np.int64, n)
    starts = np.fromiter((w.start for w in batch), np.int64, n)
    rows = np.fromiter((w.row for w in batch), np.int64, n)
    logits = np.fromiter((w.num_logits for w in batch), np.int64, n)
    ends = np.cumsum(counts)
    first = ends - counts
    token_row = np.repeat(np.arange(n), counts)
    positions = np.arange(int(ends[-1])) - first[token_row] + starts[token_row]
    if tables is None:
        slots = np.full(len(positions), -1, np.int64)
    else:
        slots = tables[rows[token_row], positions // block_size] * block_size + positions % block_size
    logit_row = np.repeat(np.arange(n), logits)
    logit_idx = np.arange(int(logits.sum())) - (np.cumsum(logits) - logits)[logit_row] + (ends - logits)[logit_row]
    tokens = batch[0].tokens if n == 1 else np.concatenate([w.tokens for w in batch])
    i32 = np.int32
    return StepArrays(tokens.astype(i32), positions.astype(i32), slots.astype(i32), token_row.astype(i32),
                      rows.astype(i32), first.astype(i32), counts.astype(i32), (starts + counts).astype(i32),
                      logit_idx.astype(i32), block_size)


@dataclass(slots=True)
class StepOutput:
    logits: np.ndarray  # (L, vocab) float32 host logits, one row per logit index, in batch order


class Driver(ABC):
    backend: str = ""
    refused_errors: tuple[type[BaseException], ...] = ()  # device errors raised before any work ran
    fault_errors: tuple[type[BaseException], ...] = ()  # device errors after work may have run

    def __init__(self) -> None:
        self.compiles = 0
        # Speculative decoding (engine/speculative.py): the scheduler asks this policy for each
        # decoding row's drafts; None decodes one token per row per step.
        self.draft_policy = None
        self.plan: Plan | None = None
        self._armed_failure: str | None = None
        self.open_rows: dict[int, list[int]] = {}
        # Every open row's block table as one (rows, blocks) host array, padded with the
        # row's first block; None until a row with blocks opens (recurrent families have none).
        self.tables: np.ndarray | None = None

    @abstractmethod
    def device(self) -> DeviceInfo: ...

    def weight_bytes(self, model) -> int:
        """Device memory the model's weights will take once prepared, for fitting the plan
        before prepare() runs: the weights themselves, plus any copy a driver keeps."""
        return sum(w.nbytes for w in model.weights.values())

    def kv_bytes_per_token(self, config) -> int:
        """KV cache bytes one token takes in this driver's layout and dtype (float32 here)."""
        return config.kv_bytes_per_token(4)

    @abstractmethod
    def prepare(self, plan: Plan, model) -> None:
        """Builds every entry a step will use (weights, caches, kernels)."""

    @abstractmethod
    def _run(self, step: StepArrays, batch: list[RowWork]) -> StepOutput: ...

    def open_row(self, row: int, block_table: list[int]) -> None:
        """A sequence took `row` with this block table, fixed until close_row."""
        self.open_rows[row] = list(block_table)
        if block_table:
            if self.tables is None:
                plan = self.plan
                self.tables = np.zeros((plan.rows, plan.blocks_for(plan.positions)), np.int64)
            width = self.tables.shape[1]
            self.tables[row, : len(block_table)] = block_table[:width]
            self.tables[row, len(block_table):] = block_table[0]

    def close_row(self, row: int) -> None:
        self.open_rows.pop(row, None)

    def step(self, batch: list[RowWork]) -> StepOutput:
        if self.plan is None:
            raise StepRefused("the driver was not prepared")
        armed, self._armed_failure = self._armed_failure, None
        if armed == "refuse":
            raise StepRefused("injected: the driver refused the step")
        self._check(batch)
        arrays = step_arrays(batch, self.plan.block_size, self.tables)
        try:
            out = self._run(arrays, batch)
        except (StepRefused, DeviceFault):
            raise
        except self.refused_errors as e:
            raise StepRefused(f"{self.backend}: {type(e).__name__}: {e}") from e
        except self.fault_errors as e:
            raise DeviceFault(f"{self.backend}: {type(e).__name__}: {e}") from e
        if armed == "fault":
            raise DeviceFault("injected: device fault after the step ran")
        return out

    def arm_failure(self, kind: str) -> None:
        """Test hook behind --fault-injection: the next step is refused or faults."""
        if kind not in ("refuse", "fault"):
            raise ValueError(f"unknown driver failure {kind!r}")
        self._armed_failure = kind

    def _check(self, batch: list[RowWork]) -> None:
        plan = self.plan
        total = sum(len(w.tokens) for w in batch)
        if len(batch) > plan.rows or total > plan.max_step_tokens:
            raise StepRefused(f"step of {len(batch)} rows and {total} tokens exceeds the plan")
        for w in batch:
            if w.row not in self.open_rows:
                raise StepRefused(f"row {w.row} was not opened")

    def warm_up(self) -> None:
        """Runs one step of every kind the loop can send, on scratch rows, so that nothing is
        built, loaded or first touched while a request waits: the first request is served
        as fast as the next. Part of preparing: the engine calls it right after prepare(),
        before it serves. The KV written here is never read: a row attends only to positions
        its own sequence wrote first."""
        plan = self.plan
        blocks = list(range(plan.blocks_for(plan.positions))) if plan.num_blocks else []
        blocks = blocks[: plan.num_blocks]
        room = len(blocks) * plan.block_size if blocks else plan.positions
        budget, most = plan.token_budget, plan.max_step_tokens
        # Tokens per row of each warm-up step: one decode row, every row decoding, a few-token
        # row (speculative drafts), a decode row beside a prefill chunk, the longest chunks.
        shapes = [[1], [1] * plan.rows, [min(12, budget)], [1, max(1, budget - 1)], [budget], [most]]
        for shape in shapes:
            shape = [min(n, room) for n in shape[: plan.rows]]
            while sum(shape) > most:
                shape.pop()
            for row in range(len(shape)):
                self.open_row(row, blocks)
            try:
                self.step([RowWork(row, np.zeros(n, np.int32), 0, blocks, 1) for row, n in enumerate(shape)])
            finally:
                for row in range(len(shape)):
                    self.close_row(row)

    def _built(self) -> None:
        """Every entry build goes through here, so the compile count is honest."""
        self.compiles += 1
