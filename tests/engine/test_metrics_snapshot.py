"""What `engine.metrics()` (and so /metrics) reports is one snapshot the engine thread built at
the end of an iteration: a scrape taken at any moment, from any thread, satisfies every
invariant a step ends with, and a client that saw its request end finds that end counted."""

from __future__ import annotations

import threading
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poot.engine import Engine
from poot.engine.events import Finished
from poot.engine.prefix_cache import PrefixCache

from .harness import Record, greedy, make_engine, run_until_idle
from .test_prefix_cache import planned_engine, tokens


def step_end_invariants(m: dict, submitted: int | None = None) -> list[str]:
    """What holds between two iterations; returns what did not."""
    broken = []
    blocks = m["kv_blocks_reserved"] + m["kv_blocks_cached"] + m["kv_blocks_free"]
    if blocks != m["kv_blocks_total"]:
        broken.append(f"reserved {m['kv_blocks_reserved']} + cached {m['kv_blocks_cached']} + free "
                      f"{m['kv_blocks_free']} = {blocks} blocks, of {m['kv_blocks_total']}")
    if m["kv_blocks_in_use"] > m["kv_blocks_reserved"]:
        broken.append(f"{m['kv_blocks_in_use']} blocks in use, more than the {m['kv_blocks_reserved']} reserved")
    if m["engine_requests_running"] > m["engine_rows"]:
        broken.append(f"{m['engine_requests_running']} running on {m['engine_rows']} rows")
    negative = [k for k, v in m.items() if isinstance(v, int | float) and v < 0]
    negative += [f"requests_finished{{{k}}}" for k, v in m["requests_finished"].items() if v < 0]
    if negative:
        broken.append(f"negative: {negative}")
    if submitted is not None:
        ended = sum(m["requests_finished"].values())
        seen = m["engine_requests_waiting"] + m["engine_requests_running"] + ended
        if seen != submitted:
            broken.append(f"waiting {m['engine_requests_waiting']} + running {m['engine_requests_running']} + "
                          f"finished {ended} = {seen} requests, of {submitted} submitted")
    return broken


class LiveRead(Engine):
    """Test-only: metrics() walks the live state, as an unlocked read from another thread would."""

    def metrics(self):
        return self._snapshot()


class EmitsBeforePublish(Engine):
    """Test-only: events reach their sinks mid-iteration, before the snapshot that counts them."""

    def _emit(self, handle, event):
        self._deliver(handle, event)


def scraping_cache(seen: list[dict]):
    """A prefix cache that scrapes the engine's metrics in the middle of every release: after
    the scheduler dropped the request from its running list, before its blocks go back."""

    class ScrapingCache(PrefixCache):
        engine: Engine | None = None

        def release(self, seq):
            if self.engine is not None:
                seen.append(self.engine.metrics())
            return super().release(seq)

    return ScrapingCache


# (prompt length, max_tokens, prefix salt, cancelled before that iteration or never): no
# request can end in the first iteration, which the scrapes below skip.
workloads = st.lists(st.tuples(st.integers(1, 40), st.integers(2, 24), st.integers(0, 3),
                               st.one_of(st.none(), st.integers(1, 6))), min_size=1, max_size=8)


def run_workload(engine: Engine, workload, after_first=lambda: None) -> list:
    """Submits every request at once and runs until idle; `after_first` is called after the
    first iteration, the first whose snapshot has seen every submission."""
    handles = []
    for length, max_tokens, salt, _ in workload:
        rec = Record()
        handles.append((rec, engine.submit(tokens(length, salt), greedy(max_tokens, ignore_eos=True), rec)))
    for i in range(10_000):
        if not engine.in_flight():
            break
        for (_, handle), (*_, cancel_at) in zip(handles, workload, strict=True):
            if cancel_at == i:
                handle.cancel()
        engine.iteration()
        if i == 0:
            after_first()
    assert not engine.in_flight()
    return handles


def scrapes_mid_release(engine_class, workload) -> list[str]:
    seen: list[dict] = []
    engine = planned_engine(num_blocks=12, rows=3, token_budget=24, engine_class=engine_class,
                            prefix_cache=scraping_cache(seen))
    run_workload(engine, workload, after_first=lambda: setattr(engine.prefix_cache, "engine", engine))
    assert seen, "no release was scraped"
    return [b for m in seen for b in step_end_invariants(m, submitted=len(workload))]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads)
def test_a_scrape_mid_step_sees_the_last_step_end(workload):
    assert scrapes_mid_release(Engine, workload) == []


def test_a_live_read_mid_step_breaks_the_invariants():
    """The same scrapes against the state as it changes: a release caught halfway has left
    the running list but not yet given its blocks back, nor been counted as finished."""
    broken = scrapes_mid_release(LiveRead, [(20, 8, 0, None), (20, 8, 1, 2)])
    assert any("blocks, of" in b for b in broken), broken
    assert any("submitted" in b for b in broken), broken


def ends_counted_when_seen(engine_class, workload) -> list[str]:
    """Each sink scrapes when its request ends: the end it holds must be in the count."""
    engine = planned_engine(num_blocks=12, rows=3, token_budget=24, engine_class=engine_class)
    ends_seen, broken = [0], []

    def on_end(rec):
        def sink(event):
            rec(event)
            if isinstance(event, Finished):
                ends_seen[0] += 1
                counted = sum(engine.metrics()["requests_finished"].values())
                if counted < ends_seen[0]:
                    broken.append(f"{ends_seen[0]} ends seen, {counted} counted")
        return sink

    handles = []
    for length, max_tokens, salt, cancel_at in workload:
        rec = Record()
        handles.append((cancel_at, engine.submit(tokens(length, salt), greedy(max_tokens, ignore_eos=True), on_end(rec))))
    for i in range(10_000):
        if not engine.in_flight():
            break
        for cancel_at, handle in handles:
            if cancel_at == i:
                handle.cancel()
        engine.iteration()
    assert ends_seen[0] == len(workload)
    return broken


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads)
def test_a_client_that_saw_its_end_finds_it_counted(workload):
    assert ends_counted_when_seen(Engine, workload) == []


def test_events_before_the_snapshot_are_caught():
    assert ends_counted_when_seen(EmitsBeforePublish, [(8, 4, 0, None), (8, 6, 1, None)])


def test_scrapes_from_another_thread_while_requests_come_and_go():
    """The server's way: the engine on its own thread, scrapes from another, clients coming,
    hanging up and ending meanwhile."""
    engine = make_engine(seed=3, memory_bytes=4 << 20)
    engine.start()
    stop, scrapes, broken = threading.Event(), [0], []

    def scrape():
        while not stop.is_set():
            broken.extend(step_end_invariants(engine.metrics()))
            scrapes[0] += 1

    scraper = threading.Thread(target=scrape)
    scraper.start()
    try:
        recs = []
        for i in range(48):
            rec = Record()
            handle = engine.submit(tokens(8 + i % 37, i % 4), greedy(4 + i % 29, ignore_eos=True), rec)
            recs.append(rec)
            if i % 5 == 0:
                time.sleep(0.002)
                handle.cancel()
        deadline = time.monotonic() + 120
        while engine.in_flight() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not engine.in_flight(), "the engine did not finish its requests"
    finally:
        stop.set()
        scraper.join()
        engine.stop()
    assert broken == []
    assert scrapes[0] > 50, f"only {scrapes[0]} scrapes"
    assert all(r.finished is not None for r in recs)


def test_an_idle_engine_publishes_once_at_start():
    engine = make_engine()
    m = engine.metrics()
    assert m["engine_requests_running"] == 0 and m["kv_blocks_free"] == m["kv_blocks_total"]
    m["engine_rows"] = -1  # a copy: the caller's edits never reach the next scrape
    assert engine.metrics()["engine_rows"] > 0
    run_until_idle(engine)


def test_a_finished_workload_leaves_every_block_free_or_cached():
    engine = planned_engine(num_blocks=12, rows=3, token_budget=24)
    run_workload(engine, [(20, 8, 0, None), (30, 5, 1, 1), (12, 3, 0, None)])
    m = engine.metrics()
    assert m["kv_blocks_reserved"] == 0 and m["kv_blocks_free"] + m["kv_blocks_cached"] == m["kv_blocks_total"]
