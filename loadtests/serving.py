"""Serving, side by side: closed-loop streams at several concurrencies against poot-serve and
any other OpenAI-compatible server, one server after the other, in one run.

For each server and each concurrency C, C workers stream `/v1/completions` requests, each
sending its next request as soon as its last one ended. Every request streams `max_tokens`
(128) tokens greedily with `ignore_eos`, from one of 64 distinct English prompts
(english.prompt_set: 22-186 tokens in the `chat` mix, 1,200-1,400 in the prefill-heavy `long`
one, as retrieval, long chat histories and agents send), opened with a short tag of its own ("Request 17. ") so that no server
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
after (poot: engine_step_duration_seconds by kind, the longest step, engine_compiles);
prompt tokens/s (the prompts of the requests whose first token arrived in the window); and
goodput, the measured requests a second that met a TTFT and an ITL target (--goodput).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import httpx

from poot.conformance.kind import DISPLAY
from poot.conformance.report import suite_commit
from poot.loadtests import machine, scrape
from poot.loadtests.client import discover_model
from poot.loadtests.closed_loop import Goodput, LevelPlan, compact, level_summary, run_level
from poot.loadtests.english import prompt_set
from poot.loadtests.keys import ENV_VAR, api_key
from poot.loadtests.memory import RssSampler
from poot.loadtests.peers import (
    Target,
    apply_bodies,
    default_targets,
    parse_targets,
    poot_target,
    report_kind,
    server_kind,
    vllm_setup,
    wait_quiet,
)
from poot.loadtests.server_proc import CommandServer
from poot.loadtests.serving_report import PAGE_COMMAND, line, markdown, page, ratios
from poot.loadtests.step_metrics import metrics_delta

DEFAULT_LEVELS = (1, 8, 32)
MIXES = {"chat": (22, 186), "long": (1200, 1400)}  # prompt lengths in tokens, drawn uniformly


def run_server(target: Target, plans: list[LevelPlan], prompts: list[str], logs: str, say, tag: bool = True,
               startup_timeout: float = 600.0, level_timeout: float = 1800.0, progress_s: float = 5.0, key: str | None = None,
               goodput: Goodput | None = None) -> dict:
    """Every level against one server: started here (and stopped) when given as a command."""
    result: dict = {"name": target.name, "command": target.command, "url": target.url, "levels": []}
    server = sampler = None
    try:
        if target.command:
            log = os.path.join(logs, f"{target.name}.log")
            say(f"[{target.name}] starting: {target.command}  (log {log})")
            server = CommandServer(target.command, startup_timeout, log, name=target.name, env=target.env)
            t0 = time.time()
            url = server.start()
            result["startup_s"] = time.time() - t0
            # Its resident memory, from /proc, once a second: at healthy, and each level's peak.
            sampler = RssSampler(pid=server.pid, interval=1.0).start()
            result["rss_healthy_bytes"] = sampler.samples[0][1] if sampler.samples else None
        else:
            url = target.url.rstrip("/")
        result["url"] = url
        kind, info = server_kind(url, key)
        extra = target.extra_body
        if extra is None:
            extra = {"cache_prompt": False} if kind == "llamacpp" else {}
        model = discover_model(url, key)
        result.update(kind=report_kind(kind), info=info, model=model, extra_body=extra)
        say(f"[{target.name}] {DISPLAY[kind]} server at {url}, model {model}" + (f", extra body {extra}" if extra else ""))
        k = 0
        for plan in plans:
            quiet = wait_quiet(url, key=key)
            before = scrape.fetch(url, api_key=key)
            load0 = os.getloadavg()
            say(f"[{target.name}] C={plan.concurrency}: warm-up {plan.warmup}, measuring "
                + (f"{plan.requests} requests" if plan.requests is not None else f"{plan.seconds:.0f}s"))
            t0, wall0 = time.perf_counter(), time.time()
            records = asyncio.run(run_level(url, model, prompts, plan, extra, k, tag, say, progress_s, level_timeout,
                                              key))
            wall = time.perf_counter() - t0
            k += len(records)
            wait_quiet(url, key=key)
            after = scrape.fetch(url, api_key=key)
            summary = level_summary(records, plan, goodput)
            if sampler is not None:
                sampler.sample()  # a level shorter than the interval has this one at least
            peak = max((v for t, v in (sampler.samples if sampler else []) if t >= wall0), default=None)
            summary.update(wall_s=wall, rss_peak_bytes=peak, quiet_before=quiet, loadavg_before=load0, loadavg_after=os.getloadavg(),
                           metrics=metrics_delta(before, after), metrics_after=after,
                           records=[compact(r) for r in records])
            result["levels"].append(summary)
            say(f"[{target.name}] C={plan.concurrency}: {line(summary)}")
    except (RuntimeError, httpx.HTTPError, OSError) as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        say(f"[{target.name}] failed: {result['error']}")
    finally:
        if sampler is not None:
            sampler.stop()
        if server is not None:
            result["exit_code"] = server.stop()
    return result



def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="poot-load serving", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="one running server to measure (the same as --server server=URL)")
    p.add_argument("--serve", action="store_true", help="measure poot-serve, started here (with --url or --server: "
                   "beside them, first; without either it is measured anyway)")
    p.add_argument("--serve-model", help="the model poot-serve loads (default: its own default, SmolLM2)")
    p.add_argument("--serve-args", default="", help="extra poot-serve options, e.g. '--draft ngram'")
    p.add_argument("--vllm-model", metavar="DIR", help="with --serve-model FILE.gguf: the same weights as a Hugging "
                   "Face folder (benchmarks/llama_gguf.py --safetensors), for vLLM's CPU build when "
                   "ci/setup_vllm.sh has set it up")
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
    p.add_argument("--mix", choices=sorted(MIXES), default="chat",
                   help="prompt lengths: chat (22-186 tokens) or long (1,200-1,400: prefill-heavy)")
    p.add_argument("--prompt-tokens", metavar="LOW-HIGH", help="prompt lengths in tokens instead of the mix's")
    p.add_argument("--goodput", default="", metavar="ttft=MS,itl=MS",
                   help="what a request must meet to count toward goodput: time to first token and mean gap "
                        f"between tokens (default ttft={Goodput().ttft_s * 1e3:g},itl={Goodput().itl_s * 1e3:g})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chars-per-token", type=float, default=4.77,
                   help="prompt lengths: characters per token (4.77 fits SmolLM2's tokenizer; 1 a byte tokenizer)")
    p.add_argument("--no-request-tag", action="store_true",
                   help="send the prompts as they are (a server with a prefix cache then reuses repeats)")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--level-timeout", type=float, default=1800.0)
    p.add_argument("--progress-interval", type=float, default=5.0)
    p.add_argument("--api-key", help=f"bearer token sent on every request and scrape (default: ${ENV_VAR}); "
                                     "poot-serve started here requires it. Never printed or written to the report")
    p.add_argument("--out", help="report folder: serving.json (every figure and record), serving.md (the "
                                 "tables) and the servers' logs (default loadtest-reports/serving-TIMESTAMP)")
    p.add_argument("--logs", help="folder for the servers' logs (default: OUT/logs)")
    p.add_argument("--json", help="also write every figure and record here")
    p.add_argument("--markdown", help="also write the tables here")
    p.add_argument("--quiet", action="store_true", help="no progress lines (the tables are still printed)")
    p.add_argument("--page", metavar="PATH", help="instead of a run: write the results page from every "
                                                  "FOLDER/<run>/serving.json (--reports-dir)")
    p.add_argument("--reports-dir", default="serving-report", metavar="FOLDER",
                   help="with --page: the committed runs, one folder each (default serving-report)")
    return p


def _prompt_range(text: str) -> tuple[int, int]:
    low, sep, high = text.partition("-")
    try:
        return int(low), int(high if sep else low)
    except ValueError:
        raise ValueError(f"--prompt-tokens {text!r}: give LOW-HIGH in tokens, e.g. 1200-1400") from None


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    if a.page:
        try:
            text = page(Path(a.reports_dir))
        except (OSError, ValueError, KeyError) as exc:
            print(f"poot-load serving: --page: {exc}", file=sys.stderr)
            return 2
        Path(a.page).parent.mkdir(parents=True, exist_ok=True)
        Path(a.page).write_text(text)
        print(f"wrote {a.page} ({PAGE_COMMAND})")
        return 0
    key = api_key(a.api_key)
    try:
        levels = [int(x) for x in a.concurrency.split(",") if x.strip()]
        if not levels or min(levels) < 1:
            raise ValueError("--concurrency: give positive integers, e.g. 1,8,32")
        given = a.server + ([f"server={a.url}"] if a.url else [])
        poot = poot_target(a.serve_model, a.serve_args, key)
        goodput = Goodput.parse(a.goodput)
        lo, hi = _prompt_range(a.prompt_tokens) if a.prompt_tokens else MIXES[a.mix]
        prompts = prompt_set(a.seed, a.prompts, lo, hi, chars_per_token=a.chars_per_token)
        # Room for the longest prompt (the tag and a tokenizer that splits finer: 25% more) and its output.
        request_tokens = int(hi * 1.25) + 16 + a.max_tokens
        gguf = a.serve_model if a.serve_model and a.serve_model.endswith(".gguf") else None
        if a.vllm_model is not None:
            if gguf is None:
                raise ValueError("--vllm-model: give --serve-model FILE.gguf too (the folder holds its weights)")
            if not (Path(a.vllm_model) / "config.json").is_file():
                raise ValueError(f"--vllm-model {a.vllm_model}: no config.json there "
                                 "(write one with benchmarks/llama_gguf.py --safetensors)")
            if vllm_setup() is None:
                raise ValueError("--vllm-model: vLLM's CPU build is not set up here (run ci/setup_vllm.sh)")
        targets = parse_targets(given) if given else default_targets(levels, poot, gguf, request_tokens, a.vllm_model)
        if a.serve and given:
            if any(t.name == poot.name for t in targets):
                raise ValueError(f"--serve: a --server is named {poot.name!r} already")
            targets.insert(0, poot)
        apply_bodies(targets, a.extra_body)
    except ValueError as exc:
        print(f"poot-load serving: {exc}", file=sys.stderr)
        return 2

    def say(msg: str) -> None:
        if not a.quiet:
            print(msg, flush=True)

    plans = [LevelPlan(c, c if a.warmup is None else a.warmup,
                       None if a.seconds is not None and a.requests is None else (a.requests or max(8, 2 * c)),
                       a.seconds, a.max_tokens, a.request_timeout) for c in levels]
    out = a.out or os.path.join("loadtest-reports", f"serving-{time.strftime('%Y%m%d-%H%M%S')}")
    logs = a.logs or os.path.join(out, "logs")
    for folder in (out, logs):
        os.makedirs(folder, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    say(f"poot-load serving: {len(targets)} servers ({', '.join(t.name for t in targets)}), one after the other; "
        f"levels {levels}; {len(prompts)} prompts of {lo}-{hi} tokens, {a.max_tokens} output tokens each")
    servers = [run_server(t, plans, prompts, logs, say, not a.no_request_tag, a.startup_timeout,
                          a.level_timeout, a.progress_interval, key, goodput) for t in targets]
    result = {"config": {"concurrency": levels, "requests": a.requests, "seconds": a.seconds, "warmup": a.warmup,
                         "max_tokens": a.max_tokens, "prompts": len(prompts), "seed": a.seed,
                         "chars_per_token": a.chars_per_token, "request_tag": not a.no_request_tag,
                         "mix": None if a.prompt_tokens else a.mix, "prompt_tokens_target": [lo, hi],
                         "goodput": {"ttft_s": goodput.ttft_s, "itl_s": goodput.itl_s}},
              "started": started, "cpus": os.cpu_count(), "cpu": machine.cpu(), "commit": suite_commit(),
              "logs": logs, "prompt_texts": prompts,
              "servers": servers}
    result["ratios"] = ratios(result)
    md = markdown(result)
    print(md, flush=True)
    for path in filter(None, (os.path.join(out, "serving.json"), a.json)):
        with open(path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    for path in filter(None, (os.path.join(out, "serving.md"), a.markdown)):
        with open(path, "w", encoding="utf-8") as f:
            f.write(md)
    say(f"report: {out}")
    failed = any(s.get("error") or any(lv["errors"] for lv in s.get("levels", [])) for s in servers)
    return 1 if failed else 0

