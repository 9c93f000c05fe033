"""How long `poot-serve` takes from its start to /health answering 200.

    .venv/bin/python benchmarks/bench_startup.py                       # SmolLM2 and synthetic, warm and cold
    .venv/bin/python benchmarks/bench_startup.py --burners 2           # each start quiet and beside 2 busy loops
    .venv/bin/python benchmarks/bench_startup.py --model default --kind warm --starts 5

Each start is a fresh `poot-serve` process; the time runs from launching it to the first 200
from /health. Printed per model and kind: every start's seconds, their median, and where the
median start spent its time (the phases its loading /health reported, as first seen by a
poll every 20 ms).

    warm   the caches filled: the user's own (the float32 model cache and numba's, wherever
           the environment puts them), after one start that is not counted and fills them
    cold   nothing reused: every start gets an empty XDG_CACHE_HOME and NUMBA_CACHE_DIR of its
           own (a first start after a fresh install)

With `--burners N`, each start is run twice in turn, alone and beside N processes spinning
on a core each (`python3 -c 'while True: pass'`, the kind of neighbour a shared CI runner or a
build gives), and the table adds their medians' ratio. The machine's CPU, its flags that
the CPU driver's kernels look for, and the load average before and after are printed with
the table: timings from a machine that was busy with something else are noise.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

# The flags that decide which kernels and products the CPU driver can run.
FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni",
         "avx512_bf16", "amx_int8")
PHASES = ("model", "compile", "measure", "warm_up")


def poot_serve() -> list[str]:
    exe = Path(sys.executable).parent / "poot-serve"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "poot.server.cli"]


def cpu() -> tuple[str, list[str], int]:
    """The CPU's model name, which of FLAGS it has, and the cores this process may use."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    have = set(info.get("flags", "").split())
    name = info.get("model name") or platform.processor() or platform.machine()
    return name, [flag for flag in FLAGS if flag in have], len(os.sched_getaffinity(0))


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_once(model: str, env: dict, backend: str, timeout: float) -> tuple[float, dict[str, float], dict]:
    """Seconds from launch to /health 200, when each loading phase was first seen, and the
    plan /health published."""
    port = free_port()
    args = [*poot_serve(), "--port", str(port), "--log-level", "warning", "--backend", backend]
    if model != "default":
        args += ["--model", model]
    log = tempfile.TemporaryFile()
    began = time.perf_counter()
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
    seen: dict[str, float] = {"launch": 0.0}  # until the first loading answer: imports, the socket
    try:
        with httpx.Client(timeout=2.0) as client:
            while True:
                if proc.poll() is not None:
                    log.seek(0)
                    tail = log.read().decode(errors="replace")[-2000:]
                    raise RuntimeError(f"poot-serve exited with {proc.returncode} before it was ready:\n{tail}")
                try:
                    r = client.get(f"http://127.0.0.1:{port}/health")
                    if r.status_code == 200:
                        return time.perf_counter() - began, seen, r.json().get("plan", {})
                    phase = r.json().get("phase")
                    if phase in PHASES and phase not in seen:
                        seen[phase] = time.perf_counter() - began
                except (httpx.HTTPError, ValueError):
                    pass
                if time.perf_counter() - began > timeout:
                    raise RuntimeError(f"poot-serve was not ready within {timeout:.0f} s")
                time.sleep(0.02)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


class Burners:
    """N processes spinning on a core each, for as long as the block runs."""

    def __init__(self, n: int):
        self.n, self.procs = n, []

    def __enter__(self):
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.n)]
        time.sleep(0.5)  # let the scheduler spread them
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()


def environment(kind: str, scratch: Path) -> dict:
    env = dict(os.environ)
    if kind == "cold":
        fresh = Path(tempfile.mkdtemp(prefix="cold-", dir=scratch))
        env["XDG_CACHE_HOME"] = str(fresh / "cache")
        env["NUMBA_CACHE_DIR"] = str(fresh / "numba")
        env.pop("POOT_CACHE_DIR", None)  # it would override XDG_CACHE_HOME for the model cache
    return env


def phases_of(seen: dict[str, float], total: float) -> str:
    marks = sorted(seen.items(), key=lambda kv: kv[1])
    parts = []
    for i, (phase, at) in enumerate(marks):
        end = marks[i + 1][1] if i + 1 < len(marks) else total
        parts.append(f"{phase} {end - at:.1f}")
    return ", ".join(parts)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", help="default (SmolLM2) and/or synthetic (default: both)")
    p.add_argument("--kind", action="append", choices=("warm", "cold"), help="default: both")
    p.add_argument("--starts", type=int, default=3, help="timed starts per model and kind (default 3)")
    p.add_argument("--burners", type=int, default=0, help="also time each start beside N CPU-bound processes")
    p.add_argument("--backend", default="auto", help="poot-serve's --backend (default auto)")
    p.add_argument("--timeout", type=float, default=900, help="most seconds one start may take")
    args = p.parse_args()
    models = args.model or ["default", "synthetic"]
    kinds = args.kind or ["warm", "cold"]
    conditions = ["quiet", f"beside {args.burners}"] if args.burners else ["quiet"]

    name, flags, cores = cpu()
    print(f"CPU: {name}, {cores} cores; flags: {' '.join(flags) or 'none of ' + ' '.join(FLAGS)}")
    print(f"load average before: {load_average()}", flush=True)
    rows = []
    scratch = Path(tempfile.mkdtemp(prefix="poot-bench-startup-"))
    try:
        for model in models:
            for kind in kinds:
                if kind == "warm":
                    took, _, _ = start_once(model, environment(kind, scratch), args.backend, args.timeout)
                    print(f"  {model} warm: a first start to fill the caches took {took:.1f} s", flush=True)
                times: dict[str, list[tuple[float, dict, dict]]] = {c: [] for c in conditions}
                for i in range(args.starts):
                    for condition in conditions:
                        env = environment(kind, scratch)
                        with Burners(args.burners if condition != "quiet" else 0):
                            took, seen, plan = start_once(model, env, args.backend, args.timeout)
                        times[condition].append((took, seen, plan))
                        print(f"  {model} {kind} {condition} start {i + 1}/{args.starts}: {took:.1f} s "
                              f"({phases_of(seen, took)})", flush=True)
                rows.append((model, kind, times))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    print(f"\nload average after: {load_average()}")
    print(f"\nSeconds from launching poot-serve to /health 200 ({platform.node()}; {name}, {cores} cores)\n")
    head = "| model | caches | " + " | ".join(f"{c}: starts | {c}: median" for c in conditions)
    head += " | ratio |" if len(conditions) > 1 else " |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for model, kind, times in rows:
        cells, medians = [], []
        for condition in conditions:
            seconds = [t for t, _, _ in times[condition]]
            median = statistics.median(seconds)
            medians.append(median)
            cells += [", ".join(f"{t:.1f}" for t in seconds), f"**{median:.1f}**"]
        ratio = [f"{medians[1] / medians[0]:.2f}"] if len(medians) > 1 else []
        print(f"| {model} | {kind} | " + " | ".join(cells + ratio) + " |")
    print("\nWhere the median start spent its time (seconds per phase of its loading /health):")
    for model, kind, times in rows:
        for condition in conditions:
            ordered = sorted(times[condition], key=lambda ts: ts[0])
            took, seen, _ = ordered[len(ordered) // 2]
            print(f"  {model} {kind} {condition}: {took:.1f} s = {phases_of(seen, took)}")
    print_choices(rows, conditions)
    return 0


def print_choices(rows, conditions) -> None:
    """Each start's product choice (the CPU driver's, from /health's plan), side by side by
    condition: how it was made (measured, preferred, cached) and its table."""
    for model, kind, times in rows:
        plans = {c: [plan for _, _, plan in times[c]] for c in conditions}
        if not any(plan.get("products") for c in conditions for plan in plans[c]):
            continue
        print(f"\nProduct choices, {model} {kind} (first start of each condition; every start's origin):")
        for c in conditions:
            print(f"  {c}: " + ", ".join(plan.get("products_chosen") or "-" for plan in plans[c]))
        firsts = [plans[c][0].get("products") or [] for c in conditions]
        width = max((len(line) for table in firsts for line in table), default=0)
        print("  " + " | ".join(c.ljust(width) for c in conditions))
        for lines in zip(*firsts, strict=False):
            print("  " + " | ".join(line.ljust(width) for line in lines))


if __name__ == "__main__":
    sys.exit(main())
