"""The serving benchmark's tables: per server and level, and each server's figures over the
first server's."""

from __future__ import annotations

import json
from pathlib import Path

from poot.loadtests.closed_loop import GAP_RATIO_TARGET
from poot.loadtests.step_metrics import STEP_KINDS


def _ms(x, digits=1) -> str:
    return "-" if x is None else f"{x * 1e3:.{digits}f}"


def _x(x, digits=2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def line(s: dict) -> str:
    it = s["itl"]
    return (f"{s['requests']['measured']} measured, {s['errors']} errors; {_x(s['out_tok_s'], 1)} tok/s; "
            f"TTFT p50 {_ms(s['ttft']['p50'])} ms; ITL p50 {_ms(it['p50'], 2)} / p99 {_ms(it['p99'], 2)} / "
            f"max {_ms(it['max'])} ms; worst max/median gap {_x(s['gap_ratio']['worst'], 1)}x")


def _goodput(g: dict | None) -> str:
    """Requests a second that met the targets, and how many of the measured did."""
    if not g:
        return "-"
    return f"{_x(g['req_s'], 3)} ({g['met']}/{g['of']})"


def _mix(cfg: dict) -> str:
    """The prompts' lengths as configured (runs before the mixes: 22-186 tokens)."""
    lo, hi = cfg.get("prompt_tokens_target") or (22, 186)
    return (f"the {cfg['mix']} mix, " if cfg.get("mix") else "") + f"{lo}-{hi} tokens"


def _goodput_rule(cfg: dict) -> str:
    g = cfg.get("goodput")
    if not g:
        return ""
    return (f" Goodput: measured requests a second with TTFT at most {g['ttft_s'] * 1e3:g} ms and a mean gap "
            f"between tokens at most {g['itl_s'] * 1e3:g} ms (met / measured).")


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
                        "prompt_tok_s": _ratio(lv.get("prompt_tok_s"), o.get("prompt_tok_s")),
                        "ttft_p50": _ratio(lv["ttft"]["p50"], o["ttft"]["p50"]),
                        "e2e_p50": _ratio(lv["e2e"]["p50"], o["e2e"]["p50"]),
                        "itl_p50": _ratio(lv["itl"]["p50"], o["itl"]["p50"]),
                        "itl_p99": _ratio(lv["itl"]["p99"], o["itl"]["p99"]),
                        "itl_max": _ratio(lv["itl"]["max"], o["itl"]["max"])})
    return out


def markdown(result: dict) -> str:
    cfg = result["config"]
    servers = [s for s in result["servers"] if s.get("levels")]
    lines = ["## Serving, side by side", "",
             f"Closed loop, C workers each sending its next request when its last one ends; {cfg['prompts']} "
             f"distinct English prompts (seed {cfg['seed']}; {_mix(cfg)}), {cfg['max_tokens']} output tokens each "
             f"(ignore_eos, temperature 0, streamed), /v1/completions; per level "
             + (f"{cfg['warmup'] if cfg['warmup'] is not None else 'C'} warm-up requests excluded, then "
                f"{cfg['requests'] if cfg['requests'] is not None else 'max(8, 2C)'} measured"
                if cfg["seconds"] is None else f"warm-up excluded, then {cfg['seconds']:.0f} s measured")
             + ". Times in ms; ratios are the first server's figure over the other's (tok/s: above 1 is "
               "faster; times: below 1 is faster)." + _goodput_rule(cfg), "",
             "| C | server | out tok/s | prompt tok/s | TTFT p50 | E2E p50 | ITL p50 / p99 / max | max/median gap "
             "(worst stream) | goodput | errors |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    by_c: dict[int, list] = {}
    for s in servers:
        for lv in s["levels"]:
            by_c.setdefault(lv["concurrency"], []).append((s["name"], lv))
    rat = {(r["concurrency"], r["other"]): r for r in ratios(result)}
    for c in sorted(by_c):
        for name, lv in by_c[c]:
            it = lv["itl"]
            lines.append(f"| {c} | {name} | {_x(lv['out_tok_s'], 1)} | {_x(lv.get('prompt_tok_s'), 1)} | "
                         f"{_ms(lv['ttft']['p50'])} | {_ms(lv['e2e']['p50'])} | "
                         f"{_ms(it['p50'], 2)} / {_ms(it['p99'], 2)} / {_ms(it['max'])} | "
                         f"{_x(lv['gap_ratio']['worst'], 1)} | {_goodput(lv.get('goodput'))} | {lv['errors']} |")
        for name, _ in by_c[c][1:]:
            r = rat.get((c, name))
            if r:
                lines.append(f"| {c} | {r['base']} / {name} | {_x(r['out_tok_s'])} | {_x(r.get('prompt_tok_s'))} | "
                             f"{_x(r['ttft_p50'])} | {_x(r['e2e_p50'])} | "
                             f"{_x(r['itl_p50'])} / {_x(r['itl_p99'])} / {_x(r['itl_max'])} "
                             "| | | |")
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
    lines += _memory(servers, by_c)
    for s in result["servers"]:
        if s.get("error"):
            lines += ["", f"**{s['name']}** failed: {s['error']}"]
        for lv in s.get("levels", []):
            if lv["error_kinds"]:
                lines.append(f"- {s['name']} C={lv['concurrency']} errors: "
                             + "; ".join(f"{k} (x{v})" for k, v in lv["error_kinds"].items()))
    lines.append("")
    return "\n".join(lines)




def _memory(servers: list[dict], by_c: dict) -> list[str]:
    """Each started server's resident memory (from /proc, once a second): at healthy, its peak
    in each level, and output tokens/s per GB of that peak. Runs without it: nothing."""
    if not any(s.get("rss_healthy_bytes") for s in servers):
        return []
    lines = ["", "### Memory", "",
             "Resident memory of each server started by the run, its processes together (/proc, sampled once a "
             "second): at healthy, "
             "then each level's peak, with the level's output tokens/s per GB of that peak.", "",
             "| C | server | resident at healthy (GB) | peak in the level (GB) | out tok/s per GB |",
             "|---:|---|---:|---:|---:|"]
    for c in sorted(by_c):
        for name, lv in by_c[c]:
            server = next(s for s in servers if s["name"] == name)
            healthy, peak = server.get("rss_healthy_bytes"), lv.get("rss_peak_bytes")
            per_gb = (lv["out_tok_s"] / (peak / 1e9)) if peak and lv["out_tok_s"] is not None else None
            lines.append(f"| {c} | {name} | {_x(healthy and healthy / 1e9)} | {_x(peak and peak / 1e9)} | "
                         f"{_x(per_gb, 1)} |")
    return lines


PAGE_COMMAND = "poot-load serving --page docs/results/serving.md"


def _command(command: str | None) -> str:
    """A server's command with each path cut to its last part: the page names no machine's folders."""
    if not command:
        return "-"
    words = (w.rsplit("/", 1)[-1] if "/" in w and not w.startswith("http") else w for w in command.split())
    return "`" + " ".join(words).replace("`", "'").replace("|", "\\|") + "`"


def _version(server: dict) -> str:
    info = server.get("info") or {}
    return str(info.get("build_info") or info.get("version") or "-")


def run_section(name: str, result: dict) -> list[str]:
    """One committed run: when, on what, at which commit, which servers with which commands,
    then its tables."""
    cpu = result.get("cpu") or {}
    flags = ", ".join(cpu.get("flags") or []) or "-"
    lines = [f"## {name}", "",
             f"Run {result.get('started') or '-'}; poot commit {result.get('commit') or '-'}; CPU "
             f"{cpu.get('model') or '-'} ({cpu.get('cpus') or result.get('cpus') or '-'} CPUs; {flags}).", "",
             "| server | version | command |", "|---|---|---|"]
    lines += [f"| {s['name']} | {_version(s)} | {_command(s.get('command') or s.get('url'))} |"
              for s in result["servers"]]
    tables = markdown(result).splitlines()[2:]  # its own title is this section's
    return lines + [""] + [("#" + t if t.startswith("### ") else t) for t in tables]


def page(folder: Path) -> str:
    """docs/results/serving.md: every FOLDER/<run>/serving.json, in the runs' folder names' order."""
    runs = sorted(folder.glob("*/serving.json"))
    lines = ["# Serving, side by side", "",
             f"Written by `{PAGE_COMMAND}` from the runs committed under `{folder.name}/<run>/serving.json`; a "
             "test fails when this page differs from what the command writes, so rewrite it rather than edit it.", ""]
    for path in runs:
        lines += run_section(path.parent.name, json.loads(path.read_text()))
    if not runs:
        lines.append("No run is committed yet.")
    return "\n".join(lines).rstrip("\n") + "\n"
