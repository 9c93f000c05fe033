"""Report folder: JSON summary, Markdown report, PNG plots, and side-by-side comparison."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from poot.loadtests import stats  # noqa: E402


def load_records(folder: str) -> list[dict]:
    recs: list[dict] = []
    for name in sorted(os.listdir(folder)):
        if name.startswith("requests-") and name.endswith(".jsonl"):
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                recs.extend(json.loads(line) for line in f if line.strip())
    recs.sort(key=lambda r: (r.get("t_sent") or 0, r.get("id", 0)))
    return recs


def server_summary(samples: Sequence[dict]) -> dict:
    if not samples:
        return {"available": False}

    def peak(name):
        vals = [s[name] for s in samples if name in s]
        return max(vals) if vals else None

    def last(name):
        vals = [s[name] for s in samples if name in s]
        return vals[-1] if vals else None

    def delta(name):
        vals = [s[name] for s in samples if name in s]
        return (vals[-1] - vals[0]) if len(vals) >= 2 else None

    drafted, accepted = delta("spec_drafted_tokens_total"), delta("spec_accepted_tokens_total")
    queried, hits = delta("prefix_cache_queried_tokens_total"), delta("prefix_cache_hit_tokens_total")
    return {
        "available": True,
        "samples": len(samples),
        "peak_running": peak("engine_requests_running"),
        "peak_waiting": peak("engine_requests_waiting"),
        "peak_kv_in_use": peak("kv_blocks_in_use"),
        "peak_kv_reserved": peak("kv_blocks_reserved"),
        "kv_blocks_total": last("kv_blocks_total"),
        "prefix_cache_hit_rate_last": last("prefix_cache_hit_rate"),
        # This run only (the gauge above is cumulative since the server started).
        "prefix_hit_rate_run": (hits / queried) if queried else None,
        "steps": delta("engine_steps_total"),
        "generation_tokens": delta("generation_tokens_total"),
        "prompt_tokens": delta("prompt_tokens_total"),
        "spec_drafted": drafted,
        "spec_accepted": accepted,
        "spec_acceptance": (accepted / drafted) if drafted else None,
        "compiles_last": last("engine_compiles"),
    }


def build_summary(records: Sequence[dict], samples: Sequence[dict], meta: dict, slo: stats.Slo,
                  checks: dict | None = None) -> dict:
    summary = {**meta, "stats": stats.summarize(records, slo), "server": server_summary(samples),
               "checks": checks or {}}
    kinds = sorted({r.get("kind", "main") for r in records})
    if len(kinds) > 1:
        summary["by_kind"] = {k: stats.summarize([r for r in records if r.get("kind") == k], slo)
                              for k in kinds}
    cached = [r.get("cached_tokens") for r in records if r.get("cached_tokens") is not None]
    prompt = [r.get("prompt_tokens") for r in records if r.get("prompt_tokens") is not None]
    summary["usage"] = {"prompt_tokens": sum(prompt) if prompt else None,
                        "cached_tokens": sum(cached) if cached else None,
                        "requests_with_usage": len(prompt)}
    return summary


# ---------------------------------------------------------------- plots
def _legend(ax, **kw) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kw)


def _ms(xs):
    return [x * 1e3 for x in xs]


def plot_latency(records: Sequence[dict], path: str, slo: stats.Slo | None = None) -> str:
    ok = [r for r in records if r.get("status") == "ok"]
    ttft = [r["chunks"][0] for r in ok if r.get("chunks")]
    all_gaps = [g for r in ok for g in stats.gaps(r.get("chunks") or [])]
    req_max = [max(stats.gaps(r["chunks"])) for r in ok if len(r.get("chunks") or []) > 1]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    if ttft:
        a.step(*stats.cdf(_ms(ttft)), where="post", label=f"TTFT (n={len(ttft)})")
    if slo and slo.ttft_s:
        a.axvline(slo.ttft_s * 1e3, color="red", ls="--", lw=1, label="TTFT objective")
    a.set_xlabel("time to first token (ms)")
    a.set_ylabel("share of requests")
    a.set_title("TTFT")
    a.grid(alpha=0.3)
    _legend(a, loc="lower right")
    if all_gaps:
        b.step(*stats.cdf(_ms(all_gaps)), where="post", label=f"every gap (n={len(all_gaps)})")
    if req_max:
        b.step(*stats.cdf(_ms(req_max)), where="post", label=f"largest gap per request (n={len(req_max)})")
    if slo and slo.gap_p99_s:
        b.axvline(slo.gap_p99_s * 1e3, color="red", ls="--", lw=1, label="p99 gap objective")
    if all_gaps and min(all_gaps) > 0:
        b.set_xscale("log")
    b.set_xlabel("inter-token gap (ms)")
    b.set_title("Token-level gaps")
    b.grid(alpha=0.3, which="both")
    _legend(b, loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def in_flight_series(records: Sequence[dict], t0: float, step: float = 0.25) -> tuple[list[float], list[int]]:
    spans = [(r["t_sent"] - t0, r["t_sent"] - t0 + (r.get("end") or 0)) for r in records if r.get("t_sent")]
    if not spans:
        return [], []
    end = max(e for _, e in spans)
    xs, ys, t = [], [], 0.0
    while t <= end + step and len(xs) < 100000:
        xs.append(t)
        ys.append(sum(1 for s, e in spans if s <= t < e))
        t += step
    return xs, ys


def plot_timeline(records: Sequence[dict], samples: Sequence[dict], path: str) -> str:
    starts = [r["t_sent"] for r in records if r.get("t_sent")]
    t0 = min(starts + [s["t"] for s in samples]) if (starts or samples) else 0.0
    has_server = bool(samples)
    n = 4 if has_server else 2
    fig, axes = plt.subplots(n, 1, figsize=(10, 2.3 * n + 0.6), sharex=True)
    xs, ys = stats.token_throughput_series(records, t0, 1.0)
    axes[0].plot(xs, ys, drawstyle="steps-mid", color="tab:blue")
    axes[0].set_ylabel("output tok/s")
    axes[0].set_title("Throughput and queue over time")
    fx, fy = in_flight_series(records, t0)
    axes[1].plot(fx, fy, drawstyle="steps-post", color="gray", label="client: in flight")
    if has_server:
        t = [s["t"] - t0 for s in samples]
        for name, color in (("engine_requests_running", "tab:green"), ("engine_requests_waiting", "tab:orange")):
            if any(name in s for s in samples):
                axes[1].plot(t, [s.get(name, float("nan")) for s in samples], color=color,
                             label="server: " + name.split("_")[-1])
        for name, color in (("kv_blocks_reserved", "tab:purple"), ("kv_blocks_in_use", "tab:red"),
                            ("kv_blocks_cached", "tab:gray")):
            if any(name in s for s in samples):
                axes[2].plot(t, [s.get(name, float("nan")) for s in samples], color=color,
                             label=name.replace("kv_blocks_", ""))
        total = [s["kv_blocks_total"] for s in samples if "kv_blocks_total" in s]
        if total:
            axes[2].axhline(total[-1], color="black", lw=0.8, ls=":", label="total")
        axes[2].set_ylabel("KV blocks")
        _legend(axes[2], loc="upper right", fontsize=8)
        if any("prefix_cache_hit_rate" in s for s in samples):
            axes[3].plot(t, [s.get("prefix_cache_hit_rate", float("nan")) for s in samples], color="tab:cyan")
        axes[3].set_ylabel("prefix hit rate")
        axes[3].set_ylim(-0.02, 1.02)
    axes[1].set_ylabel("requests")
    _legend(axes[1], loc="upper right", fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("seconds since start")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_rss(mem: dict, path: str) -> str:
    """The server's RSS over the run, the end of warm-up, and the least-squares line after it."""
    series = mem.get("series") or []
    fig, ax = plt.subplots(figsize=(10, 3.6))
    if series:
        t0 = series[0][0]
        ax.plot([t - t0 for t, _ in series], [v / 1e6 for _, v in series], color="tab:blue", lw=1,
                label=f"RSS ({mem.get('source') or '?'})")
        warm = t0 + mem.get("warmup_s", 0.0)
        ax.axvline(warm - t0, color="gray", ls="--", lw=1, label="end of warm-up")
        slope = mem.get("slope_mb_per_min")
        end = mem.get("t_load_end", series[-1][0])
        after = [(t, v) for t, v in series if warm <= t <= end]
        if slope is not None and len(after) >= 2:
            mt = sum(t for t, _ in after) / len(after)
            mv = sum(v for _, v in after) / len(after) / 1e6
            xs = [after[0][0], after[-1][0]]
            ax.plot([x - t0 for x in xs], [mv + slope * (x - mt) / 60 for x in xs], color="tab:red", lw=1.5,
                    label=f"fit after warm-up: {slope:+.2f} MB/min")
    ax.set_xlabel("seconds since the server was ready")
    ax.set_ylabel("resident memory (MB)")
    ax.set_title("Server resident memory")
    ax.grid(alpha=0.3)
    _legend(ax, loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_convoy(results: Sequence[dict], samples: Sequence[dict], path: str) -> str:
    """TTFT CDF per policy, and the server's running requests during each phase."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for res in results:
        ok = [r for r in res["records"] if r["status"] == "ok" and r["chunks"]]
        ttft = [r["t_sent"] - r["t_arrival"] + r["chunks"][0] for r in ok]
        if ttft:
            a.step(*stats.cdf(ttft), where="post", label=res["policy"])
        phase = [s for s in samples if res["wall_start"] <= s["t"] <= res["wall_start"] + res["t_end"] - res["t0"]]
        if phase and any("engine_requests_running" in s for s in phase):
            b.plot([s["t"] - res["wall_start"] for s in phase],
                   [s.get("engine_requests_running", float("nan")) for s in phase], label=res["policy"])
        else:
            fx, fy = in_flight_series([{"t_sent": r["t_sent"], "end": r["end"]} for r in res["records"]],
                                      res["t0"], 0.1)
            b.plot(fx, fy, drawstyle="steps-post", label=res["policy"] + " (client in flight)")
    a.set_xlabel("TTFT from arrival (s)")
    a.set_ylabel("share of requests")
    a.set_title("TTFT, including wait for a group")
    b.set_xlabel("seconds since phase start")
    b.set_ylabel("requests running on the server")
    b.set_title("Running requests (convoys drain to zero)")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        _legend(ax, loc="lower right" if ax is a else "upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------- markdown
def _f(x, scale=1.0, digits=1):
    return "-" if x is None else f"{x * scale:.{digits}f}"


def _pct(x):
    return "-" if x is None else f"{x:.0%}"


def _row(name, d, scale=1e3, digits=1):
    return (f"| {name} | {d['count']} | {_f(d['p50'], scale, digits)} | {_f(d['p90'], scale, digits)} | "
            f"{_f(d['p95'], scale, digits)} | {_f(d['p99'], scale, digits)} | {_f(d['max'], scale, digits)} |")


def markdown(summary: dict, plots: Sequence[str] = ()) -> str:
    st = summary["stats"]
    cfg = summary.get("config", {})
    lines = [f"# poot-load report: {summary.get('scenario', '?')}", ""]
    lines += [f"- target: `{summary.get('url', '?')}`  started: {summary.get('started', '?')}",
              f"- workload: {summary.get('description', '')}",
              f"- seed {cfg.get('seed')}, {cfg.get('mode')} loop, rate {cfg.get('rate')}/s, "
              f"concurrency {cfg.get('concurrency')}, requests {summary.get('planned_requests')}", ""]
    lines += ["## Outcome", "",
              "| requests | ok | errors | left on purpose | duration (s) | req/s | output tok/s | goodput |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|",
              f"| {st['requests']} | {st['ok']} | {st['errors']} | {st['disconnected']} | "
              f"{_f(st['duration_s'], 1, 1)} | {_f(st['request_throughput'], 1, 2)} | "
              f"{_f(st['output_throughput'], 1, 0)} | "
              f"{_pct(st['goodput'])} |", ""]
    slo = st["slo"]
    lines.append(f"Goodput: share of requests (not counting clients that left on purpose) that finished with TTFT <= {_f(slo['ttft_ms'], 1, 0)} ms "
                 f"and p99 token gap <= {_f(slo['gap_p99_ms'], 1, 0)} ms ('-' = not constrained).")
    if st["error_kinds"]:
        lines += ["", "Errors: " + "; ".join(f"{k} (x{v})" for k, v in st["error_kinds"].items())]
    lines += ["", "## Latency (ms)", "", "| metric | n | p50 | p90 | p95 | p99 | max |", "|---|---:|---:|---:|---:|---:|---:|",
              _row("TTFT", st["ttft"]), _row("TPOT (mean per request)", st["tpot"]),
              _row("token gap (every gap)", st["itl"]), _row("p99 gap per request", st["req_gap_p99"]),
              _row("largest gap per request", st["req_gap_max"]), _row("end-to-end", st["e2e"]),
              _row("client schedule lag", st["schedule_lag"])]
    for key, name in (("queue_time", "server: queued for a row"), ("prefill_time", "server: prefill to first token")):
        if st.get(key, {}).get("count"):
            lines.append(_row(name, st[key]))
    lines.append("")
    tps = st["req_tokens_per_s"]
    lines.append(f"Output tokens/s per request: p50 {_f(tps['p50'], 1, 1)}, p95 {_f(tps['p95'], 1, 1)}.")
    if "by_kind" in summary:
        lines += ["", "### By request kind", "", "| kind | n | ok | TTFT p50 | TTFT p99 | TPOT p50 | gap p99 | gap max |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for k, s in summary["by_kind"].items():
            lines.append(f"| {k} | {s['requests']} | {s['ok']} | {_f(s['ttft']['p50'], 1e3)} | {_f(s['ttft']['p99'], 1e3)} | "
                         f"{_f(s['tpot']['p50'], 1e3)} | {_f(s['itl']['p99'], 1e3)} | {_f(s['itl']['max'], 1e3)} |")
    sv = summary.get("server", {})
    lines += ["", "## Server (/metrics)", ""]
    if sv.get("available"):
        lines += [f"- samples: {sv['samples']}; peak running {_f(sv['peak_running'], 1, 0)}, "
                  f"peak waiting {_f(sv['peak_waiting'], 1, 0)}",
                  f"- KV blocks: peak in use {_f(sv['peak_kv_in_use'], 1, 0)}, peak reserved "
                  f"{_f(sv['peak_kv_reserved'], 1, 0)} of {_f(sv['kv_blocks_total'], 1, 0)}",
                  f"- prefix cache hit rate: gauge at the end {_f(sv['prefix_cache_hit_rate_last'], 1, 3)}, "
                  f"this run {_f(sv.get('prefix_hit_rate_run'), 1, 3)} (from the hit/queried token counters)",
                  f"- engine steps {_f(sv['steps'], 1, 0)}, generated tokens {_f(sv['generation_tokens'], 1, 0)}",
                  ]
        if sv.get("spec_drafted"):
            lines.append(f"- speculative: drafted {sv['spec_drafted']:.0f}, accepted {sv['spec_accepted']:.0f} "
                         f"({_f(sv['spec_acceptance'], 100, 1)}%)")
    else:
        lines.append("No /metrics endpoint answered; server-side series are missing.")
    us = summary.get("usage", {})
    if us.get("cached_tokens") is not None:
        lines.append(f"- usage: {us['cached_tokens']} of {us['prompt_tokens']} prompt tokens served from cache")
    mem = summary.get("memory")
    if mem:
        lines += ["", "## Server resident memory", ""]
        if mem.get("available"):
            lines += ["| start (MB) | after warm-up (MB) | end (MB) | peak (MB) | warm-up (s) | window (s) | "
                      "slope after warm-up (MB/min) | bound (MB/min) | source |",
                      "|---:|---:|---:|---:|---:|---:|---:|---:|---|",
                      f"| {_f(mem['start_mb'])} | {_f(mem['warmup_mb'])} | {_f(mem['end_mb'])} | "
                      f"{_f(mem['peak_mb'])} | {_f(mem['warmup_s'], 1, 0)} | {_f(mem['window_s'], 1, 0)} | "
                      f"{_f(mem['slope_mb_per_min'], 1, 3)} | {mem['limit_mb_per_min']} | {mem['source']} |", "",
                      f"{mem['samples']} samples. The slope is the least-squares line through the samples "
                      f"after warm-up; it is judged against the bound when that window spans at least "
                      f"{mem['min_window_s']:.0f} s, and reported otherwise."]
        else:
            lines.append(mem.get("text", "no RSS source"))
    checks = summary.get("checks") or {}
    if checks:
        lines += ["", "## Checks", ""]
        for name, c in checks.items():
            verdict = {True: "PASS", False: "FAIL", None: "n/a"}[c.get("ok")]
            lines.append(f"- **{name}**: {verdict} - {c.get('text', '')}")
    if plots:
        lines += ["", "## Plots", ""]
        lines += [f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in plots]
    lines.append("")
    return "\n".join(lines)


def write_report(folder: str, records: Sequence[dict], samples: Sequence[dict], meta: dict,
                 slo: stats.Slo, checks: dict | None = None, memory: dict | None = None) -> dict:
    """`memory` (the soak): memory.summarize's figures plus "series" (wall time, bytes)."""
    os.makedirs(folder, exist_ok=True)
    summary = build_summary(records, samples, meta, slo, checks)
    plots = [plot_latency(records, os.path.join(folder, "latency_cdf.png"), slo),
             plot_timeline(records, samples, os.path.join(folder, "timeline.png"))]
    if memory is not None:
        summary["memory"] = memory
        if memory.get("available"):
            plots.append(plot_rss(memory, os.path.join(folder, "rss.png")))
    if samples:
        write_samples_csv(samples, os.path.join(folder, "server_metrics.csv"))
    with open(os.path.join(folder, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2, default=str)
    with open(os.path.join(folder, "report.md"), "w", encoding="utf-8") as f:
        f.write(markdown(summary, plots))
    return summary


def write_samples_csv(samples: Sequence[dict], path: str) -> None:
    keys = ["t"] + sorted({k for s in samples for k in s if k != "t"})
    with open(path, "w", encoding="utf-8") as f:
        f.write(",".join(keys) + "\n")
        for s in samples:
            f.write(",".join("" if s.get(k) is None else repr(s[k]) for k in keys) + "\n")


# ---------------------------------------------------------------- compare
COMPARE_ROWS = [
    ("requests", ("stats", "requests"), 1, 0), ("ok", ("stats", "ok"), 1, 0),
    ("errors", ("stats", "errors"), 1, 0),
    ("output tok/s", ("stats", "output_throughput"), 1, 1), ("req/s", ("stats", "request_throughput"), 1, 2),
    ("goodput %", ("stats", "goodput"), 100, 1),
    ("TTFT p50 ms", ("stats", "ttft", "p50"), 1e3, 1), ("TTFT p95 ms", ("stats", "ttft", "p95"), 1e3, 1),
    ("TTFT p99 ms", ("stats", "ttft", "p99"), 1e3, 1),
    ("TPOT p50 ms", ("stats", "tpot", "p50"), 1e3, 2), ("TPOT p95 ms", ("stats", "tpot", "p95"), 1e3, 2),
    ("gap p50 ms", ("stats", "itl", "p50"), 1e3, 2), ("gap p99 ms", ("stats", "itl", "p99"), 1e3, 2),
    ("gap max ms", ("stats", "itl", "max"), 1e3, 1),
    ("E2E p50 ms", ("stats", "e2e", "p50"), 1e3, 0), ("E2E p95 ms", ("stats", "e2e", "p95"), 1e3, 0),
    ("peak running", ("server", "peak_running"), 1, 0), ("peak waiting", ("server", "peak_waiting"), 1, 0),
    ("peak KV reserved", ("server", "peak_kv_reserved"), 1, 0),
    ("prefix hit rate (gauge)", ("server", "prefix_cache_hit_rate_last"), 1, 3),
    ("prefix hit rate (run)", ("server", "prefix_hit_rate_run"), 1, 3),
]


def _get(d, path):
    for k in path:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def compare(a: dict, b: dict, name_a: str = "A", name_b: str = "B") -> str:
    lines = [f"| metric | {name_a} | {name_b} | change |", "|---|---:|---:|---:|"]
    for label, path, scale, digits in COMPARE_ROWS:
        va, vb = _get(a, path), _get(b, path)
        change = "-"
        if isinstance(va, int | float) and isinstance(vb, int | float) and va:
            change = f"{(vb - va) / abs(va):+.0%}"
        lines.append(f"| {label} | {_f(va, scale, digits)} | {_f(vb, scale, digits)} | {change} |")
    for name in sorted(set(a.get("checks", {})) | set(b.get("checks", {}))):
        ca, cb = a.get("checks", {}).get(name, {}), b.get("checks", {}).get(name, {})
        v = {True: "PASS", False: "FAIL", None: "n/a"}
        lines.append(f"| check: {name} | {v[ca.get('ok')]} | {v[cb.get('ok')]} | |")
    return "\n".join(lines)


def load_summary(path: str) -> dict:
    if os.path.isdir(path):
        path = os.path.join(path, "summary.json")
    with open(path, encoding="utf-8") as f:
        return json.load(f)
