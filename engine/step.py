"""One step as the engine hands it to a driver and gets it back: the whole step, rows taken
and left included (`StepPlan`), each row's share of it (`RowWork`), the flat arrays a device
uploads (`StepArrays`), how a logit index may be picked on the device (`Pick`, `pick_words`),
what a step returns (`StepOutput`), and the two ways a step fails (`StepRefused`,
`DeviceFault`). Neutral ground: the engine's loop and the drivers both import it, and it
imports neither.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .params import SamplingParams
from .random_stream import M32, RandomStream


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


@dataclass(slots=True, frozen=True)
class RowWork:
    """One row's share of a step: tokens at consecutive positions from `start`."""

    row: int  # the row's slot, as opened by a step plan's RowOpen
    tokens: np.ndarray  # int32 token ids to feed
    start: int  # position of tokens[0]
    block_table: list[int]  # physical blocks of positions 0.. (covers start + len(tokens))
    num_logits: int  # logits wanted for the last num_logits positions (0: mid-prefill chunk)
    pick: Pick | None = None  # set: the row's tokens may be picked by the driver; None: host logits


@dataclass(slots=True, frozen=True)
class RowOpen:
    """A sequence took `row`; its block table is fixed until the row is closed (the whole
    max_tokens is reserved at open), so a device may keep it resident."""

    row: int
    block_table: tuple[int, ...]


@dataclass(slots=True, frozen=True)
class StepPlan:
    """Everything a driver hears of one step, and nothing reaches it outside a plan: the rows
    left since the last plan (`closes`, applied first), the rows taken since (`opens`), and
    the rows that compute (`rows`). A plan with no rows only opens and closes. Applying a
    plan's opens and closes twice is the same as once, so the engine sends them again after
    a refused step."""

    rows: tuple[RowWork, ...] = ()
    opens: tuple[RowOpen, ...] = ()
    closes: tuple[int, ...] = ()

    def __post_init__(self) -> None:  # lists in, tuples kept: nothing a driver is handed can change
        object.__setattr__(self, "rows", tuple(self.rows))
        object.__setattr__(self, "opens", tuple(self.opens))
        object.__setattr__(self, "closes", tuple(self.closes))

    @classmethod
    def opening(cls, tables: dict[int, list[int]], rows=()) -> StepPlan:
        """A plan that opens each row of `tables` with its block table (and runs `rows`)."""
        return cls(tuple(rows), tuple(RowOpen(r, tuple(t)) for r, t in tables.items()))

    @classmethod
    def closing(cls, rows) -> StepPlan:
        """A plan that only closes `rows`."""
        return cls(closes=tuple(rows))

    def open_after(self, open_rows) -> set[int]:
        """The rows open once this plan's closes and opens are applied to `open_rows`."""
        return (set(open_rows) - set(self.closes)) | {o.row for o in self.opens}


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
    block table (rows, blocks), as step plans opened them; None for a family without KV blocks
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
