"""Reading /metrics by our contract's names, through the name dialects of other servers.

Tests ask for metrics by the names of our contract (docs/contracts.md). A dialect maps those
names onto another server's: `--metrics-dialect vllm` or `llamacpp`. Most map to one of their
samples; a few are derived from what the server does export (vLLM's KV blocks from its usage
fraction and its cache config). A name the dialect cannot map reads as missing, and the clause
that needs it ends "not supported".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from . import prometheus
from .prometheus import Samples

CONTRACT_NAMES = (
    "engine_compiles", "engine_steps_total", "engine_requests_waiting", "engine_requests_running",
    "engine_rows", "kv_blocks_total", "kv_blocks_reserved", "kv_blocks_in_use", "kv_blocks_cached",
    "requests_finished_total", "prompt_tokens_total", "generation_tokens_total",
    "prefix_registered_tokens", "prefix_skipped_releases", "prefix_cache_hit_rate",
    "spec_drafted_tokens_total", "spec_accepted_tokens_total",
)


@dataclass(frozen=True, slots=True)
class Derived:
    """A contract metric computed from other samples; None where they are missing."""

    needs: tuple[str, ...]  # the server's sample names it is computed from
    compute: Callable[[Samples], float | None]


def vllm_blocks_total(samples: Samples) -> float | None:
    """vllm:cache_config_info carries the KV pool's size as its num_gpu_blocks label (the
    CPU build's blocks are counted there too); one of them is vLLM's null block, which no
    request ever gets."""
    raw = prometheus.label(samples, "vllm:cache_config_info", "num_gpu_blocks")
    return float(int(raw) - 1) if raw is not None and raw.isdigit() and int(raw) > 1 else None


def vllm_blocks_in_use(samples: Samples) -> float | None:
    """vLLM publishes the fraction of its usable pool that is not free (1 - free / usable), so
    every block a request holds, or one nobody gave back, counts; cached blocks no request
    holds are free until evicted and do not."""
    total, used = vllm_blocks_total(samples), prometheus.value(samples, "vllm:kv_cache_usage_perc")
    return None if total is None or used is None else float(round(used * total))

# our name -> (their name, {our label: their label}, {our label value: their label value}), or Derived
DIALECTS: dict[str, dict[str, tuple[str, dict[str, str], dict[str, str]] | Derived]] = {
    "poot": {},
    "vllm": {
        "engine_requests_running": ("vllm:num_requests_running", {}, {}),
        "engine_requests_waiting": ("vllm:num_requests_waiting", {}, {}),
        "prompt_tokens_total": ("vllm:prompt_tokens_total", {}, {}),
        "generation_tokens_total": ("vllm:generation_tokens_total", {}, {}),
        # Its finished_reason "abort" is not our "cancelled": a client's hang-up is aborted
        # without being counted there (vLLM 0.32, checked by hand), so no cancelled counter.
        "requests_finished_total": ("vllm:request_success_total", {"reason": "finished_reason"}, {}),
        "spec_drafted_tokens_total": ("vllm:spec_decode_num_draft_tokens_total", {}, {}),
        "spec_accepted_tokens_total": ("vllm:spec_decode_num_accepted_tokens_total", {}, {}),
        # observed once per engine iteration: its count is a step counter
        "engine_steps_total": ("vllm:iteration_tokens_total_count", {}, {}),
        "prefix_cache_hit_tokens_total": ("vllm:prefix_cache_hits_total", {}, {}),
        "prefix_cache_query_tokens_total": ("vllm:prefix_cache_queries_total", {}, {}),
        "kv_blocks_total": Derived(("vllm:cache_config_info",), vllm_blocks_total),
        "kv_blocks_in_use": Derived(("vllm:cache_config_info", "vllm:kv_cache_usage_perc"), vllm_blocks_in_use),
        # Blocks are allocated as tokens come, none ahead: what requests hold is what is in use.
        "kv_blocks_reserved": Derived(("vllm:cache_config_info", "vllm:kv_cache_usage_perc"), vllm_blocks_in_use),
    },
    "llamacpp": {
        "engine_requests_running": ("llamacpp:requests_processing", {}, {}),
        "engine_requests_waiting": ("llamacpp:requests_deferred", {}, {}),
        "prompt_tokens_total": ("llamacpp:prompt_tokens_total", {}, {}),
        "generation_tokens_total": ("llamacpp:tokens_predicted_total", {}, {}),
        "engine_steps_total": ("llamacpp:n_decode_total", {}, {}),
        "spec_drafted_tokens_total": ("llamacpp:spec_decode_num_draft_tokens_total", {}, {}),
        "spec_accepted_tokens_total": ("llamacpp:spec_decode_num_accepted_tokens_total", {}, {}),
    },
}

# Dialects whose kv_blocks_in_use is read off the free list (total - free): a block that no
# request gave back shows in it, so a leak needs no other witness.
IN_USE_COUNTS_EVERY_UNFREED_BLOCK = frozenset({"vllm"})

@dataclass(slots=True)
class Snapshot:
    """One scrape, read by contract names through a dialect."""

    samples: Samples
    dialect: str = "poot"
    names: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.names = prometheus.names(self.samples)

    def _map(self, name: str, labels: dict[str, str]) -> tuple[str, dict[str, str]] | Derived | None:
        table = DIALECTS[self.dialect]
        if self.dialect == "poot":
            return name, labels
        if name not in table:
            return None
        if isinstance(table[name], Derived):
            return None if labels else table[name]
        theirs, label_names, label_values = table[name]
        return theirs, {label_names.get(k, k): label_values.get(v, v) for k, v in labels.items()}

    def has(self, name: str) -> bool:
        mapped = self._map(name, {})
        if mapped is None:
            return False
        if isinstance(mapped, Derived):
            return mapped.compute(self.samples) is not None
        theirs = mapped[0]
        # A counter may be exposed as `x_total` or as family `x` with a `_total` sample.
        return theirs in self.names or theirs.removesuffix("_total") in self.names

    def get(self, name: str, default: float | None = None, **labels: str) -> float | None:
        """The value of `name` (summed over samples whose labels include `labels`)."""
        mapped = self._map(name, labels)
        if mapped is None:
            return default
        if isinstance(mapped, Derived):
            value = mapped.compute(self.samples)
            return default if value is None else value
        theirs, want = mapped
        total = prometheus.value(self.samples, theirs, **want)
        return default if total is None else total
