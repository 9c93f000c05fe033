"""The serving benchmark's closed loop: C workers each sending the next request as soon as the
last ended, one level at a time, and the figures of a level from its requests' records (see
poot.loadtests.serving for the workload)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx

from poot.conformance.client import auth_headers
from poot.loadtests import stats
from poot.loadtests.client import stream_into
from poot.loadtests.sse import StreamRecorder

GAP_RATIO_TARGET = 3.0  # at 32 streams, the largest gap at most 3x the median


@dataclass(frozen=True)
class Goodput:
    """What a request must meet to count toward goodput (DistServe's word, vLLM's
    benchmark_serving --goodput): its time to first token at most `ttft_s`, and its mean gap
    between tokens after the first (its decode time over its gaps) at most `itl_s`."""

    ttft_s: float = 5.0
    itl_s: float = 0.2

    @classmethod
    def parse(cls, text: str) -> Goodput:
        """'ttft=MS,itl=MS' (either may be left out: its default stays)."""
        given: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, sep, value = part.partition("=")
            if not sep or name not in ("ttft", "itl"):
                raise ValueError(f"--goodput: {part!r}: give ttft=MS and/or itl=MS, e.g. ttft=5000,itl=200")
            try:
                ms = float(value)
            except ValueError:
                raise ValueError(f"--goodput: {name}={value!r} is not a number of milliseconds") from None
            if not ms > 0:
                raise ValueError(f"--goodput: {name} must be above 0 ms")
            given[f"{name}_s"] = ms / 1e3
        return cls(**given)

    def met_by(self, r: dict) -> bool:
        chunks = r.get("chunks") or []
        if r["status"] != "ok" or not chunks or chunks[0] > self.ttft_s:
            return False
        return len(chunks) < 2 or (chunks[-1] - chunks[0]) / (len(chunks) - 1) <= self.itl_s


@dataclass(frozen=True)
class LevelPlan:
    concurrency: int
    warmup: int
    requests: int | None = None
    seconds: float | None = None
    max_tokens: int = 128
    request_timeout: float = 600.0


@dataclass
class _Loop:
    """The closed loop's bookkeeping for one level (one asyncio loop, no locks)."""

    plan: LevelPlan
    next: int = 0
    measured_sent: int = 0
    measured_done: int = 0
    warm_done: int = 0
    t_first_measured: float | None = None
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: set = field(default_factory=set)
    records: list = field(default_factory=list)

    def quota_closed(self) -> bool:
        p = self.plan
        if p.requests is not None and self.measured_sent >= p.requests:
            return True
        return (p.seconds is not None and self.t_first_measured is not None
                and time.perf_counter() - self.t_first_measured >= p.seconds)

    def take(self) -> tuple[int, str] | None:
        i = self.next
        if i < self.plan.warmup:
            kind = "warmup"
        elif not self.quota_closed():
            kind = "measured"
            self.measured_sent += 1
            if self.t_first_measured is None:
                self.t_first_measured = time.perf_counter()
        elif self.measured_done < self.measured_sent:
            kind = "cooldown"
        else:
            self.finish()
            return None
        self.next += 1
        return i, kind

    def finish(self) -> None:
        """The last measured request ended: hang up on everything still streaming."""
        if not self.finished.is_set():
            self.finished.set()
            for t in list(self.tasks):
                t.cancel()


def request_body(model: str, prompt: str, max_tokens: int, extra: dict | None) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    body.update(extra or {})
    return body


async def run_level(url: str, model: str, prompts: list[str], plan: LevelPlan, extra: dict | None = None,
                    first_k: int = 0, tag: bool = True, say=None, progress_s: float = 5.0,
                    timeout_s: float | None = None, key: str | None = None) -> list[dict]:
    """One concurrency level's closed loop; returns every request's record, in send order.

    Request k (first_k + its index in the level) streams prompt k mod len(prompts), opened
    with "Request k. " when `tag`. Record times are perf_counter seconds; chunk offsets and
    `end` are relative to the record's `t_sent`."""
    loop = _Loop(plan)
    c = plan.concurrency
    # A connection of its own per request: llama.cpp's HTTP server may close a kept-alive one
    # just as the next request goes out on it, which a pooled client reports as an error.
    limits = httpx.Limits(max_connections=c + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, limits=limits, headers=auth_headers(key)) as client:

        async def worker() -> None:
            while not loop.finished.is_set():
                taken = loop.take()
                if taken is None:
                    return
                i, kind = taken
                k = first_k + i
                text = prompts[k % len(prompts)]
                body = request_body(model, f"Request {k}. {text}" if tag else text, plan.max_tokens, extra)
                rec = StreamRecorder(t_sent=time.perf_counter())
                task = asyncio.ensure_future(stream_into(client, "/v1/completions", body,
                                                         plan.request_timeout, rec))
                loop.tasks.add(task)
                try:
                    status, err = await task
                except asyncio.CancelledError:
                    if not loop.finished.is_set():
                        raise  # this worker was cancelled, not its request
                    status, err = "cancelled", None
                    if rec.end is None:
                        rec.finish()
                finally:
                    loop.tasks.discard(task)
                r = rec.record()
                r.update(i=i, k=k, kind=kind, prompt_index=k % len(prompts), t_sent=rec.t_sent, status=status,
                         error=err)
                loop.records.append(r)
                if kind == "warmup":
                    loop.warm_done += 1
                elif kind == "measured":
                    loop.measured_done += 1
                    if loop.quota_closed() and loop.measured_done == loop.measured_sent:
                        loop.finish()

        async def progress() -> None:
            t0 = time.perf_counter()
            while not loop.finished.is_set():
                try:
                    await asyncio.wait_for(loop.finished.wait(), progress_s)
                except TimeoutError:
                    if say is not None:
                        quota = plan.requests if plan.requests is not None else f"{plan.seconds:.0f}s of"
                        say(f"  C={c}: warm-up {loop.warm_done}/{plan.warmup}, measured {loop.measured_done}/"
                            f"{quota} done, {len(loop.tasks)} in flight, {time.perf_counter() - t0:.0f}s")

        workers = [asyncio.ensure_future(worker()) for _ in range(c)]
        ticker = asyncio.ensure_future(progress())
        try:
            await asyncio.wait_for(asyncio.gather(*workers), timeout_s)
        except TimeoutError:
            if say is not None:
                say(f"  C={c}: level timed out after {timeout_s:.0f}s; hanging up")
            loop.finish()
        finally:
            loop.finish()
            ticker.cancel()
    loop.records.sort(key=lambda r: r["i"])
    return loop.records



def measured_window(records: list[dict]) -> tuple[float, float] | None:
    """[first measured send, last measured end], or None when no measured request ended."""
    measured = [r for r in records if r["kind"] == "measured" and r.get("end") is not None]
    if not measured:
        return None
    return min(r["t_sent"] for r in measured), max(r["t_sent"] + r["end"] for r in measured)


def window_throughput(records: list[dict]) -> tuple[float | None, float, float]:
    """(tokens/s, tokens, seconds) over [first measured send, last measured end]: tokens of every
    request (warm-up and cool-down too: they are the load) whose chunks arrived in it, each chunk
    weighted by usage tokens / chunks where usage came back."""
    window = measured_window(records)
    if window is None:
        return None, 0.0, 0.0
    t_start, t_end = window
    tokens = 0.0
    for r in records:
        chunks = r.get("chunks") or []
        if not chunks:
            continue
        w = (r["completion_tokens"] / len(chunks)) if r.get("completion_tokens") else 1.0
        tokens += w * sum(1 for x in chunks if t_start <= r["t_sent"] + x <= t_end)
    span = t_end - t_start
    return (tokens / span if span > 0 else None), tokens, span


def window_prompt_tokens(records: list[dict]) -> tuple[float | None, int]:
    """(prompt tokens/s, tokens) over the same window as window_throughput: the prompts of
    every request whose first token arrived in it (its prefill ended there). A request hung up
    on before its usage came back counts its prompt's length from another request's usage
    (the tag before it differs by a digit at most), or not at all where none reported it."""
    window = measured_window(records)
    if window is None:
        return None, 0
    t_start, t_end = window
    known = {r["prompt_index"]: r["prompt_tokens"] for r in records if r.get("prompt_tokens") is not None}
    tokens = 0
    for r in records:
        chunks = r.get("chunks") or []
        if chunks and t_start <= r["t_sent"] + chunks[0] <= t_end:
            tokens += r.get("prompt_tokens") or known.get(r["prompt_index"], 0)
    span = t_end - t_start
    return (tokens / span if span > 0 else None), tokens


def level_summary(records: list[dict], plan: LevelPlan, goodput: Goodput | None = None) -> dict:
    """The figures of one level from its records (pure: tests feed it recorded data)."""
    goodput = goodput or Goodput()
    measured = [r for r in records if r["kind"] == "measured"]
    ok = [r for r in measured if r["status"] == "ok"]
    errors = [r for r in records if r["status"] == "error"]
    error_kinds: dict[str, int] = {}
    for r in errors:
        key = str(r.get("error"))[:80]
        error_kinds[key] = error_kinds.get(key, 0) + 1
    tps, tokens, span = window_throughput(records)
    all_gaps = [g for r in ok for g in stats.gaps(r["chunks"])]
    ratios = [x for x in (stats.gap_ratio(stats.gaps(r["chunks"])) for r in ok) if x is not None]
    itl = stats.describe(all_gaps)
    completion = [r.get("completion_tokens") for r in ok]
    with_usage = [n for n in completion if n is not None]
    chunks = sum(len(r["chunks"]) for r in ok if r.get("completion_tokens") is not None)
    prompt_tokens = [r["prompt_tokens"] for r in measured if r.get("prompt_tokens") is not None]
    cached = [r["cached_tokens"] for r in measured if r.get("cached_tokens") is not None]
    worst = max(ratios, key=lambda x: x["ratio"]) if ratios else None
    prompt_tps, prompt_window = window_prompt_tokens(records)
    good = sum(goodput.met_by(r) for r in measured)
    return {
        "concurrency": plan.concurrency,
        "requests": {"measured": len(measured), "ok": len(ok), "warmup": sum(r["kind"] == "warmup" for r in records),
                     "cooldown": sum(r["kind"] == "cooldown" for r in records),
                     "cancelled": sum(r["status"] == "cancelled" for r in records)},
        "errors": len(errors),
        "error_kinds": error_kinds,
        "window_s": span,
        "window_tokens": tokens,
        "out_tok_s": tps,
        "ttft": stats.describe([r["chunks"][0] for r in ok if r["chunks"]]),
        "itl": itl,
        "e2e": stats.describe([r["end"] for r in ok if r.get("end") is not None]),
        "gap_ratio": {"target": GAP_RATIO_TARGET, "streams": len(ratios),
                      "worst": worst["ratio"] if worst else None, "worst_stream": worst,
                      "median": stats.percentile([x["ratio"] for x in ratios], 50),
                      "pooled": (itl["max"] / itl["p50"]) if itl["count"] and itl["p50"] else None},
        "output_tokens": {"expected": plan.max_tokens, "with_usage": len(with_usage),
                          "short": sum(n != plan.max_tokens for n in with_usage), "total": sum(with_usage),
                          "tokens_per_chunk": (sum(with_usage) / chunks) if chunks else None},
        "prompt_tokens": stats.describe(prompt_tokens, (50,)),
        "prompt_tok_s": prompt_tps,
        "prompt_window_tokens": prompt_window,
        "goodput": {"ttft_s": goodput.ttft_s, "itl_s": goodput.itl_s, "met": good, "of": len(measured),
                    "req_s": (good / span) if span > 0 else None},
        "cached_tokens": sum(cached) if cached else None,
    }


def compact(r: dict) -> dict:
    keep = ("i", "k", "kind", "prompt_index", "status", "error", "prompt_tokens", "completion_tokens",
            "cached_tokens", "finish_reason")
    out = {key: r.get(key) for key in keep}
    out["t_sent"] = round(r["t_sent"], 6)
    out["end"] = None if r.get("end") is None else round(r["end"], 6)
    out["chunks"] = [round(x, 6) for x in r.get("chunks") or []]
    return out


