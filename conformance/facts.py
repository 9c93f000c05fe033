"""What the suite knows about the server under test, and where each fact came from.

A clause's test asks for the facts it needs (`facts.need("rows", "positions")`); a fact that
cannot be had ends the clause "not supported" with the fact's name. Facts come, in this order,
from the user (a facts file, `--fact NAME=VALUE`), from what the server publishes (its kind is
detected: poot's /health plan and metric names, llama.cpp's /props and `llamacpp:*` metrics,
vLLM's `vllm:*` metrics and /v1/models), from the command line that started it, or are
measured from outside by timing. The report lists every fact a test used, with its source.
"""

from __future__ import annotations

import json
import shlex
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from . import prometheus
from .kind import Look, get_json
from .outcomes import NotSupported

FACTS_KEY = pytest.StashKey["Facts"]()

# name -> what it is (shown when a clause lacks it)
FACTS: dict[str, str] = {
    "kind": "the server's kind: poot, llamacpp, vllm or openai (nothing beyond the OpenAI API)",
    "rows": "requests that run at once (poot's rows, llama.cpp's slots, vLLM's max_num_seqs)",
    "positions": "positions (prompt and output tokens) one request may hold",
    "block_size": "tokens per KV block, for a server with paged KV blocks",
    "token_budget": "tokens one engine step may feed beside decoding rows",
    "idle_token_budget": "prompt tokens one engine step may feed with no row decoding",
    "reservation": "how a request's room is reserved: per_block (paged KV for its whole max_tokens at open), "
                   "per_slot (a fixed context per row) or on_demand (paged KV allocated as tokens come)",
    "steps": "a counter of engine steps on /metrics",
    "running": "a gauge of running requests on /metrics",
    "waiting": "a gauge of waiting (queued) requests on /metrics",
    "kv_blocks": "KV block gauges on /metrics (kv_blocks_total, kv_blocks_reserved, kv_blocks_in_use)",
    "cancelled_counter": 'a counter of cancelled requests on /metrics (requests_finished_total{reason="cancelled"})',
    "prefix_metrics": "prefix-cache metrics on /metrics (prefix_registered_tokens)",
    "prefix_hits": "a counter of prompt tokens served from the prefix cache on /metrics (prefix_cache_hit_tokens_total)",
    "step_tokens": "a histogram of tokens fed per step on /metrics (engine_step_tokens)",
    "cached_tokens": "usage.prompt_tokens_details.cached_tokens in answers",
    "ignore_eos": "whether the server takes ignore_eos (an extension: generation goes on past end-of-sequence), "
                  "sent only where it does",
    "long_requests": "what keeps a request going to its max_tokens where a clause needs it to: ignore_eos where "
                     "the server takes it, else OpenAI's logit_bias where that holds, else nothing",
}
INT_FACTS = ("rows", "positions", "block_size", "token_budget", "idle_token_budget")
RESERVATIONS = ("per_block", "per_slot", "on_demand")

# metric names a fact rests on, by contract name (read through the dialect)
METRIC_FACTS = {"steps": ("engine_steps_total",), "running": ("engine_requests_running",),
                "waiting": ("engine_requests_waiting",),
                "kv_blocks": ("kv_blocks_total", "kv_blocks_reserved", "kv_blocks_in_use"),
                "prefix_metrics": ("prefix_registered_tokens",),
                "prefix_hits": ("prefix_cache_hit_tokens_total",)}

# llama.cpp's server's own defaults, for facts its endpoints leave out
LLAMACPP_DEFAULT_BATCH = 2048


class FactsError(ValueError):
    """A facts file or --fact value that cannot be read."""


@dataclass(slots=True, frozen=True)
class Fact:
    name: str
    value: Any
    source: str


def parse_value(name: str, raw: Any) -> Any:
    if name not in FACTS:
        raise FactsError(f"unknown fact {name!r}; known: {', '.join(FACTS)}")
    if name in INT_FACTS:
        try:
            value = int(raw)
        except (TypeError, ValueError) as e:
            raise FactsError(f"fact {name} must be a whole number, got {raw!r}") from e
        if value <= 0:
            raise FactsError(f"fact {name} must be positive, got {value}")
        return value
    if name == "reservation" and raw not in RESERVATIONS:
        raise FactsError(f"fact reservation must be one of {', '.join(RESERVATIONS)}, got {raw!r}")
    if name in ("kind", "reservation", "long_requests"):
        return str(raw)
    if isinstance(raw, str):
        return raw.lower() not in ("0", "false", "no", "off", "")
    return bool(raw)


def read_given(path: str | None, pairs: list[str]) -> dict[str, Fact]:
    """Facts from a file (JSON or YAML mapping: name -> value) and NAME=VALUE pairs (these win)."""
    given: dict[str, Fact] = {}
    if path:
        text = Path(path).read_text()
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            import yaml

            data = yaml.safe_load(text)
        if not isinstance(data, dict):
            raise FactsError(f"{path}: a facts file is a mapping of fact names to values")
        for name, raw in data.items():
            given[name] = Fact(name, parse_value(name, raw), f"facts file {path}")
    for pair in pairs:
        name, sep, raw = pair.partition("=")
        if not sep:
            raise FactsError(f"--fact takes NAME=VALUE, got {pair!r}")
        given[name.strip()] = Fact(name.strip(), parse_value(name.strip(), raw.strip()), "--fact")
    return given


def command_option(command: str | None, *names: str) -> str | None:
    """The value of an option (`-b 512`, `--batch-size=512`) in a server command line."""
    if not command:
        return None
    try:
        words = shlex.split(command)
    except ValueError:
        return None
    for i, word in enumerate(words):
        for name in names:
            if word == name and i + 1 < len(words):
                return words[i + 1]
            if name.startswith("--") and word.startswith(name + "="):
                return word.split("=", 1)[1]
    return None


def server_version(http: httpx.Client, kind: str, props: dict | None, health: dict | None = None) -> tuple[str, str] | None:
    """(the server's own version, where it was read), for reports to name the run by; None
    where the server publishes none."""
    if kind == "poot" and health is not None and isinstance(health.get("version"), str):
        return health["version"], "/health version"
    if kind == "llamacpp" and props is not None and isinstance(props.get("build_info"), str):
        return props["build_info"], "/props build_info"
    if kind == "vllm":
        status, body = get_json(http, "/version")
        if status == 200 and isinstance(body, dict) and isinstance(body.get("version"), str):
            return body["version"], "/version"
    return None


@dataclass
class Facts:
    """The facts of one server, discovered once and handed out to tests on request."""

    known: dict[str, Fact] = field(default_factory=dict)
    used: dict[str, Fact] = field(default_factory=dict)  # the facts tests asked for and got
    missing: dict[str, str] = field(default_factory=dict)  # asked for, not had: why
    dialect: str = "poot"
    _measure: dict[str, Any] = field(default_factory=dict)  # name -> callable measuring it
    # re-entrant: measuring one fact may ask for others (rows needs positions and ignore_eos)
    _lock: threading.RLock = field(default_factory=threading.RLock)

    # -- discovery -------------------------------------------------------------------------
    @classmethod
    def discover(cls, http: httpx.Client, *, given: dict[str, Fact] | None = None,
                 dialect: str = "auto", command: str | None = None) -> Facts:
        facts = cls()
        found: dict[str, Fact] = {}
        look = Look.take(http)
        plan, props = look.plan, look.props
        kind, kind_source = look.kind()
        found["kind"] = Fact("kind", kind, kind_source)
        facts.dialect = dialect if dialect != "auto" else {"llamacpp": "llamacpp", "vllm": "vllm"}.get(kind, "poot")

        if isinstance(plan, dict):
            for name in INT_FACTS:
                if isinstance(plan.get(name), int) and plan[name] > 0:
                    found[name] = Fact(name, plan[name], "/health plan")
            if "block_size" in found:
                found["reservation"] = Fact("reservation", "per_block", "/health plan has block_size")
        if kind == "llamacpp" and props is not None:
            if isinstance(props.get("total_slots"), int):
                found["rows"] = Fact("rows", props["total_slots"], "/props total_slots")
            n_ctx = (props.get("default_generation_settings") or {}).get("n_ctx")
            if isinstance(n_ctx, int) and n_ctx > 0:
                found["positions"] = Fact("positions", n_ctx, "/props default_generation_settings.n_ctx")
            batch = props.get("n_batch") or command_option(command, "-b", "--batch-size")
            if batch is not None:
                src = "/props n_batch" if props.get("n_batch") else "the server command's --batch-size"
                found["token_budget"] = Fact("token_budget", int(batch), src)
            else:
                found["token_budget"] = Fact("token_budget", LLAMACPP_DEFAULT_BATCH,
                                             "llama.cpp's default --batch-size (the command sets none)")
            found["reservation"] = Fact("reservation", "per_slot", "llama.cpp gives each slot a fixed context")
        entries = look.model_entries
        if "positions" not in found and entries:
            length = entries[0].get("max_model_len")  # vLLM's field, which poot-serve publishes too
            if isinstance(length, int) and length > 0:
                found["positions"] = Fact("positions", length, "/v1/models max_model_len")
        if kind == "vllm":
            block_size = prometheus.label(look.metrics, "vllm:cache_config_info", "block_size")
            if block_size is not None and block_size.isdigit():
                found["block_size"] = Fact("block_size", int(block_size),
                                           "/metrics vllm:cache_config_info block_size")
            batched = command_option(command, "--max-num-batched-tokens")
            if batched and batched.isdigit():
                found["token_budget"] = Fact("token_budget", int(batched), "the server command's --max-num-batched-tokens")
            seqs = command_option(command, "--max-num-seqs")
            if seqs and seqs.isdigit():
                found["rows"] = Fact("rows", int(seqs), "the server command's --max-num-seqs")
            found["reservation"] = Fact("reservation", "on_demand",
                                        "vLLM allocates paged KV blocks as tokens come, and preempts a running "
                                        "request when they run out (vllm:num_preemptions_total)")
        if kind == "llamacpp" and "rows" not in found:
            parallel = command_option(command, "-np", "--parallel")
            if parallel and parallel.isdigit():
                found["rows"] = Fact("rows", int(parallel), "the server command's --parallel")

        if version := server_version(http, kind, props, look.health):
            found["server_version"] = Fact("server_version", version[0], version[1])
        facts.known = {**found, **(given or {})}
        if given and "kind" in given and dialect == "auto":
            facts.dialect = {"llamacpp": "llamacpp", "vllm": "vllm"}.get(given["kind"].value, "poot")
        return facts

    # -- metric facts, read off a scrape ----------------------------------------------------
    def learn_metrics(self, snapshot, source: str = "/metrics") -> None:
        """Facts that rest on metric names: which of them the server's /metrics has."""
        for name, metrics in METRIC_FACTS.items():
            if name not in self.known and all(snapshot.has(m) for m in metrics):
                self.known[name] = Fact(name, True, f"{source} ({self.dialect} names)")
        if "cancelled_counter" not in self.known:
            if snapshot.get("requests_finished_total", None, reason="cancelled") is not None:
                self.known["cancelled_counter"] = Fact("cancelled_counter", True, f"{source} ({self.dialect} names)")
        if "step_tokens" not in self.known and any(n == "engine_step_tokens_count" for n, _ in snapshot.samples):
            self.known["step_tokens"] = Fact("step_tokens", True, source)

    def learn_answer(self, answer: dict) -> None:
        details = (answer.get("usage") or {}).get("prompt_tokens_details")
        if "cached_tokens" not in self.known and isinstance(details, dict) \
                and isinstance(details.get("cached_tokens"), int):
            self.known["cached_tokens"] = Fact("cached_tokens", True, "usage.prompt_tokens_details in an answer")

    def note(self, name: str, value: Any, source: str) -> None:
        """A fact the suite found out by itself on the way (a probe's answer), reported as used."""
        with self._lock:
            fact = self.known.setdefault(name, Fact(name, value, source))
        self.used[name] = fact

    def measure_with(self, name: str, how) -> None:
        """Registers how to measure `name` from outside when nothing else gives it."""
        self._measure[name] = how

    # -- asking ----------------------------------------------------------------------------
    def has(self, name: str) -> bool:
        """Whether a fact is known (not measured: a test that can do without asks this first)."""
        fact = self.known.get(name)
        if fact is not None and fact.value not in (None, False):
            self.used[name] = fact
            return True
        return False

    def get(self, name: str, default: Any = None) -> Any:
        """A fact's value if it can be had (measuring it if need be), else `default`; no failure."""
        with self._lock:
            fact = self._get(name)
        if fact is not None and fact.value is False:
            self.used[name] = fact  # a fact had, false (a capability the server lacks): reported too
        if fact is None or fact.value in (None, False):
            return default
        self.used[name] = fact
        return fact.value

    def _get(self, name: str) -> Fact | None:
        if name not in FACTS:
            raise KeyError(f"unknown fact {name!r}")
        if name not in self.known and name in self._measure:
            started = time.monotonic()
            try:
                value, how = self._measure[name]()
            except NotSupported as e:
                self.missing[name] = e.reason
                self.known[name] = Fact(name, None, e.reason)
            else:
                self.known[name] = Fact(name, value, f"measured: {how} ({time.monotonic() - started:.1f} s)")
        return self.known.get(name)

    def need(self, *names: str) -> dict[str, Any]:
        """The values of `names`; NotSupported naming every one that cannot be had."""
        values, lacking = {}, []
        for name in names:
            value = self.get(name)
            if value is None:
                lacking.append(name)
            else:
                values[name] = value
        if lacking:
            reasons = []
            for name in lacking:
                why = self.missing.get(name) or (self.known[name].source if name in self.known else None)
                reasons.append(f"{name} ({FACTS[name]}" + (f"; {why}" if why else "") + ")")
                self.missing.setdefault(name, "not published by the server nor given")
            kind = self.known.get("kind")
            where = f" from this {kind.value} server" if kind else ""
            raise NotSupported(f"needs fact {'; '.join(reasons)}: not had{where}; give it with --fact NAME=VALUE "
                               "or --facts FILE")
        return values

    def report(self) -> dict[str, dict[str, Any]]:
        """Every fact a test used, and every one asked for but missing, with its source."""
        out = {name: {"value": f.value, "source": f.source} for name, f in sorted(self.used.items())}
        for name in ("kind", "server_version"):  # what a report names the server by, used or not
            if name in self.known:
                out.setdefault(name, {"value": self.known[name].value, "source": self.known[name].source})
        for name, why in sorted(self.missing.items()):
            if name not in self.used:
                out[name] = {"value": None, "source": why}
        return out
