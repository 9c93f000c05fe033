"""Which requests hold a row, and what each row computes in the next step.

Admission is oldest first and reserves the blocks for a request's prompt plus its whole
max_tokens, so a running request is never starved and nothing is ever preempted. The oldest
waiting request that does not fit blocks everything younger: letting a small young request
jump ahead would let a stream of small requests starve a large old one forever.

A step hands out a token budget: every decoding row first (one token, plus its drafts), then
prefill chunks, oldest first, from what is left. The budget beside D decoding rows is at most
the plan's token_budget and at most about twice D (Plan.step_budget): a burst of long prompts
never makes a decoding row's next token wait for more than about two of its usual steps. A
step with no decoding row has nobody to delay, and its prefill takes the plan's idle budget.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from . import choices
from .blocks import BlockPool
from .plan import Plan
from .prefix_cache import PrefixCache
from .sequence import Sequence, Status
from .step import RowWork


@dataclass(slots=True)
class Scheduled:
    seq: Sequence
    work: RowWork
    drafts: list[int] = field(default_factory=list)


class Scheduler:
    def __init__(self, plan: Plan, pool: BlockPool, prefix_cache: PrefixCache, draft_policy=None):
        """`draft_policy` (engine/speculative.py): asked for each decoding row's drafts when a
        step is scheduled; None decodes one token a row a step. Verifying the drafts is the
        picking's, not the scheduler's."""
        self.plan = plan
        self.pool = pool
        self.prefix_cache = prefix_cache
        self.draft_policy = draft_policy
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_rows: list[int] = list(range(plan.rows - 1, -1, -1))

    @property
    def num_reserved_blocks(self) -> int:
        return len({b for s in self.running for b in s.block_table})  # a shared prefix block counts once

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    # phase 3: open waiting requests, oldest first, while a row and KV room remain
    def open_waiting(self) -> list[Sequence]:
        opened = []
        while self.waiting and self.free_rows:
            seq = self.next_waiting()
            group = choices.to_open(seq)  # a request's choices open together, or not at all
            if len(group) > len(self.free_rows) or not self._reserve(seq, group[1:]):
                break  # the oldest waits for room; nothing younger goes ahead of it
            for q in group:
                self.waiting.remove(q)
                q.row = self.free_rows.pop()
                q.status = Status.RUNNING
                self.running.append(q)
                opened.append(q)
        return opened

    def next_waiting(self) -> Sequence:
        """The request admission considers next: the oldest."""
        return self.waiting[0]

    def blocks_needed(self, seq: Sequence) -> int:
        """Blocks reserved at open: the prompt plus the whole max_tokens."""
        return self.plan.blocks_for(seq.num_reserved_tokens)

    def _reserve(self, seq: Sequence, others: list[Sequence] = ()) -> bool:
        if self.plan.num_blocks == 0:  # recurrent family: a row's state slot is all it needs
            return True
        need = self.blocks_needed(seq)
        extra = choices.num_group_blocks(need, 1 + len(others), seq.group.shared_blocks if others else 0) - need
        table = self.prefix_cache.open(seq, need, extra)  # the prompt's cached blocks first
        if table is None:
            return False
        seq.block_table = table
        choices.attach(seq, list(others), self.pool, need, self.plan.block_size)
        return True

    # phase 4: what each row computes in this step, within the token budget
    def schedule(self) -> list[Scheduled]:
        steps: list[Scheduled] = []
        decoding = self.decoding_rows()
        budget = self.plan.step_budget(len(decoding))
        room = max(0, budget - len(decoding))  # every decoding row gets its token first
        for seq in decoding:
            drafts = self.draft_policy.propose(seq, room, len(decoding)) if self.draft_policy else []
            # Within the budget, and a round commits at most max_tokens - len(output) tokens
            # (drafts + 1), which also keeps it inside the positions reserved at open.
            drafts = list(drafts[: max(0, min(room, seq.params.max_tokens - len(seq.output) - 1))])
            room -= len(drafts)
            feed = [seq.tokens[-1], *drafts]
            steps.append(Scheduled(seq, RowWork(seq.row, np.array(feed, np.int32), seq.num_computed,
                                                seq.block_table, len(feed)), drafts))
        budget -= sum(len(s.work.tokens) for s in steps)
        for seq in sorted((s for s in self.running if s.prefilling), key=lambda s: s.arrival):
            if budget <= 0:
                break
            if not choices.may_step(seq):
                continue  # a choice waits for the prompt blocks it shares to be written
            chunk = self.next_prompt_tokens(seq, budget, bool(decoding))
            last = seq.num_computed + len(chunk) == len(seq.prompt)
            # A prompt being scored (echo) needs the logits of every position, not only the last.
            num_logits = len(chunk) if seq.params.prompt_logprobs is not None else 1 if last else 0
            steps.append(Scheduled(seq, RowWork(seq.row, np.array(chunk, np.int32), seq.num_computed,
                                                seq.block_table, num_logits)))
            budget -= len(chunk)
        return steps

    def decoding_rows(self) -> list[Sequence]:
        """The running requests past their prompt: each gets a token in every step."""
        return [s for s in self.running if not s.prefilling]

    def next_prompt_tokens(self, seq: Sequence, budget: int, decoding: bool) -> list[int]:
        """The next prompt tokens a prefilling row feeds, at most `budget` of them (`decoding`:
        whether decoding rows share the step, which only sizes the budget)."""
        return seq.prompt[seq.num_computed : seq.num_computed + budget]

    # phase 2 and endings
    def release(self, seq: Sequence) -> int | None:
        """Returns the row and the blocks; a sequence in no list is left alone. Returns the
        prompt tokens the release registered for prefix reuse, None for a family that
        registers nothing (recurrent state)."""
        registered = 0
        if seq.status is Status.RUNNING:
            choices.on_release(seq)
            self.running.remove(seq)
            self.free_rows.append(seq.row)
            registered = self.prefix_cache.release(seq)
            seq.block_table = []
            seq.row = -1
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        return registered
