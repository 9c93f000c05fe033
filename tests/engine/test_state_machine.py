"""A hypothesis state machine over submit / cancel / step: whatever the interleaving, rows
and blocks are conserved, the pool is whole whenever the engine is idle, and every request
ends exactly once with a reason."""

import os
from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from poot.engine import SamplingParams
from poot.engine.events import Finished

from .harness import Record, greedy, make_engine

REASONS = {"stop", "length", "cancelled", "error"}
# Room for a handful of sequences, so admission waits for room as well as for rows.
SMALL_DEVICE = 6 << 20


class LoopMachine(RuleBasedStateMachine):
    @initialize(memory=st.sampled_from([SMALL_DEVICE, 1 << 30]))
    def start(self, memory):
        self.engine = make_engine(memory_bytes=memory)
        self.requests: list[tuple[Record, object]] = []

    @rule(prompt_len=st.integers(1, 300), max_tokens=st.integers(1, 40), temperature=st.sampled_from([0.0, 0.8]),
          seed=st.integers(0, 3))
    def submit(self, prompt_len, max_tokens, temperature, seed):
        rec = Record()
        prompt = [(7 * i + seed) % 256 for i in range(prompt_len)]
        params = greedy(max_tokens) if temperature == 0 else greedy(max_tokens).__class__(
            max_tokens=max_tokens, temperature=temperature, seed=seed)
        handle = self.engine.submit(prompt, params, rec)
        self.requests.append((rec, handle))

    @precondition(lambda self: self.requests)
    @rule(pick=st.integers(0, 10_000))
    def cancel(self, pick):
        self.requests[pick % len(self.requests)][1].cancel()

    @rule(n=st.integers(1, 6))
    def step(self, n):
        for _ in range(n):
            self.engine.iteration()

    @rule()
    def drain(self):
        for _ in range(2000):
            if not self.engine.in_flight():
                break
            self.engine.iteration()
        assert not self.engine.in_flight()

    @invariant()
    def rows_are_conserved(self):
        s = self.engine.scheduler
        rows = [q.row for q in s.running]
        assert len(set(rows)) == len(rows)
        assert len(s.free_rows) + len(rows) == self.engine.plan.rows
        assert not set(rows) & set(s.free_rows)

    @invariant()
    def blocks_are_conserved(self):
        pool = self.engine.pool
        held = Counter(b for q in self.engine.scheduler.running for b in q.block_table)
        free = list(pool.free_ids)
        assert len(set(free)) == len(free), "a block is free twice"
        assert not set(free) & set(held), "a block is both free and in use"
        for block, count in held.items():
            assert pool.ref_counts[block] == count
        assert all(c >= 0 for c in pool.ref_counts)
        # Blocks neither free nor held by a running request can only be cached prefixes.
        assert len(free) + len(held) + self.engine.metrics()["kv_blocks_cached"] == pool.num_blocks

    @invariant()
    def every_request_ends_at_most_once_and_idle_means_all_ended(self):
        for rec, _ in self.requests:
            end = rec.finished  # asserts at most one end
            if isinstance(end, Finished):
                assert end.reason in REASONS
                assert end.completion_tokens == len(rec.token_ids) <= rec_max(rec)
        if not self.engine.in_flight():
            assert all(rec.finished is not None for rec, _ in self.requests)
            m = self.engine.metrics()
            assert m["kv_blocks_reserved"] == 0 and m["engine_requests_running"] == 0

    @invariant()
    def nothing_is_lost(self):
        ended = sum(1 for rec, _ in self.requests if rec.finished is not None)
        assert ended + self.engine.in_flight() == len(self.requests)


def rec_max(rec):
    # Tokens events never exceed max_tokens: the request's params are not in the record,
    # so use the bound every submit respects.
    return 40


LoopMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("POOT_STATE_EXAMPLES", "1000")), stateful_step_count=15, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestLoopMachine = LoopMachine.TestCase


# ---- prefix reuse under pressure ------------------------------------------------------------


class PrefixMachine(LoopMachine):
    """The loop machine on a small explicit plan, with prompts that share prefixes: hits,
    registrations, cancellations mid-prefill (a small token budget chunks every prompt) and
    eviction (a pool of a few sequences) all interleave. On top of the loop's invariants, every
    block is in exactly one place (free, cached or held) and the cache's index agrees."""

    @initialize(num_blocks=st.sampled_from([6, 10, 24]), block_size=st.sampled_from([4, 16]),
                token_budget=st.sampled_from([8, 24, 64]), rows=st.sampled_from([2, 4]))
    def start(self, num_blocks, block_size, token_budget, rows):
        from .test_prefix_cache import planned_engine

        positions = min(96, num_blocks * block_size)
        self.engine = planned_engine(num_blocks, rows, token_budget, block_size, positions)
        self.requests = []
        self.systems = [[(13 * i + 5 * k) % 256 for i in range(40)] for k in range(3)]

    @rule(system=st.integers(0, 2), cut=st.integers(0, 40), suffix=st.lists(st.integers(0, 255), max_size=12),
          max_tokens=st.integers(1, 12), temperature=st.sampled_from([0.0, 0.8]), seed=st.integers(0, 3))
    def submit(self, system, cut, suffix, max_tokens, temperature, seed):
        rec = Record()
        prompt = self.systems[system][:cut] + suffix or [seed]
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
        self.requests.append((rec, self.engine.submit(prompt, params, rec)))

    @invariant()
    def every_block_is_in_exactly_one_place(self):
        pool, cache = self.engine.pool, self.engine.prefix_cache
        held = {b for q in self.engine.scheduler.running for b in q.block_table}
        free, cached = set(pool.free_ids), set(pool.cached_ids)
        assert not free & cached and not cached & held
        assert free | cached | held == set(range(pool.num_blocks))
        assert all(pool.ref_counts[b] == 0 for b in free | cached)
        assert not any(pool.registered[b] for b in free), "a free block still answers lookups"
        assert all(pool.registered[b] for b in cached)
        assert {b for b in range(pool.num_blocks) if pool.registered[b]} == set(cache.entries)
        assert all(cache.entries[b].key == key for key, b in cache.by_key.items())

    @invariant()
    def hits_map_registered_blocks_and_leave_a_token_to_compute(self):
        bs = self.engine.plan.block_size
        for q in self.engine.scheduler.running:
            assert q.num_cached % bs == 0 and q.num_cached < len(q.prompt)
            assert all(self.engine.pool.registered[b] for b in q.block_table[: q.num_cached // bs])

    @invariant()
    def the_pool_is_whole_when_idle(self):
        if not self.engine.in_flight():
            pool = self.engine.pool
            assert len(pool.free_ids) + pool.num_cached == pool.num_blocks
            assert not any(pool.ref_counts)


PrefixMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestPrefixMachine = PrefixMachine.TestCase
