"""poot-load: headless load runs against an OpenAI-compatible server, with a report folder.

    poot-load SCENARIO --url URL [options]      run against a running server
    poot-load SCENARIO --serve [options]        start the bundled server, run, stop it
    poot-load compare A B                       two report folders side by side
    poot-load report FOLDER                     rebuild a report from requests-*.jsonl files
    poot-load list                              scenarios

Locust scenarios run locust in a child process (so this process, which scrapes /metrics and
writes the report, stays free of gevent's monkey patching). The convoy scenario runs in
process with asyncio and httpx.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import replace

from poot.loadtests import convoy as convoy_mod
from poot.loadtests import memory, report, scrape, stats
from poot.loadtests.client import discover_model
from poot.loadtests.keys import ENV_VAR, api_key
from poot.loadtests.server_proc import BundledServer
from poot.loadtests.workloads import DESCRIPTIONS, SCENARIOS, Lengths, build, scenario_config

LOCUSTFILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "locustfile.py")



def _target(a, out: str):
    """The server to load: started here with --serve (returned, to be stopped), or --url."""
    if a.serve:
        server = BundledServer(a.serve_model, a.serve_args.split(), log_path=os.path.join(out, "server.log"),
                               api_key=a.key)
        _say(a, "starting poot-serve ...")
        return server, server.start()
    if a.url:
        return None, a.url.rstrip("/")
    print("poot-load: give --url URL or --serve", file=sys.stderr)
    return None, None

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="poot-load", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("scenario", help="a scenario (see `poot-load list`), or `compare`, `report`, `list`, or `serving` "
                                      "(servers side by side: `poot-load serving --help`)")
    p.add_argument("paths", nargs="*", help="for compare: two report folders (or summary.json files)")
    t = p.add_argument_group("target")
    t.add_argument("--url", help="base URL of the server, e.g. http://127.0.0.1:8000")
    t.add_argument("--serve", action="store_true", help="start `poot-serve --model synthetic` on a free port")
    t.add_argument("--serve-model", default="synthetic")
    t.add_argument("--serve-args", default="", help="extra poot-serve options, e.g. '--draft ngram'")
    t.add_argument("--model", default=None, help="model name to send (default: first of /v1/models)")
    t.add_argument("--api-key", help=f"bearer token sent on every request, /metrics scrapes included (default: "
                                     f"${ENV_VAR}); with --serve the bundled server requires it. Never printed or "
                                     "written to a report")
    t.add_argument("--endpoint", choices=("completions", "chat"), default=None)
    w = p.add_argument_group("workload (defaults depend on the scenario)")
    w.add_argument("--seed", type=int)
    w.add_argument("--requests", type=int, help="requests in the workload (the run's count bound)")
    w.add_argument("--rate", type=float, help="open loop: mean arrivals per second (Poisson)")
    w.add_argument("--concurrency", type=int, help="closed loop: users; open loop: pool size (most in flight)")
    w.add_argument("--closed", action="store_true", help="closed loop instead of open loop")
    w.add_argument("--prompt-lengths", help="uniform:LO:HI | lognormal:MEDIAN:SIGMA:LO:HI | fixed:N (tokens)")
    w.add_argument("--output-lengths", help="same forms, for max_tokens")
    w.add_argument("--shared-prefix", type=int, help="tokens of a system prompt shared by every request")
    w.add_argument("--disconnect-share", type=float, help="share of clients that leave early")
    w.add_argument("--burst", type=int, help="long prompts in the burst")
    w.add_argument("--burst-at", type=float, help="seconds after the start")
    w.add_argument("--burst-prompt", type=int, help="tokens per burst prompt")
    w.add_argument("--decoders", type=int, help="long-output streams running when the burst lands")
    w.add_argument("--decoder-output", type=int)
    w.add_argument("--max-context", type=int, help="prompt + output are clipped to this (default 512)")
    w.add_argument("--chars-per-token", type=float, help="1.0 for byte tokenizers, ~4 for BPE")
    w.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos")
    w.add_argument("--no-usage", action="store_true", help="do not send stream_options.include_usage")
    w.add_argument("--request-timeout", type=float, help="seconds per request (default 60; the soak 300)")
    c = p.add_argument_group("convoy")
    c.add_argument("--batch", type=int, default=8, help="group size B (and in-flight cap for continuous)")
    c.add_argument("--batch-timeout-ms", type=float, default=50.0, help="dynamic: oldest waits at most T")
    r = p.add_argument_group("run and report")
    r.add_argument("--run-time", type=float, default=120.0, help="seconds; the run stops at this bound")
    r.add_argument("--out", help="report folder (default loadtest-reports/SCENARIO-TIMESTAMP)")
    r.add_argument("--slo-ttft-ms", type=float, help="goodput: TTFT objective")
    r.add_argument("--slo-gap-p99-ms", type=float, help="goodput: per-request p99 token gap objective")
    r.add_argument("--gap-ratio-limit", type=float, default=3.0, help="long-burst: max gap / median gap bound")
    r.add_argument("--idle-timeout", type=float, default=15.0, help="seconds to wait for the server to go idle")
    r.add_argument("--scrape-interval", type=float, default=0.5)
    r.add_argument("--workers", type=int, default=1, help="locust worker processes under one master on this "
                   "machine (worker i of N sends requests i, i+N, ...); 1: a single locust process")
    r.add_argument("--locust-args", default="", help="extra locust options (e.g. for --master)")
    m = p.add_argument_group("soak: the server's resident memory")
    m.add_argument("--rss-interval", type=float, default=2.0, help="seconds between RSS samples")
    m.add_argument("--soak-warmup", type=float, help="seconds of warm-up before the slope is fitted "
                   "(default: a quarter of --run-time, at most 300)")
    m.add_argument("--rss-slope-limit", type=float, default=1.0, help="MB per minute the RSS may grow after "
                   "warm-up")
    m.add_argument("--rss-min-window", type=float, default=600.0, help="seconds after warm-up needed to judge "
                   "the slope (shorter runs report it only)")
    r.add_argument("--quiet", action="store_true")
    return p


def _overrides(a) -> dict:
    o = {"seed": a.seed, "requests": a.requests, "rate": a.rate, "concurrency": a.concurrency,
         "shared_prefix": a.shared_prefix, "disconnect_share": a.disconnect_share, "burst": a.burst,
         "burst_at": a.burst_at, "burst_prompt": a.burst_prompt, "decoders": a.decoders,
         "decoder_output": a.decoder_output, "max_context": a.max_context, "chars_per_token": a.chars_per_token,
         "endpoint": a.endpoint, "model": a.model, "timeout_s": a.request_timeout}
    if a.closed:
        o["mode"] = "closed"
    if a.prompt_lengths:
        o["prompt"] = Lengths.parse(a.prompt_lengths)
    if a.output_lengths:
        o["output"] = Lengths.parse(a.output_lengths)
    if a.no_ignore_eos:
        o["ignore_eos"] = False
    if a.no_usage:
        o["include_usage"] = False
    return o


def _say(a, *msg) -> None:
    if not a.quiet:
        print(*msg, flush=True)


def run_locust(url: str, cfg, out: str, users: int, run_time: float, extra: str, quiet: bool,
               key: str | None = None, workers: int = 1) -> int:
    # Users spawn within ~50 ms so the open-loop pool is ready before the first arrivals.
    scale_out = ["--processes", str(workers), "--poot-workers", str(workers)] if workers > 1 else []
    cmd = [sys.executable, "-m", "locust", "-f", LOCUSTFILE, "--headless", "-u", str(users), "-r", str(users * 20),
           "-t", f"{int(max(1, run_time))}s", "--host", url, "--csv", os.path.join(out, "locust"),
           "--only-summary", "--stop-timeout", "5", "--loglevel", "WARNING",
           "--logfile", os.path.join(out, "locust.log"), "--exit-code-on-error", "0",
           "--poot-config", json.dumps(cfg.as_dict()), "--poot-out", out] + scale_out + extra.split()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if key:  # through the environment: a command line is visible to every user of the machine
        env[ENV_VAR] = key
    with open(os.path.join(out, "locust.stdout"), "w", encoding="utf-8") as log:
        try:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=run_time + 60)
            return proc.returncode
        except subprocess.TimeoutExpired:
            return 124


def checks_for(scenario: str, records: list[dict], idle: dict, a) -> dict:
    checks: dict = {}
    last = idle.get("last") or {}
    text = (f"after the run: running={last.get('engine_requests_running')}, waiting={last.get('engine_requests_waiting')}, "
            f"kv_blocks_reserved={last.get('kv_blocks_reserved')} (waited {idle.get('waited_s', 0):.1f}s)")
    checks["server idle afterwards"] = {"ok": idle.get("ok"), "text": text if last else idle.get("reason", ""),
                                        **idle}
    if any(r.get("kind") == "burst" for r in records):
        b = stats.burst_interference(records, limit=a.gap_ratio_limit)
        if b["streams"]:
            w = b["worst"]
            b["text"] = (f"{b['streams']} decoding streams; worst largest/typical gap = {b['worst_ratio']:.2f} "
                         f"({w['max_gap'] * 1e3:.1f} ms vs {w['typical_gap'] * 1e3:.1f} ms, {w['basis']}), "
                         f"limit {a.gap_ratio_limit}x")
        else:
            b["text"] = "no stream was decoding when the burst arrived (make decoders longer or the burst earlier)"
        checks["burst: decode gap within limit"] = b
    if scenario == "soak":
        errors = [r for r in records if r.get("status") == "error"]
        checks["no errors"] = {"ok": bool(records) and not errors,
                               "text": f"{len(errors)} errors in {len(records)} requests" + (
                                   f" (first: {errors[0].get('error')})" if errors else "")}
    leavers = [r for r in records if r.get("status") == "disconnected"]
    if leavers:
        checks["disconnects recorded"] = {"ok": True, "text": f"{len(leavers)} clients left mid-request"}
    return checks


def run_scenario(a) -> int:
    overrides = _overrides(a)
    cfg = scenario_config(a.scenario, **overrides)
    out = a.out or os.path.join("loadtest-reports", f"{a.scenario}-{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(out):
        if name.startswith("requests-") and name.endswith(".jsonl"):
            os.remove(os.path.join(out, name))  # a report folder holds one run
    server = None
    try:
        server, url = _target(a, out)
        if url is None:
            return 2
        if not cfg.model:
            cfg = replace(cfg, model=discover_model(url, a.key))
        _say(a, f"{a.scenario}: {DESCRIPTIONS.get(a.scenario, '')}\ntarget {url}, model {cfg.model}, report {out}")
        scraper = scrape.Scraper(url, a.scrape_interval, api_key=a.key).start()
        rss = None
        if cfg.cycle:
            rss = memory.RssSampler(server.pid if server else None, url, a.rss_interval, api_key=a.key).start()
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        users = cfg.concurrency if cfg.mode == "closed" else max(cfg.concurrency, 32 if a.concurrency is None else 0)
        specs = build(cfg)
        users = max(1, min(users, len(specs)))
        t_load = time.time()
        if a.workers < 1:
            raise SystemExit("poot-load: --workers must be at least 1")
        users = max(users, a.workers)  # every worker gets at least one user
        code = run_locust(url, cfg, out, users, a.run_time, a.locust_args, a.quiet, a.key, a.workers)
        t_load_end = time.time()
        idle = scrape.wait_idle(url, a.idle_timeout, api_key=a.key)
        samples = scraper.stop()
        mem = None
        if rss is not None:
            warmup = a.soak_warmup if a.soak_warmup is not None else min(300.0, 0.25 * a.run_time)
            mem = memory.summarize(rss.stop(), t_load + warmup, t_load_end, a.rss_slope_limit,
                                   a.rss_min_window, rss.source)
            mem.update(t_load=t_load, t_load_end=t_load_end, series=rss.samples)
        records = report.load_records(out)
        slo = stats.Slo(None if a.slo_ttft_ms is None else a.slo_ttft_ms / 1e3,
                        None if a.slo_gap_p99_ms is None else a.slo_gap_p99_ms / 1e3)
        meta = {"scenario": a.scenario, "description": DESCRIPTIONS.get(a.scenario, ""), "url": url,
                "started": started, "config": cfg.as_dict(), "planned_requests": len(specs), "users": users,
                "run_time_bound_s": a.run_time, "locust_exit_code": code, "locust_workers": a.workers,
                "load_s": round(t_load_end - t_load, 2)}
        checks = checks_for(a.scenario, records, idle, a)
        if mem is not None:
            checks["RSS flat after warm-up"] = {k: v for k, v in mem.items() if k != "series"}
        summary = report.write_report(out, records, samples, meta, slo, checks, memory=mem)
    finally:
        if server is not None:
            server.stop()
    st = summary["stats"]
    planned = "" if cfg.cycle else f"/{len(specs)}"
    _say(a, f"requests {st['requests']}{planned} ok {st['ok']} errors {st['errors']} left {st['disconnected']}; "
            f"output {st['output_throughput'] or 0:.0f} tok/s; TTFT p50 {_ms(st['ttft']['p50'])} "
            f"p99 {_ms(st['ttft']['p99'])}; gap p50 {_ms(st['itl']['p50'])} p99 {_ms(st['itl']['p99'])} "
            f"max {_ms(st['itl']['max'])}; goodput {_pct(st['goodput'])}")
    for name, c in checks.items():
        _say(a, f"check {name}: {({True: 'PASS', False: 'FAIL', None: 'n/a'})[c.get('ok')]} - {c.get('text', '')}")
    _say(a, f"report: {os.path.join(out, 'report.md')}")
    if code not in (0, None) and not records:
        return 1
    if not records or st["ok"] + st["disconnected"] == 0:
        return 1
    return 1 if any(c.get("ok") is False for c in checks.values()) else 0


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}ms"


def _pct(x) -> str:
    return "-" if x is None else f"{x:.0%}"


def run_convoy(a) -> int:
    out = a.out or os.path.join("loadtest-reports", f"convoy-{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(out, exist_ok=True)
    ccfg = convoy_mod.ConvoyConfig()
    o = {"requests": a.requests, "rate": a.rate, "seed": a.seed, "batch": a.batch,
         "timeout": a.batch_timeout_ms / 1e3, "max_context": a.max_context, "chars_per_token": a.chars_per_token,
         "model": a.model, "request_timeout": a.request_timeout}
    if a.prompt_lengths:
        o["prompt"] = Lengths.parse(a.prompt_lengths)
    if a.output_lengths:
        o["output"] = Lengths.parse(a.output_lengths)
    ccfg = replace(ccfg, **{k: v for k, v in o.items() if v is not None})
    server = None
    try:
        server, url = _target(a, out)
        if url is None:
            return 2
        if not ccfg.model:
            ccfg = replace(ccfg, model=discover_model(url, a.key))
        _say(a, f"convoy: {ccfg.requests} requests at {ccfg.rate}/s, B={ccfg.batch}, T={ccfg.timeout * 1e3:.0f} ms; "
                f"target {url}")
        scraper = scrape.Scraper(url, min(a.scrape_interval, 0.1), api_key=a.key).start()

        def between():
            scrape.wait_idle(url, a.idle_timeout, api_key=a.key)

        async def bounded():
            return await asyncio.wait_for(convoy_mod.run_all(url, ccfg, between, a.key), timeout=a.run_time)

        try:
            results = asyncio.run(bounded())
        except TimeoutError:
            print(f"poot-load: convoy run exceeded --run-time {a.run_time:.0f}s", file=sys.stderr)
            scraper.stop()
            return 1
        idle = scrape.wait_idle(url, a.idle_timeout, api_key=a.key)
        samples = scraper.stop()
    finally:
        if server is not None:
            server.stop()
    rows = [convoy_mod.policy_row(r) for r in results]
    tbl = convoy_mod.table(rows)
    png = report.plot_convoy(results, samples, os.path.join(out, "convoy.png"))
    cfg_d = {k: (v.__dict__ if isinstance(v, Lengths) else v) for k, v in ccfg.__dict__.items()}
    with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as f:
        json.dump({"scenario": "convoy", "url": url, "config": cfg_d, "rows": rows, "idle_after": idle,
                   "records": {r["policy"]: r["records"] for r in results}}, f, indent=1, default=str)
    if samples:
        report.write_samples_csv(samples, os.path.join(out, "server_metrics.csv"))
    md = ["# poot-load report: convoy", "",
          f"{ccfg.requests} requests, Poisson arrivals at {ccfg.rate}/s (seed {ccfg.seed}), prompts "
          f"{ccfg.prompt.kind} {ccfg.prompt.lo}-{ccfg.prompt.hi}, outputs {ccfg.output.kind} "
          f"{ccfg.output.lo}-{ccfg.output.hi} tokens; B = {ccfg.batch}, T = {ccfg.timeout * 1e3:.0f} ms; "
          f"target `{url}`.", "", tbl, "",
          "TTFT counts from each request's arrival, so it includes time spent waiting for a group. "
          "Mean TPOT is one mean per request; ITL p99 pools every token gap. See loadtests/README.md.", "",
          "![convoy](convoy.png)", ""]
    with open(os.path.join(out, "report.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(md))
    _say(a, tbl)
    _say(a, f"server idle afterwards: {idle.get('ok')}")
    _say(a, f"report: {os.path.join(out, 'report.md')} ({os.path.basename(png)})")
    errors = sum(r["errors"] for r in rows)
    return 1 if errors or idle.get("ok") is False else 0


def rebuild_report(folder: str, a) -> int:
    """Report from per-request files alone (e.g. gathered from distributed locust workers)."""
    records = report.load_records(folder)
    if not records:
        print(f"poot-load: no requests-*.jsonl files in {folder}", file=sys.stderr)
        return 1
    slo = stats.Slo(None if a.slo_ttft_ms is None else a.slo_ttft_ms / 1e3,
                    None if a.slo_gap_p99_ms is None else a.slo_gap_p99_ms / 1e3)
    meta = {"scenario": "report", "description": f"rebuilt from {folder}", "url": a.url or "?",
            "planned_requests": len(records)}
    checks = {}
    if any(r.get("kind") == "burst" for r in records):
        checks = checks_for("long-burst", records, {"ok": None, "reason": "not checked (no server)"}, a)
        checks.pop("server idle afterwards", None)
    summary = report.write_report(folder, records, [], meta, slo, checks)
    _say(a, f"{summary['stats']['requests']} requests; report: {os.path.join(folder, 'report.md')}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serving"]:  # servers side by side: options of its own (poot-load serving --help)
        from poot.loadtests import serving

        return serving.main(argv[1:])
    a = _parser().parse_args(argv)
    a.key = api_key(a.api_key)
    if a.scenario == "list":
        for name in list(SCENARIOS) + ["convoy"]:
            print(f"{name:14s} {DESCRIPTIONS[name]}")
        return 0
    if a.scenario == "compare":
        if len(a.paths) != 2:
            print("poot-load compare A B: give two report folders", file=sys.stderr)
            return 2
        sa, sb = report.load_summary(a.paths[0]), report.load_summary(a.paths[1])
        print(report.compare(sa, sb, os.path.basename(os.path.normpath(a.paths[0])),
                             os.path.basename(os.path.normpath(a.paths[1]))))
        return 0
    if a.scenario == "report":
        if len(a.paths) != 1:
            print("poot-load report FOLDER: give one folder of requests-*.jsonl files", file=sys.stderr)
            return 2
        return rebuild_report(a.paths[0], a)
    if a.paths:
        print(f"poot-load: unexpected arguments {a.paths}", file=sys.stderr)
        return 2
    if a.scenario == "convoy":
        return run_convoy(a)
    if a.scenario not in SCENARIOS:
        print(f"poot-load: unknown scenario {a.scenario!r}; see `poot-load list`", file=sys.stderr)
        return 2
    return run_scenario(a)


if __name__ == "__main__":
    sys.exit(main())
