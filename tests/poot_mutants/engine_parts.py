"""Defects of the engine's parts: each class overrides one method of the part it breaks."""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from poot.engine import Engine
from poot.engine.drivers.base import DeviceFault, RowOpen
from poot.engine.drivers.cpu import CpuDriver
from poot.engine.params import InvalidRequest
from poot.engine.prefix_cache import PrefixCache
from poot.engine.random_stream import random_stream
from poot.engine.scheduler import Scheduler
from poot.engine.sequence import Sequence, Status
from poot.engine.stops import StopChecker

# ---- the engine -------------------------------------------------------------------------------


class ClampMaxTokens(Engine):
    """A request that can never fit is cut to fit instead of refused."""

    def submit_choices(self, prompt, params, sinks):
        try:
            n = len(self._tokenize(prompt))
        except InvalidRequest:
            n = 0
        room = max(1, min(params.max_tokens, self.plan.positions - n))
        return super().submit_choices(prompt, dataclasses.replace(params, max_tokens=room), sinks)


class RefuseWhenFull(Engine):
    """A request that finds every row taken is refused instead of queued."""

    def check_fits(self, prompt, params, n=1):
        super().check_fits(prompt, params, n)
        if not self.scheduler.free_rows:
            raise InvalidRequest("no free row now", "max_tokens")


class KeepCancelledWaiting(Engine):
    """Phase 2 looks at running requests only: a queued request whose owner left stays queued."""

    def release_cancelled(self):
        for seq in [q for q in self.scheduler.running if q.handle.cancelled.is_set()]:
            self._finish(seq, "cancelled")


PREEMPT_AFTER = 10  # iterations a request waits for a row before it takes the youngest's


class PreemptYoungest(Engine):
    """A request kept waiting for a row takes the row of the youngest running request."""

    waited = 0

    def open_waiting(self):
        s = self.scheduler
        self.waited = self.waited + 1 if s.waiting and not s.free_rows else 0
        if self.waited > PREEMPT_AFTER and s.running:
            self.waited = 0
            self._finish(max(s.running, key=lambda q: q.arrival), "error", "preempted for a waiting request")
        super().open_waiting()


class RefuseKillsEngine(Engine):
    """A refused step is treated as a fault: the engine dies."""

    def on_step_refused(self, scheduled, e):
        raise DeviceFault(str(e)) from e


class RefuseFailsWaiting(Engine):
    """A refused step also fails every waiting request."""

    def on_step_refused(self, scheduled, e):
        super().on_step_refused(scheduled, e)
        for seq in list(self.scheduler.waiting):
            self._finish(seq, "error", f"the driver refused the step: {e}")


class OffByOneMaxTokens(Engine):
    def reached_max_tokens(self, seq):
        return len(seq.output) > seq.params.max_tokens


class AcceptAllDrafts(Engine):
    def accepts_draft(self, draft, token):
        return True


class ContinueAfterEos(Engine):
    def ends_on_eos(self, seq, token):
        return False


class DieFreesBlocks(Engine):
    """A fault releases every running request's row and blocks, though the device state
    they describe can no longer be trusted."""

    def die(self, cause, reason):
        for seq in list(self.scheduler.running):
            self.scheduler.release(seq)
        super().die(cause, reason)


class CrashAtStart(Engine):
    @classmethod
    def create(cls, *a, **kw):
        raise RuntimeError("this variant cannot start")


class CancelAllOnDrain(Engine):
    """Gives the drain defect a way to cut every request off (see http_parts.CancelOnDrain)."""

    adds = ("cancel_all",)

    def cancel_all(self) -> None:
        with self._lock:
            items = list(self._in_flight.values())
        for item in items:
            item.handle.cancel()


def metrics_defect(name: str, edit):
    """An engine whose metrics() answer is edited by `edit(m)` (a dict, changed in place)."""

    def metrics(self):
        m = Engine.metrics(self)
        edit(m)
        return m

    return type(name, (Engine,), {"metrics": metrics})


def _stop_as_length(m):
    finished = m["requests_finished"]
    finished["length"] = finished.get("length", 0) + finished.pop("stop", 0)


def _swap_spec(m):
    m["spec_drafted_tokens"], m["spec_accepted_tokens"] = m["spec_accepted_tokens"], m["spec_drafted_tokens"]


CountStopAsLength = metrics_defect("CountStopAsLength", _stop_as_length)
RowsGaugeOffByOne = metrics_defect("RowsGaugeOffByOne", lambda m: m.update(engine_rows=m["engine_rows"] + 1))
InUseCountsCached = metrics_defect(
    "InUseCountsCached", lambda m: m.update(kv_blocks_in_use=m["kv_blocks_in_use"] + m["kv_blocks_cached"]))
HitRatePercent = metrics_defect(
    "HitRatePercent", lambda m: m.update(prefix_cache_hit_rate=m["prefix_cache_hit_rate"] * 100))
SpecCountersSwapped = metrics_defect("SpecCountersSwapped", _swap_spec)
NoMetricsSteps = metrics_defect("NoMetricsSteps", lambda m: m.pop("engine_steps"))


def ignore_seed(seed, choice=0):
    """A random stream that ignores the request's seed."""
    return random_stream(None, choice)


# ---- the scheduler ----------------------------------------------------------------------------


class YoungestFirst(Scheduler):
    def next_waiting(self):
        return self.waiting[-1]


class ReservePromptOnly(Scheduler):
    """Opening reserves the prompt's blocks only; decode grows the table as it goes, and a
    row whose table cannot grow is left out of the step."""

    def blocks_needed(self, seq):
        return self.plan.blocks_for(len(seq.prompt) + 1)

    adds = ("grow_table",)

    def decoding_rows(self):
        return [q for q in super().decoding_rows() if self.grow_table(q)]

    def grow_table(self, seq: Sequence) -> bool:
        if seq.num_computed < len(seq.block_table) * self.plan.block_size:
            return True
        if not self.pool.can_allocate(1):
            return False
        seq.block_table.extend(self.pool.allocate(1))
        return True


class FollowsGrownTables(CpuDriver):
    """The device half of reserve_prompt_only: a table that grew after its row opened is told
    to the driver again before the step (the reference never needs this: a table is fixed
    from open to close)."""

    def step(self, plan):
        known = {**self.open_rows, **{o.row: o.block_table for o in plan.opens}}
        grown = tuple(RowOpen(w.row, tuple(w.block_table)) for w in plan.rows
                      if len(w.block_table) != len(known.get(w.row, ())))
        return super().step(dataclasses.replace(plan, opens=plan.opens + grown))  # the later opening wins


class PrefillOnlySteps(Scheduler):
    """A step that prefills leaves the decoding rows out."""

    def schedule(self):
        steps = super().schedule()
        prefill = [s for s in steps if s.seq.prefilling]
        return prefill or steps


class NoPrefillBudget(Scheduler):
    """Beside decoding rows, a waiting prompt is prefilled whole, whatever the budget."""

    def next_prompt_tokens(self, seq, budget, decoding):
        return super().next_prompt_tokens(seq, len(seq.prompt) if decoding else budget, decoding)


class NoIdlePrefillBudget(Scheduler):
    """With no row decoding, a waiting prompt is prefilled whole, whatever the idle budget."""

    def next_prompt_tokens(self, seq, budget, decoding):
        return super().next_prompt_tokens(seq, budget if decoding else len(seq.prompt), decoding)


class PrefixHitRefeedsPrompt(Scheduler):
    """After a prefix-cache hit the prompt is fed again from its start, at the positions
    after the cached blocks."""

    def next_prompt_tokens(self, seq, budget, decoding):
        if not seq.num_cached:
            return super().next_prompt_tokens(seq, budget, decoding)
        start = seq.num_computed - seq.num_cached
        return seq.prompt[start : start + min(budget, len(seq.prompt) - seq.num_computed)]


class OneRowPerStep(Scheduler):
    def decoding_rows(self):
        return super().decoding_rows()[:1]


class StopKeepsRow(Scheduler):
    """A request ended by a stop string keeps its row and blocks."""

    def release(self, seq):
        if seq.status is Status.RUNNING and seq.stops.text != seq.stops.decode(seq.stops.ids):
            seq.status = Status.FINISHED  # ended by a stop string: left holding its row
            return 0
        return super().release(seq)

    def decoding_rows(self):
        return [q for q in super().decoding_rows() if q.status is Status.RUNNING]


# ---- the prefix cache -------------------------------------------------------------------------


class NoPrefixReuse(PrefixCache):
    def match(self, prompt):
        return []


class NoPrefixRegistration(PrefixCache):
    def register_prefix(self, prompt, blocks):
        return 0


class NoCancelPrefix(PrefixCache):
    def release(self, seq):
        if self.recurrent or not seq.handle.cancelled.is_set():
            return super().release(seq)
        self.pool.free(reversed(seq.block_table))
        return 0


class LeakBlockOnCancel(PrefixCache):
    """A cancelled request keeps its last block for good."""

    def release(self, seq):
        if seq.handle.cancelled.is_set() and seq.block_table:
            seq.block_table = seq.block_table[:-1]
        return super().release(seq)


class RegisterRecurrentPrefix(PrefixCache):
    def release(self, seq):
        if self.recurrent:
            return min(seq.num_computed, len(seq.prompt)) // self.block_size * self.block_size
        return super().release(seq)


# ---- the stop checker -------------------------------------------------------------------------


class KeepStopString(StopChecker):
    """A request ended by a stop string still outputs the stop string."""

    cut = ""

    def add(self, token_id):
        released, stopped = super().add(token_id)
        if stopped:
            self.cut = self.decode(self.ids)[len(self.text):]
        return released, stopped

    def flush(self):
        return super().flush() + self.cut


class ReleaseStopPrefix(StopChecker):
    """Text that could still become a stop string is released at once."""

    def held_back(self):
        return len(self.text) - len(self.text.rstrip("\ufffd"))


# ---- the driver -------------------------------------------------------------------------------


class RecompileOnBatchChange(CpuDriver):
    last_rows = None

    def run_step(self, step, batch):
        if step.num_rows != self.last_rows:
            self._built()
        self.last_rows = step.num_rows
        return super().run_step(step, batch)


class SharedPosition(CpuDriver):
    """Every token of a step gets one shared position."""

    def layout(self, step):
        layout = super().layout(step)
        layout.positions = np.full_like(layout.positions, layout.positions.max())
        return layout


class NoLengthMask(CpuDriver):
    """Decode attention reads every gathered slot of its row's table, written or not."""

    def layout(self, step):
        layout = super().layout(step)
        layout.paged_lengths = np.full_like(layout.paged_lengths, layout.paged_tables.shape[1] * layout.block_size)
        return layout


class StaleRecurrentState(CpuDriver):
    """A row opened by a new sequence keeps the state its last sequence left."""

    def start_fresh_row(self, row):
        pass


class LaxStepCheck(CpuDriver):
    """Runs steps larger than the plan's budget instead of refusing them (the budget
    defects' steps would be refused otherwise, which hides them)."""

    def check_plan(self, plan):
        pass


class RowsFromEnv(CpuDriver):
    """The POOT_ROWS environment variable sets the rows the device reports, so the plan follows."""

    def device(self):
        info = super().device()
        rows = os.environ.get("POOT_ROWS", "")
        return dataclasses.replace(info, parallel_rows=int(rows)) if rows.isdigit() else info


ROWS_BEYOND_48 = 200


class TwoHundredRows(CpuDriver):
    """A device that steps 200 rows at little more than the cost of one, so the plan fits 200
    (not a defect: a server with more rows than the suite opened at first, to measure them)."""

    def device(self):
        return dataclasses.replace(super().device(), parallel_rows=ROWS_BEYOND_48)


class BatchDependentPrecision(CpuDriver):
    """Steps of more than one row keep 3 bits of their logits' mantissa (an 8-bit float's
    precision), as a kernel picked by batch size with a low-precision reduction would: near
    ties then break differently, so a prompt's greedy output depends on what it was batched
    with. (bfloat16's 8 bits flip too few of the tiny model's choices to be seen reliably.)"""

    def run_step(self, step, batch):
        out = super().run_step(step, batch)
        if step.num_rows > 1:
            bits = out.logits.view(np.uint32)
            bits &= np.uint32(0xFFF00000)
        return out
