"""The engine: one scheduling loop on one thread, for every request, backend and family.

Each iteration runs five phases, in this order:
  1. take the jobs the server queued, and tokenize them;
  2. release every request whose owner stopped waiting;
  3. open waiting requests, oldest first, while a row and KV room remain;
  4. step the rows that have work, within the per-step token budget;
  5. commit the tokens each row picked, apply the stop rules, and stream what was kept.
"""

from __future__ import annotations

import copy
import itertools
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from . import choices, logits_processors, logprobs
from .blocks import BlockPool
from .events import Accepted, Event, Finished, PromptLogprobs, Rejected, RequestHandle, Tokens
from .params import InvalidRequest, SamplingParams
from .picker import Picked, Picker
from .plan import Plan, fit_plan
from .prefix_cache import PrefixCache
from .progress import Progress
from .random_stream import RandomStream, random_stream
from .row_changes import RowChanges
from .scheduler import Scheduled, Scheduler
from .sequence import Sequence
from .speculative import make_draft_policy
from .step import DeviceFault, RowWork, StepOutput, StepPlan, StepRefused
from .step_times import StepTimes, kind_of
from .step_tokens import StepTokens
from .stops import StopChecker

log = logging.getLogger("poot.engine")

IDLE_WAIT_S = 0.05


class EngineDead(RuntimeError):
    """The engine stopped serving: a device fault, a crash of its thread, or a shutdown."""


@dataclass(slots=True, frozen=True)
class Health:
    status: str  # ok | dead
    cause: str | None = None  # fault | panicked | stopped
    reason: str | None = None


@dataclass(slots=True)
class _Kept:
    """What a row's commit keeps: its tokens, their released text and (where asked) their
    logprobs, and the stop rule that ends the request, if one did."""

    tokens: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    scores: list = field(default_factory=list)
    reason: str | None = None


@dataclass(slots=True)
class _Job:
    handle: RequestHandle
    prompt: str | list[int]
    params: SamplingParams
    more: tuple[RequestHandle, ...] = ()  # the handles of choices 1.. of a request with n > 1
    grammars: tuple = ()  # grammar.Matcher per choice, where the output must match a grammar


class Engine:
    def __init__(self, model, driver, plan: Plan, draft_policy=None, *,
                 scheduler: type[Scheduler] = Scheduler, prefix_cache: type[PrefixCache] = PrefixCache,
                 stop_checker: type[StopChecker] = StopChecker,
                 random_stream: Callable[[int | None, int], RandomStream] = random_stream):
        """`driver` must be prepared for `plan`; `Engine.create` does both. The scheduler, the
        prefix cache, the stop checker and each request's random stream (from its seed) are
        the engine's parts, passed as the classes or function that build them (the random
        stream from the request's seed and the choice's index)."""
        self.model = model
        self.driver = driver
        self.plan = plan
        self.pool = BlockPool(plan.num_blocks)
        # Every family gets a prefix cache; a recurrent one registers nothing, and says so.
        self.prefix_cache = prefix_cache(self.pool, plan, model.name)
        self.scheduler = scheduler(plan, self.pool, self.prefix_cache, draft_policy=draft_policy)
        self.stop_checker = stop_checker
        self.random_stream = random_stream
        self.picker = Picker(model.tokenizer.eos_token_ids)
        self.row_changes = RowChanges()  # rows taken and left that the next step plan tells the driver
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._ids = itertools.count(1)
        self._in_flight: dict[int, Sequence | _Job] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self._panic_armed = False
        self._health = Health("ok")
        self.counters: Counter[str] = Counter()
        self.step_tokens = StepTokens(plan)
        self.step_times = StepTimes()
        self._device_s = 0.0  # the driver's share of the current iteration
        self.finished_by_reason: Counter[str] = Counter(dict.fromkeys(("stop", "length", "cancelled", "error"), 0))
        # Events wait here until the iteration that made them has published its metrics, so a
        # client that saw its request end never scrapes a snapshot from before that end.
        self._outbox: list[tuple[RequestHandle, Event]] = []
        self._published = self._snapshot()

    @classmethod
    def create(cls, model, backend: str = "auto", draft: str | None = None, driver=None,
               progress: Progress | None = None, **parts) -> Engine:
        """Fits the plan to the driver's device and prepares the driver; `parts` go to __init__.
        `progress` hears what it is doing (engine/progress.py); the driver reports there too."""
        from .drivers import make_driver

        driver = driver or make_driver(backend)
        if progress is not None:
            driver.progress = progress
        progress = driver.progress
        progress.report("model", f"fitting the plan to the {driver.backend} device")
        plan = fit_plan(driver.device(), model.config, driver.weight_bytes(model), model.name,
                        kv_bytes_per_token=driver.kv_bytes_per_token(model.config))
        progress.report("compile", f"preparing the {driver.backend} driver")
        driver.prepare(plan, model)
        if products := driver.product_choice():  # measured while preparing: published with the plan
            chosen, measured_at = driver.product_choice_origin()
            # The engine publishes it beside the plan; the driver's plan stays the one it was given.
            plan = replace(plan, products=products, products_chosen=chosen, products_measured_at=measured_at)
        driver.warm_up()
        draft_policy = None
        if draft and draft != "none":
            if getattr(model.config, "recurrent", False):
                # A rejected draft would already be folded into the row's recurrent state.
                raise ValueError(f"speculative decoding needs a per-token KV cache; {model.name} keeps recurrent state")
            draft_policy = make_draft_policy(draft)
        return cls(model, driver, plan, draft_policy, **parts)

    @property
    def draft_policy(self):
        return self.scheduler.draft_policy

    # ---- the owner's side (any thread) -------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="poot-engine", daemon=True)
        self._thread.start()

    def submit(self, prompt: str | list[int], params: SamplingParams,
               sink: Callable[[Event], None], grammar=None) -> RequestHandle:
        """A request of one choice; `grammar`: its grammar.Matcher, where its output must match one."""
        return self.submit_choices(prompt, params, [sink], None if grammar is None else [grammar])[0]

    def submit_choices(self, prompt: str | list[int], params: SamplingParams,
                       sinks: list[Callable[[Event], None]], grammars: list | None = None) -> list[RequestHandle]:
        """One request with len(sinks) choices: one handle and event stream per choice, all
        admitted together, the prompt prefilled once (engine/choices.py). `grammars`: a fresh
        grammar.Matcher per choice, made by the caller (making one compiles, which the loop
        must not wait for), or None."""
        params.validate()
        if grammars is not None and len(grammars) != len(sinks):
            raise ValueError("one grammar matcher per choice")
        handles = [RequestHandle(next(self._ids), sink) for sink in sinks]
        job = _Job(handles[0], prompt, params, tuple(handles[1:]), tuple(grammars or ()))
        with self._lock:
            if self._health.status != "ok":
                raise EngineDead(self._health.reason or "the engine is not serving")
            for h in handles:  # one entry per choice, so a death fails each of them
                self._in_flight[h.request_id] = _Job(h, prompt, params)
        self._jobs.put(job)
        self._wake.set()
        return handles

    def health(self) -> Health:
        return self._health

    def in_flight(self) -> int:
        return len(self._in_flight)

    def inject_fault(self, kind: str) -> None:
        if kind == "panic":
            self._panic_armed = True
        else:
            self.driver.arm_failure(kind)

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def metrics(self) -> dict:
        """What /metrics reports: the snapshot the engine thread published at the end of its
        last iteration, so one scrape never mixes two steps or reads a list mid-change. A copy:
        the caller may change it."""
        return copy.deepcopy(self._published)

    def _snapshot(self) -> dict:
        """The engine's numbers as one consistent whole; built on the engine thread only."""
        s = self.scheduler
        cache = self.prefix_cache
        m = {
            "engine_compiles": self.driver.compiles,
            "engine_steps": self.counters["steps"],
            "engine_requests_waiting": len(s.waiting) + self._jobs.qsize(),
            "engine_requests_running": len(s.running),
            "engine_rows": self.plan.rows,
            "kv_blocks_total": self.plan.num_blocks,
            "kv_blocks_reserved": s.num_reserved_blocks,
            "kv_blocks_in_use": len({b for q in s.running for b in q.block_table[: self.plan.blocks_for(q.num_computed)]}),
            "kv_blocks_cached": cache.num_cached_free(),
            "kv_blocks_free": len(self.pool.free_ids),
            "requests_finished": dict(self.finished_by_reason),
            "prompt_tokens": self.counters["prompt_tokens"],
            "generation_tokens": self.counters["generation_tokens"],
            "prefix_registered_tokens": self.counters["prefix_registered_tokens"],
            "prefix_skipped_releases": self.counters["prefix_skipped_releases"],
            "prefix_cache_hit_rate": (self.counters["prefix_hit_tokens"] / self.counters["prefix_queried_tokens"]
                                      if self.counters["prefix_queried_tokens"] else 0.0),
            "prefix_cache_queried_tokens": self.counters["prefix_queried_tokens"],
            "prefix_cache_hit_tokens": self.counters["prefix_hit_tokens"],
            "spec_drafted_tokens": self.counters["spec_drafted"],
            "spec_accepted_tokens": self.counters["spec_accepted"],
            "spec_rounds": self.counters["spec_rounds"],
            "engine_step_tokens": self.step_tokens.snapshot(),
            "engine_step_seconds": self.step_times.snapshot(),
        }
        return m

    def _publish(self) -> None:
        """Ends an iteration: its snapshot first, then the events it made."""
        self._published = self._snapshot()
        outbox, self._outbox = self._outbox, []
        for handle, event in outbox:
            self._deliver(handle, event)

    # ---- the loop (engine thread) ------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                if not self.scheduler.running and not self.scheduler.waiting:
                    self._wait_for_job()
                self.iteration()
        except DeviceFault as e:
            self.die("fault", str(e))
        except Exception as e:  # a crash of the loop itself: nothing it holds can be trusted
            log.exception("engine thread panicked")
            self.die("panicked", f"{type(e).__name__}: {e}")
        else:
            self.die("stopped", "the engine was stopped")

    def iteration(self) -> None:
        if self._panic_armed:
            self._panic_armed = False
            raise RuntimeError("injected: engine thread panic")
        began = time.perf_counter()
        self._take_jobs()
        self.release_cancelled()
        self.open_waiting()
        scheduled, out = self._step()
        self._commit(scheduled, out)
        if scheduled:
            took = time.perf_counter() - began
            kind = kind_of(decoding=any(s.work.start >= len(s.seq.prompt) for s in scheduled),
                           prefilling=any(s.work.start < len(s.seq.prompt) for s in scheduled))
            self.step_times.observe(kind, took, took - self._device_s)
        self._publish()

    def _wait_for_job(self) -> None:
        # Sleep until a job is queued (or a moment passes); phase 1 then takes every queued job
        # in submission order. Clearing after the wait is safe: a job queued meanwhile is
        # still in the queue for this iteration.
        self._wake.wait(IDLE_WAIT_S)
        self._wake.clear()

    # phase 1
    def _take_jobs(self) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            try:
                prompt = self._tokenize(job.prompt)
                self.check_fits(prompt, job.params, 1 + len(job.more))
            except InvalidRequest as e:
                for handle in (job.handle, *job.more):
                    self._reject(_Job(handle, job.prompt, job.params), str(e), e.param)
                continue
            except Exception as e:  # a tokenizer that chokes on one prompt must not stop the loop
                log.exception("request %s: tokenizing failed", job.handle.request_id)
                for handle in (job.handle, *job.more):
                    self._reject(_Job(handle, job.prompt, job.params),
                                 f"the prompt could not be tokenized: {type(e).__name__}", "prompt")
                continue
            decode = self.model.tokenizer.decode
            seqs = []
            for i, handle in enumerate((job.handle, *job.more)):
                # Choice 0 samples as the same request with n = 1 would; choice i draws from
                # the same seed's stream i (a request without a seed gets a random one).
                seqs.append(Sequence(handle, prompt, job.params, self.stop_checker(decode, job.params.stop),
                                     self.random_stream(job.params.seed, i),
                                     grammar=job.grammars[i] if job.grammars else None))
            if job.more:
                shared = choices.num_shared_blocks(len(prompt), self.plan.block_size, recurrent=self.plan.num_blocks == 0,
                                                   scores_prompt=job.params.prompt_logprobs is not None)
                group = choices.ChoiceGroup(seqs, shared)
                for seq in seqs:
                    seq.group = group
            for seq in seqs:
                with self._lock:
                    self._in_flight[seq.request_id] = seq
                self.counters["prompt_tokens"] += len(prompt)
                self.scheduler.add(seq)
                self._emit(seq.handle, Accepted(len(prompt)))

    def _reject(self, job: _Job, message: str, param: str | None) -> None:
        self._forget(job.handle.request_id)
        self._emit(job.handle, Rejected(message, param))

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("the prompt is empty", "prompt")
            return self.model.encode_prompt(prompt)
        vocab = self.model.tokenizer.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt):
            raise InvalidRequest(f"prompt token ids must be integers in [0, {vocab})", "prompt")
        return list(prompt)

    def check_fits(self, prompt: list[int], params: SamplingParams, n: int = 1) -> None:
        if not prompt:
            raise InvalidRequest("the prompt is empty", "prompt")
        logits_processors.check_vocab(params, self.model.tokenizer.vocab_size)
        if n > 1:
            choices.check_fit(self.plan, len(prompt), params, n)
        need = len(prompt) + params.max_tokens
        if need > self.plan.positions:
            raise InvalidRequest(
                f"the prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) needs {need} "
                f"positions; this server holds at most {self.plan.positions} per sequence", "max_tokens")

    # phase 2
    def release_cancelled(self) -> None:
        s = self.scheduler
        gone = [q for q in (*s.waiting, *s.running) if q.handle.cancelled.is_set()]
        for seq in gone:
            self._finish(seq, "cancelled")

    # phase 3
    def open_waiting(self) -> None:
        now = time.perf_counter()
        for seq in self.scheduler.open_waiting():
            seq.opened_at = now
            seq.num_cached = seq.num_computed  # a prefix-cache hit starts past its cached blocks
            self.row_changes.open(seq.row, seq.block_table)  # fixed until the row closes
            self.counters["prefix_queried_tokens"] += len(seq.prompt)
            self.counters["prefix_hit_tokens"] += seq.num_cached

    # phase 4
    def _step(self) -> tuple[list[Scheduled], StepOutput | None]:
        scheduled = self.scheduler.schedule()
        if not scheduled:
            if self.row_changes:  # rows left with nothing to step: the driver hears of it now
                self.driver.step(StepPlan((), *self.row_changes.pending()))
                self.row_changes.delivered()
            return [], None
        # Rows that need nothing but the sampler may be picked by the driver.
        rows = tuple(self._marked(s) for s in scheduled)
        began = time.perf_counter()
        try:
            out = self.driver.step(StepPlan(rows, *self.row_changes.pending()))
        except StepRefused as e:
            self.on_step_refused(scheduled, e)  # the plan's opens and closes are told again next time
            return [], None
        self.row_changes.delivered()
        self._device_s = time.perf_counter() - began
        self.counters["steps"] += 1
        self.step_tokens.observe(sum(len(s.work.tokens) for s in scheduled),
                                 decoding=any(not s.seq.prefilling for s in scheduled))
        return scheduled, out

    def _marked(self, s: Scheduled) -> RowWork:
        """The row's work, with how the driver may pick its tokens (None: the host needs its logits)."""
        w = s.work
        if not w.num_logits:
            return w
        return RowWork(w.row, w.tokens, w.start, w.block_table, w.num_logits, self.picker.device_pick(s.seq))

    def on_step_refused(self, scheduled: list[Scheduled], e: StepRefused) -> None:
        """Nothing ran: only this step's requests fail, their rows and blocks go back."""
        for s in scheduled:
            self._finish(s.seq, "error", f"the driver refused the step: {e}")

    # phase 5
    def _commit(self, scheduled: list[Scheduled], out: StepOutput | None) -> None:
        if out is None:
            return  # nothing stepped
        logit = host = 0  # the row's first logit index, and its first row of host logits
        for s, picked in zip(scheduled, out.picked, strict=True):
            seq, work, n = s.seq, s.work, s.work.num_logits
            if picked:  # the driver picked the row's tokens: their ids, not their logits
                rows = out.token_ids[logit : logit + n]
            else:
                rows = out.logits[host : host + n]
                host += n
            logit += n
            prefilling = seq.prefilling  # as the step found it
            if prefilling and seq.params.prompt_logprobs is not None:
                rows = self._score_prompt(seq, work, rows)
            # Nothing to pick: a prefill chunk short of the prompt's end, or an echo of the
            # prompt alone (max_tokens 0).
            kept = self._keep(seq, rows, s.drafts, picked) if len(rows) else None
            # The one place a sequence's computed count moves, before its release can read it
            # (to register the prompt's filled blocks): a prefill chunk's KV is all written; a
            # decoding row's holds the fed token and each accepted draft, one per kept token
            # (a rejected draft's KV is rolled back by never being counted).
            seq.num_computed += len(work.tokens) if prefilling else len(kept.tokens)
            if kept is not None:
                self._stream(seq, kept, s.drafts)
            elif seq.params.max_tokens == 0 and not seq.prefilling:
                self._finish(seq, "length")  # the prompt is scored, and nothing is wanted after it

    def _score_prompt(self, seq: Sequence, work: RowWork, rows: np.ndarray) -> np.ndarray:
        """Echo: scores the chunk's prompt tokens; returns the rows left to pick from (the
        last, once the prompt is done and outputs are wanted)."""
        seq.prompt_scores.extend(logprobs.score_prompt(rows, seq.prompt, work.start, seq.params.prompt_logprobs))
        if work.start + len(work.tokens) < len(seq.prompt):
            return rows[:0]
        scores = seq.prompt_scores
        self._emit(seq.handle, PromptLogprobs(tuple(seq.prompt), (None, *(t.logprob for t in scores)),
                                              ((), *(t.top for t in scores))))
        return rows[-1:] if seq.params.max_tokens else rows[:0]

    def _keep(self, seq: Sequence, rows: np.ndarray, drafts: list[int], picked: bool) -> _Kept:
        """Keeps tokens up to EOS, a stop string or max_tokens; with drafts, the accepted
        ones and one more from the target. `rows`: the positions' logits, or (`picked`) the
        tokens the driver picked at them."""
        if not seq.output:
            seq.first_token_at = time.perf_counter()
        kept = _Kept()
        for i in range(len(rows)):
            pick = Picked(int(rows[i])) if picked else self.picker.pick(rows[i], seq)
            token = pick.token
            if pick.logprob is not None:
                kept.scores.append(pick.logprob)
            kept.tokens.append(token)
            seq.output.append(token)
            if seq.grammar is not None:
                seq.grammar.consume(token)
            released, stopped = seq.stops.add(token)
            kept.text.append(released)
            if stopped:
                kept.reason = "stop"
            elif self.ends_on_eos(seq, token) or (seq.grammar is not None and seq.grammar.done):
                kept.reason = "stop"
            elif self.reached_max_tokens(seq):
                kept.reason = "length"
            # A draft is accepted when the target's token at its position equals it; the
            # loop stops at the first one that does not, or at a stop rule.
            if kept.reason or i >= len(drafts) or not self.accepts_draft(drafts[i], token):
                break
        return kept

    def _stream(self, seq: Sequence, kept: _Kept, drafts: list[int]) -> None:
        """Counts and streams what a row kept, and ends the request if a stop rule did."""
        self.counters["spec_drafted"] += len(drafts)
        self.counters["spec_accepted"] += sum(1 for d, t in zip(drafts, kept.tokens, strict=False) if d == t)
        self.counters["spec_rounds"] += 1 if drafts else 0
        self.counters["generation_tokens"] += len(kept.tokens)
        self._emit(seq.handle, Tokens(tuple(kept.tokens), "".join(kept.text), tuple(t.logprob for t in kept.scores),
                                      tuple(t.top for t in kept.scores)))
        if kept.reason:
            self._finish(seq, kept.reason)

    def ends_on_eos(self, seq: Sequence, token: int) -> bool:
        if token in seq.params.stop_token_ids:
            return True
        return token in self.model.tokenizer.eos_token_ids and not seq.params.ignore_eos

    def reached_max_tokens(self, seq: Sequence) -> bool:
        return len(seq.output) >= seq.params.max_tokens

    def accepts_draft(self, draft: int, token: int) -> bool:
        """A draft is accepted when the target's token at its position equals it."""
        return token == draft

    # ---- endings ------------------------------------------------------------------------

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        # A request that ended normally releases what it held back; a stop string was cut already.
        tail = seq.stops.flush() if reason in ("stop", "length") else ""
        if seq.row >= 0:
            self.row_changes.close(seq.row)
        registered = self.scheduler.release(seq)
        if registered is None:  # a recurrent family: its blocks would hold none of its state
            self.counters["prefix_skipped_releases"] += 1
        else:
            self.counters["prefix_registered_tokens"] += registered
        self._forget(seq.request_id)
        self.finished_by_reason[reason] += 1
        queued = seq.opened_at - seq.handle.submitted if seq.opened_at is not None else None
        prefill = seq.first_token_at - seq.opened_at if seq.first_token_at is not None else None
        self._emit(seq.handle, Finished(reason, len(seq.prompt), len(seq.output), seq.num_cached, error, tail,
                                        queued, prefill))

    def _forget(self, request_id: int) -> None:
        with self._lock:
            self._in_flight.pop(request_id, None)

    def die(self, cause: str, reason: str) -> None:
        """Fails every request in flight and stops serving. Blocks are not released: after a
        fault the device state they describe cannot be trusted."""
        with self._lock:
            self._health = Health("dead", cause, reason)
            pending = list(self._in_flight.values())
            self._in_flight.clear()
        for item in pending:
            prompt_tokens = len(item.prompt) if isinstance(item, Sequence) else 0
            completion = len(item.output) if isinstance(item, Sequence) else 0
            self.finished_by_reason["error"] += 1
            self._emit(item.handle, Finished("error", prompt_tokens, completion, 0, f"engine {cause}: {reason}"))
        self._publish()  # what the iteration emitted before it failed, then these ends

    def _emit(self, handle: RequestHandle, event: Event) -> None:
        self._outbox.append((handle, event))  # delivered when the iteration publishes

    def _deliver(self, handle: RequestHandle, event: Event) -> None:
        try:
            handle.sink(event)
        except Exception:  # a broken sink must not take the engine down; its request ends
            log.exception("request %s: sink failed; cancelling", handle.request_id)
            handle.cancel()
