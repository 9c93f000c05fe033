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
from dataclasses import dataclass

import numpy as np

from .. import sampler
from ..params import SamplingParams
from ..plan import DeviceInfo, Plan
from ..random_stream import M32, RandomStream


class StepRefused(Exception):
    """The driver refused the step before running any of it."""


class DeviceFault(Exception):
    """The step may have been half applied; device state can no longer be trusted."""


@dataclass(slots=True, frozen=True)
class Pick:
    """How a row's tokens may be picked where its logits are: the request's sampling rules
    and random stream, and the stream counter of the row's first logit (its outputs so far;
    logit j of the row draws at first + j)."""

    params: SamplingParams
    stream: RandomStream
    first: int

    def uniform(self, j: int) -> float:
        return self.stream.uniform(self.first + j)


@dataclass(slots=True)
class RowWork:
    """One row's share of a step: tokens at consecutive positions from `start`."""

    row: int  # the row's slot, as opened with open_row
    tokens: np.ndarray  # int32 token ids to feed
    start: int  # position of tokens[0]
    block_table: list[int]  # physical blocks of positions 0.. (covers start + len(tokens))
    num_logits: int  # logits wanted for the last num_logits positions (0: mid-prefill chunk)
    pick: Pick | None = None  # set: the row's tokens may be picked by the driver; None: host logits


# A picked logit index's words in StepArrays.picks (uint32 each): how (host, greedy or
# sampled), the stream's key (low, high), its choice and counter, the temperature (float32
# bits), top-k (0: none) and top-p (float32 bits).
PICK_HOST, PICK_GREEDY, PICK_SAMPLE = 0, 1, 2
PICK_WORDS = 8


def pick_words(batch: list[RowWork], enabled: bool = True) -> np.ndarray:
    """(L, PICK_WORDS) uint32: each logit index's pick, PICK_HOST where the host picks."""
    words = np.zeros((sum(w.num_logits for w in batch), PICK_WORDS), np.uint32)
    i = 0
    for w in batch:
        n, pick = w.num_logits, w.pick
        if enabled and n and pick is not None:
            params, key = pick.params, pick.stream.key
            f32 = np.array([max(params.temperature, 1e-6), params.top_p], np.float32).view(np.uint32)
            words[i : i + n] = (PICK_GREEDY if params.greedy else PICK_SAMPLE, key & M32, key >> 32,
                                pick.stream.choice, 0, f32[0], min(params.top_k, M32), f32[1])
            words[i : i + n, 4] = (pick.first + np.arange(n)) & M32
        i += n
    return words


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
    picks: np.ndarray  # (L, PICK_WORDS) uint32: how each logit index is picked (pick_words)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_rows(self) -> int:
        return len(self.row_ids)


def step_arrays(batch: list[RowWork], block_size: int, tables: np.ndarray | None, picks: bool = True) -> StepArrays:
    """The flat arrays of a batch, vectorized over its tokens. `tables` holds each open row's
    block table (rows, blocks), as told by open_row; None for a family without KV blocks
    (recurrent state), whose slots are -1. `picks` False: the host picks every row."""
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
                      logit_idx.astype(i32), block_size, pick_words(batch, picks))


@dataclass(slots=True)
class StepOutput:
    # Per batch row, in batch order: whether the driver picked the row's tokens (their ids are
    # in `token_ids`) or left them to the host (their logits are in `logits`). A row is picked
    # whole or not at all; a row with no logits (a mid-prefill chunk) is never picked.
    picked: list[bool]
    # (H, vocab) float32 host logits, in batch order: one row per logit index of the rows not
    # picked (every index, when nothing was).
    logits: np.ndarray
    # (L,) int32: the token picked at each logit index, -1 at the rows not picked; None when
    # no row was.
    token_ids: np.ndarray | None = None


def host_logits(batch: list[RowWork], logits: np.ndarray) -> StepOutput:
    """A step that picked nothing: every logit index's logits go to the host."""
    return StepOutput([False] * len(batch), logits)


def marked_rows(batch: list[RowWork], marked: np.ndarray) -> list[bool]:
    """Per batch row, from the logit indices a step marked for picking (`StepArrays.picks`
    not PICK_HOST): whether the row was marked (a row is marked whole or not at all)."""
    rows, i = [], 0
    for w in batch:
        rows.append(w.num_logits > 0 and bool(marked[i]))
        i += w.num_logits
    return rows


def pick_from_logits(logits: np.ndarray, step: StepArrays, batch: list[RowWork]) -> StepOutput:
    """The marked rows picked from a step's full logits with the engine's sampler, the
    others' logits kept: what a driver whose device cannot pick returns."""
    mode = step.picks[:, 0]
    if not mode.any():
        return host_logits(batch, logits)
    picked = marked_rows(batch, mode != PICK_HOST)
    ids = np.full(len(mode), -1, np.int32)
    i = 0
    for w, row_picked in zip(batch, picked, strict=True):
        if row_picked:
            for j in range(w.num_logits):
                ids[i + j] = sampler.sample(logits[i + j], w.pick.params, w.pick.uniform(j))
        i += w.num_logits
    return StepOutput(picked, logits[ids < 0], ids)


class Driver(ABC):
    backend: str = ""
    refused_errors: tuple[type[BaseException], ...] = ()  # device errors raised before any work ran
    fault_errors: tuple[type[BaseException], ...] = ()  # device errors after work may have run

    def __init__(self) -> None:
        self.compiles = 0
        self.device_picks = True  # False: every row's logits come back, and the engine picks
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
    def run_step(self, step: StepArrays, batch: list[RowWork]) -> StepOutput:
        """Runs the step. Returns every logit index's logits (`host_logits`), or (a device
        that picks) the ids of the rows `step.picks` marks, `picked` saying which, and the
        other rows' logits."""

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
        self.check_batch(batch)
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
        """Test hook behind --fault-injection: the next step is refused or faults."""
        if kind not in ("refuse", "fault"):
            raise ValueError(f"unknown driver failure {kind!r}")
        self._armed_failure = kind

    def check_batch(self, batch: list[RowWork]) -> None:
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
