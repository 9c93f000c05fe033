"""A request's choices (n > 1): one sequence per choice, opened together, the prompt prefilled once.

Every member of a group is admitted in the same iteration, with a row each and blocks for
each one's prompt and whole max_tokens, as one request would be: no member ever waits for
room another took. The prompt's whole blocks before the one holding its last token are
reserved once and mapped by every member (reference counts in the block pool, as a prefix
hit maps a cached block). The first member opened (the writer) prefills them; the others
start past them and are not stepped until the writer's KV covers them, then compute only
the prompt's last, partial block, which each needs for its own outputs. After that each
member is a sequence of its own: its own row, random stream, stop rules, events and handle.

A writer released before it filled the shared blocks (cancelled, or its step refused)
hands the writing to the next running member, which resumes where the writer stopped.
A group that scores its prompt (echo) shares nothing: each member needs every prompt
position's logits. Recurrent families share nothing either: a block holds none of their state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .blocks import BlockPool
from .params import InvalidRequest, SamplingParams
from .plan import Plan
from .sequence import Sequence, Status


@dataclass(slots=True, eq=False)
class ChoiceGroup:
    members: list[Sequence]
    shared_blocks: int = 0  # leading prompt blocks every member maps
    writer: Sequence | None = field(default=None)  # the member that prefills the shared blocks


def num_shared_blocks(prompt_len: int, block_size: int, *, scores_prompt: bool, recurrent: bool) -> int:
    if scores_prompt or recurrent:
        return 0
    return (prompt_len - 1) // block_size


def num_group_blocks(need: int, n: int, shared: int) -> int:
    """Blocks a whole group reserves: one member's, then each other's beyond the shared ones."""
    return need + (n - 1) * (need - shared)


def check_fit(plan: Plan, prompt_len: int, params: SamplingParams, n: int) -> None:
    """Refuses, naming n, a group that could never be admitted: more choices than rows, or
    more blocks than the pool holds."""
    if n > plan.rows:
        raise InvalidRequest(f"n ({n}) is more than the {plan.rows} sequences this server runs at once", "n")
    if plan.num_blocks:
        need = plan.blocks_for(prompt_len + params.max_tokens)
        shared = num_shared_blocks(prompt_len, plan.block_size, recurrent=False,
                                   scores_prompt=params.prompt_logprobs is not None)
        total = num_group_blocks(need, n, shared)
        if total > plan.num_blocks:
            raise InvalidRequest(f"{n} choices of this prompt and max_tokens need {total} KV blocks; "
                                 f"this server has {plan.num_blocks}", "n")


def to_open(seq: Sequence) -> list[Sequence]:
    """The sequences that open with `seq`: itself first, then its group's other waiting members."""
    if seq.group is None:
        return [seq]
    return [seq, *(m for m in seq.group.members if m is not seq and m.status is Status.WAITING)]


def attach(first: Sequence, others: list[Sequence], pool: BlockPool, need: int, block_size: int) -> None:
    """Gives each other member the first's shared blocks and blocks of its own."""
    if first.group is None:
        return
    group = first.group
    shared = first.block_table[: group.shared_blocks]
    if group.writer is None or group.writer.status is Status.FINISHED:
        group.writer = first
    for seq in others:
        for b in shared:
            pool.share(b)
        seq.block_table = shared + pool.allocate(need - len(shared))
        seq.num_computed = len(shared) * block_size


def may_step(seq: Sequence) -> bool:
    """False while a member waits for the writer to fill the blocks it starts past."""
    group = seq.group
    if group is None or group.writer is None or group.writer is seq or not seq.prefilling:
        return True
    return group.writer.num_computed >= seq.num_computed


def on_release(seq: Sequence) -> None:
    """A writer leaving early hands its unfinished share of the prompt to the next running member."""
    group = seq.group
    if group is None:
        return
    if group.writer is not seq:
        if group.writer is not None and seq.prefilling:  # register only what was written
            seq.num_computed = min(seq.num_computed, group.writer.num_computed)
        return
    heir = next((m for m in group.members if m is not seq and m.status is Status.RUNNING), None)
    group.writer = heir
    if heir is not None and heir.num_computed > seq.num_computed:
        heir.num_computed = seq.num_computed  # what the writer had written is all there is
