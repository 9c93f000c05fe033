"""The convoy, measured: three client-side dispatch policies over one workload and one server.

- static(B): wait for a group of B requests to arrive, send them together, wait for all B to
  finish, then take the next group.
- dynamic(B, T): send the waiting requests when B are waiting or the oldest has waited T
  seconds, then wait for the whole group to finish before sending another.
- continuous(B): send every request when it arrives, with at most B in flight.

The server batches continuously in every case; the client decides what the server gets to
see. Static and dynamic recreate request-level batching on top of it: a request that finished
early leaves its place in the group empty until the longest member finishes (the convoy).

Times are measured from each request's *arrival* in the workload, so TTFT includes the time a
request spent waiting in the client for its group. Plain asyncio + httpx, no locust.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx

from poot.loadtests.client import stream_into
from poot.loadtests.keys import headers
from poot.loadtests.sse import StreamRecorder
from poot.loadtests.stats import describe, gaps, percentile
from poot.loadtests.workloads import Lengths, LoadConfig, RequestSpec, build, request_body


@dataclass(frozen=True)
class ConvoyConfig:
    requests: int = 48
    rate: float = 8.0
    batch: int = 8
    timeout: float = 0.05
    seed: int = 0
    prompt: Lengths = Lengths("uniform", 32, 128)
    output: Lengths = Lengths("uniform", 16, 256)
    max_context: int = 512
    chars_per_token: float = 1.0
    model: str = ""
    request_timeout: float = 120.0

    def load_config(self) -> LoadConfig:
        return LoadConfig(scenario="convoy", seed=self.seed, requests=self.requests, mode="open",
                          rate=self.rate, prompt=self.prompt, output=self.output,
                          max_context=self.max_context, chars_per_token=self.chars_per_token,
                          model=self.model, timeout_s=self.request_timeout)


POLICIES = ("static", "dynamic", "continuous")


async def _stream(client: httpx.AsyncClient, cfg: LoadConfig, spec: RequestSpec, arrival: float) -> dict:
    path, body = request_body(spec, cfg)
    rec_ = StreamRecorder(t_sent=time.perf_counter())
    status, err = await stream_into(client, path, body, cfg.timeout_s, rec_)
    rec = rec_.record()
    rec.update(id=spec.id, status=status, error=err, t_arrival=arrival, t_sent=rec_.t_sent,
               max_tokens=spec.max_tokens)
    return rec


def group_plan(arrivals: list[float], policy: str, batch: int, timeout: float) -> list[list[int]]:
    """Which requests form each group, for the grouping policies (pure; for tests and docs).

    Dynamic grouping depends on when the previous group finished, so this plan assumes groups
    finish instantly; the live dispatcher below decides from real completion times."""
    if policy == "static":
        return [list(range(i, min(i + batch, len(arrivals)))) for i in range(0, len(arrivals), batch)]
    if policy == "dynamic":
        groups, i, now = [], 0, 0.0
        while i < len(arrivals):
            deadline = max(now, arrivals[i] + timeout)
            g = [i]
            j = i + 1
            while j < len(arrivals) and len(g) < batch and arrivals[j] <= deadline:
                g.append(j)
                j += 1
            now = max(now, arrivals[g[-1]] if len(g) == batch else deadline)
            groups.append(g)
            i = j
        return groups
    raise ValueError(policy)


async def run_policy(url: str, ccfg: ConvoyConfig, policy: str, api_key: str | None = None) -> dict:
    cfg = ccfg.load_config()
    specs = build(cfg)
    n = len(specs)
    limits = httpx.Limits(max_connections=max(ccfg.batch, 1) + 4, max_keepalive_connections=ccfg.batch + 4)
    records: list[dict] = []
    async with httpx.AsyncClient(base_url=url, limits=limits, headers=headers(api_key)) as client:
        t0 = time.perf_counter()
        arrival = [t0 + s.arrival for s in specs]

        async def sleep_until(t: float) -> None:
            d = t - time.perf_counter()
            if d > 0:
                await asyncio.sleep(d)

        async def send_group(idx: list[int]) -> None:
            recs = await asyncio.gather(*(_stream(client, cfg, specs[i], arrival[i]) for i in idx))
            records.extend(recs)

        if policy == "static":
            for i in range(0, n, ccfg.batch):
                idx = list(range(i, min(i + ccfg.batch, n)))
                await sleep_until(arrival[idx[-1]])
                await send_group(idx)
        elif policy == "dynamic":
            i = 0
            while i < n:
                # Launch when B are waiting, or when the oldest waiting has waited T.
                now = time.perf_counter()
                full_at = arrival[min(i + ccfg.batch, n) - 1]
                launch = max(now, min(full_at, arrival[i] + ccfg.timeout))
                await sleep_until(launch)
                now = time.perf_counter()
                idx = [j for j in range(i, min(i + ccfg.batch, n)) if arrival[j] <= now]
                await send_group(idx)
                i = idx[-1] + 1
        elif policy == "continuous":
            sem = asyncio.Semaphore(ccfg.batch)

            async def one(i: int) -> None:
                await sleep_until(arrival[i])
                async with sem:
                    records.append(await _stream(client, cfg, specs[i], arrival[i]))

            await asyncio.gather(*(one(i) for i in range(n)))
        else:
            raise ValueError(f"unknown policy {policy!r}")
        t_end = time.perf_counter()
    records.sort(key=lambda r: r["id"])
    return {"policy": policy, "t0": t0, "t_end": t_end, "records": records,
            "wall_start": time.time() - (time.perf_counter() - t0)}


def policy_row(result: dict) -> dict:
    """One line of the convoy table. TTFT from arrival; TPOT is one mean per request, then
    percentiles across requests; ITL p99 pools every token gap of every request."""
    recs = result["records"]
    ok = [r for r in recs if r["status"] == "ok"]
    ttft = [r["t_sent"] - r["t_arrival"] + r["chunks"][0] for r in ok if r["chunks"]]
    wait = [r["t_sent"] - r["t_arrival"] for r in ok]
    tpot = []
    for r in ok:
        n = r.get("completion_tokens") or len(r["chunks"])
        if n > 1 and len(r["chunks"]) > 1:
            tpot.append((r["chunks"][-1] - r["chunks"][0]) / (n - 1))
    itl = [g for r in ok for g in gaps(r["chunks"])]
    tokens = sum((r.get("completion_tokens") or len(r["chunks"])) for r in ok)
    first_arrival = min(r["t_arrival"] for r in recs) if recs else result["t0"]
    last_end = max(r["t_sent"] + (r["end"] or 0) for r in recs) if recs else result["t_end"]
    makespan = last_end - min(first_arrival, result["t0"])
    return {
        "policy": result["policy"],
        "requests": len(recs),
        "errors": len(recs) - len(ok),
        "makespan_s": makespan,
        "throughput_tok_s": tokens / makespan if makespan > 0 else None,
        "ttft_p50": percentile(ttft, 50), "ttft_p95": percentile(ttft, 95),
        "client_wait_p50": percentile(wait, 50),
        "tpot_p50": percentile(tpot, 50), "tpot_p95": percentile(tpot, 95),
        "itl_p99": percentile(itl, 99), "itl_max": max(itl) if itl else None,
        "ttft": describe(ttft),
    }


def table(rows: list[dict]) -> str:
    def ms(x):
        return "-" if x is None else f"{x * 1e3:.1f}"

    def s(x):
        return "-" if x is None else f"{x:.2f}"

    lines = ["| policy | throughput (tok/s) | TTFT p50 (s) | TTFT p95 (s) | mean TPOT p50 (ms) | "
             "mean TPOT p95 (ms) | ITL p99 (ms) | errors |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        tp = "-" if r["throughput_tok_s"] is None else f"{r['throughput_tok_s']:.0f}"
        lines.append(f"| {r['policy']} | {tp} | {s(r['ttft_p50'])} | {s(r['ttft_p95'])} | "
                     f"{ms(r['tpot_p50'])} | {ms(r['tpot_p95'])} | {ms(r['itl_p99'])} | {r['errors']} |")
    return "\n".join(lines)


async def run_all(url: str, ccfg: ConvoyConfig, between=None, api_key: str | None = None) -> list[dict]:
    """Runs the three policies one after the other; `between()` (sync) runs between phases,
    e.g. to wait until the server is idle again."""
    results = []
    for i, policy in enumerate(POLICIES):
        if i and between is not None:
            await asyncio.to_thread(between)
        results.append(await run_policy(url, ccfg, policy, api_key))
    return results
