"""A hypothesis state machine over submit / cancel / step / refuse / fault: whatever the
interleaving, rows and blocks are conserved (checked against the pool itself), nothing
running is ever preempted, a refused step fails only its own requests, a fault releases
nothing, the pool is whole whenever the engine is idle, and every request ends exactly once
with a reason and within its own max_tokens."""

import os
from collections import Counter

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from poot_mutants.engine_parts import DieFreesBlocks, PreemptYoungest, RefuseFailsWaiting

from poot.engine import Engine, EngineDead, SamplingParams
from poot.engine.drivers.base import DeviceFault
from poot.engine.drivers.cpu import CpuDriver
from poot.engine.events import Finished
from poot.engine.models.synthetic import synthetic_llama
from poot.engine.plan import Plan

from .harness import Record, make_engine

REASONS = {"stop", "length", "cancelled", "error"}
# Room for a handful of sequences, so admission waits for room as well as for rows.
SMALL_DEVICE = 6 << 20
MAX_TOKENS = st.one_of(st.integers(1, 40), st.sampled_from([64, 120, 200]))


class LoopMachine(RuleBasedStateMachine):
    engine_class = Engine  # tests of the machine itself swap in a broken one

    @initialize(shape=st.sampled_from(["small device", "large device", "two rows"]))
    def start(self, shape):
        if shape == "two rows":  # every row taken soon: requests wait for rows, not only room
            model = synthetic_llama(0)
            plan = Plan("numpy", 2, 256, 16, 32, 64, model.name)
            driver = CpuDriver()
            driver.prepare(plan, model)
            self.engine = self.engine_class(model, driver, plan, None)
        else:
            memory = SMALL_DEVICE if shape == "small device" else 1 << 30
            self.engine = make_engine(memory_bytes=memory, engine_class=self.engine_class)
        self.setup()

    def setup(self):
        self.requests: list[tuple[Record, object, int]] = []  # (record, handle, max_tokens)
        self.running: set[int] = set()  # request ids running after the last rule
        self.refused: set[int] = set()  # request ids a refused step may fail
        self.dead_held = None  # (running ids, free blocks) when the engine died

    @property
    def alive(self) -> bool:
        return self.engine.health().status == "ok"

    @rule(prompt_len=st.integers(1, 300), max_tokens=MAX_TOKENS, temperature=st.sampled_from([0.0, 0.8]),
          seed=st.integers(0, 3))
    def submit(self, prompt_len, max_tokens, temperature, seed):
        rec = Record()
        prompt = [(7 * i + seed) % 256 for i in range(prompt_len)]
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
        try:
            handle = self.engine.submit(prompt, params, rec)
        except EngineDead:
            assert not self.alive
            return
        self.requests.append((rec, handle, max_tokens))

    @precondition(lambda self: self.requests)
    @rule(pick=st.integers(0, 10_000))
    def cancel(self, pick):
        self.requests[pick % len(self.requests)][1].cancel()

    @precondition(lambda self: self.alive)
    @rule(n=st.integers(1, 6))
    def step(self, n):
        for _ in range(n):
            self.engine.iteration()

    @precondition(lambda self: self.alive)
    @rule()
    def refuse(self):
        """The next step is refused before it runs: only the requests in it may fail."""
        self.engine.inject_fault("refuse")
        scheduled = self.engine.scheduler.schedule
        seen: list = []

        def recorded(*a, **kw):
            out = scheduled(*a, **kw)
            seen.extend(x.seq.request_id for x in out)
            return out

        self.engine.scheduler.schedule = recorded
        try:
            self.engine.iteration()
        finally:
            del self.engine.scheduler.schedule
        self.engine.driver.armed.take()  # no step ran: nothing was refused
        self.refused |= set(seen)

    @precondition(lambda self: self.alive and self.engine.in_flight())
    @rule()
    def fault(self):
        """A step that may have been half applied: the engine dies and releases nothing."""
        s = self.engine.scheduler
        self.engine.inject_fault("fault")
        try:
            for _ in range(50):  # until a step runs (and faults)
                if not self.engine.in_flight():
                    break
                self.engine.iteration()
        except DeviceFault as e:
            held = ({q.request_id for q in s.running}, self.engine.pool.num_free)
            self.engine.die("fault", str(e))  # as the engine thread does
            self.dead_held = held
            return
        self.engine.driver.armed.take()  # no step ran: nothing to fault

    @precondition(lambda self: self.alive)
    @rule()
    def drain(self):
        for _ in range(4000):
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
        free, cached = list(pool.free_ids), list(pool.cached_ids)
        assert len(set(free)) == len(free), "a block is free twice"
        assert not set(free) & set(held), "a block is both free and in use"
        assert not set(cached) & set(held) and not set(free) & set(cached)
        for block, count in held.items():
            assert pool.ref_counts[block] == count
        assert all(pool.ref_counts[b] == 0 for b in (*free, *cached))
        # Every block of the pool is free, cached or held by a running request: none is lost.
        assert set(free) | set(cached) | set(held) == set(range(pool.num_blocks))

    @invariant()
    def nothing_running_is_preempted(self):
        """A request that held a row keeps it until it ends; it never goes back to waiting,
        and it ends with an error only when a refused step held it."""
        s = self.engine.scheduler
        now = {q.request_id for q in s.running}
        waiting = {q.request_id for q in s.waiting}
        assert not self.running & waiting, "a running request went back to waiting"
        by_id = {h.request_id: rec for rec, h, _ in self.requests}
        for rid in self.running - now:
            end = by_id[rid].finished
            assert end is not None, f"request {rid} lost its row without ending"
            if end.reason == "error" and self.dead_held is None:
                assert rid in self.refused, f"request {rid} failed outside a refused step: {end.error}"
        self.running = now if self.alive else self.running

    @invariant()
    def refused_steps_fail_only_their_own(self):
        for rec, h, _ in self.requests:
            end = rec.finished
            if isinstance(end, Finished) and end.reason == "error" and self.dead_held is None:
                assert h.request_id in self.refused, f"request {h.request_id} failed: {end.error}"

    @invariant()
    def a_fault_releases_nothing(self):
        if self.dead_held is None:
            return
        running, free = self.dead_held
        assert {q.request_id for q in self.engine.scheduler.running} == running
        assert self.engine.pool.num_free == free

    @invariant()
    def every_request_ends_at_most_once_and_idle_means_all_ended(self):
        for rec, _, max_tokens in self.requests:
            end = rec.finished  # asserts at most one end
            assert len(rec.token_ids) <= max_tokens
            if isinstance(end, Finished):
                assert end.reason in REASONS
                assert end.completion_tokens == len(rec.token_ids)
        if not self.engine.in_flight():
            assert all(rec.finished is not None for rec, _, _ in self.requests)
            if self.alive:
                m = self.engine.metrics()
                assert m["kv_blocks_reserved"] == 0 and m["engine_requests_running"] == 0

    @invariant()
    def nothing_is_lost(self):
        ended = sum(1 for rec, _, _ in self.requests if rec.finished is not None)
        assert ended + self.engine.in_flight() == len(self.requests)


LoopMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("POOT_STATE_EXAMPLES", "1000")), stateful_step_count=15, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestLoopMachine = LoopMachine.TestCase



def test_the_machine_catches_a_fault_that_frees_blocks():
    machine = type("BrokenDie", (LoopMachine,), {"engine_class": DieFreesBlocks})
    machine.TestCase.settings = settings(max_examples=400, stateful_step_count=30, deadline=None,
                                         phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    with pytest.raises(AssertionError):
        machine.TestCase("runTest").runTest()

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
        self.setup()
        self.systems = [[(13 * i + 5 * k) % 256 for i in range(40)] for k in range(3)]

    @rule(system=st.integers(0, 2), cut=st.integers(0, 40), suffix=st.lists(st.integers(0, 255), max_size=12),
          max_tokens=st.integers(1, 12), temperature=st.sampled_from([0.0, 0.8]), seed=st.integers(0, 3))
    def submit(self, system, cut, suffix, max_tokens, temperature, seed):
        rec = Record()
        prompt = self.systems[system][:cut] + suffix or [seed]
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
        try:
            self.requests.append((rec, self.engine.submit(prompt, params, rec), max_tokens))
        except EngineDead:
            assert not self.alive

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
        if not self.engine.in_flight() and self.alive:
            pool = self.engine.pool
            assert len(pool.free_ids) + pool.num_cached == pool.num_blocks
            assert not any(pool.ref_counts)


PrefixMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestPrefixMachine = PrefixMachine.TestCase


# ---- a recurrent family -------------------------------------------------------------------------


class RecurrentMachine(LoopMachine):
    """The loop machine on a recurrent-state model: no KV pool, one state slot per row."""

    @initialize()
    def start(self):
        from poot.engine import Engine
        from poot.engine.drivers.cpu import CpuDriver
        from poot.engine.models.synthetic import synthetic_mamba

        self.engine = Engine.create(synthetic_mamba(0), driver=CpuDriver(memory_bytes=1 << 30))
        self.setup()


RecurrentMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("POOT_STATE_EXAMPLES_RECURRENT", "60")), stateful_step_count=12, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestRecurrentMachine = RecurrentMachine.TestCase


def two_rows_taken(engine_class) -> LoopMachine:
    """A machine on two rows, both taken, and a third request waiting."""
    model = synthetic_llama(0)
    plan = Plan("numpy", 2, 256, 16, 32, 64, model.name)
    driver = CpuDriver()
    driver.prepare(plan, model)
    machine = LoopMachine()
    machine.engine = engine_class(model, driver, plan, None)
    machine.setup()
    for i in range(3):
        machine.submit(prompt_len=20 + i, max_tokens=40, temperature=0.0, seed=i)
    machine.step(2)
    return machine


def test_a_preempted_request_breaks_the_invariant():
    """What nothing_running_is_preempted looks for, made to happen: a request kept waiting
    that an engine hands the youngest running one's row."""
    machine = two_rows_taken(PreemptYoungest)
    machine.nothing_running_is_preempted()
    with pytest.raises(AssertionError, match="failed outside a refused step"):
        for _ in range(20):
            machine.step(1)
            machine.nothing_running_is_preempted()


def test_a_refused_step_that_fails_the_waiting_breaks_the_invariant():
    machine = two_rows_taken(RefuseFailsWaiting)
    machine.refuse()
    with pytest.raises(AssertionError, match="failed"):
        machine.refused_steps_fail_only_their_own()
