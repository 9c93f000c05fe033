"""Reading /metrics: a small Prometheus text parser and the name dialects of other servers.

Tests ask for metrics by the names of our contract (docs/contracts.md). A dialect maps those
names onto another server's: `--metrics-dialect vllm` or `llamacpp`. A name the dialect cannot
map reads as missing, and the clause that needs it ends "not supported".
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

CONTRACT_NAMES = (
    "engine_compiles", "engine_steps_total", "engine_requests_waiting", "engine_requests_running",
    "engine_rows", "kv_blocks_total", "kv_blocks_reserved", "kv_blocks_in_use", "kv_blocks_cached",
    "requests_finished_total", "prompt_tokens_total", "generation_tokens_total",
    "prefix_registered_tokens", "prefix_skipped_releases", "prefix_cache_hit_rate",
    "spec_drafted_tokens_total", "spec_accepted_tokens_total",
)

# our name -> (their name, {our label: their label}, {our label value: their label value})
DIALECTS: dict[str, dict[str, tuple[str, dict[str, str], dict[str, str]]]] = {
    "poot": {},
    "vllm": {
        "engine_requests_running": ("vllm:num_requests_running", {}, {}),
        "engine_requests_waiting": ("vllm:num_requests_waiting", {}, {}),
        "prompt_tokens_total": ("vllm:prompt_tokens_total", {}, {}),
        "generation_tokens_total": ("vllm:generation_tokens_total", {}, {}),
        "requests_finished_total": ("vllm:request_success_total", {"reason": "finished_reason"},
                                    {"cancelled": "abort"}),
        "spec_drafted_tokens_total": ("vllm:spec_decode_num_draft_tokens_total", {}, {}),
        "spec_accepted_tokens_total": ("vllm:spec_decode_num_accepted_tokens_total", {}, {}),
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

_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


class MetricsFormatError(ValueError):
    pass


def parse_prometheus(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Samples of a Prometheus text exposition: (name, labels) -> value."""
    samples = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            raise MetricsFormatError(f"line {number} is not a Prometheus sample: {line[:80]!r}")
        labels = frozenset(_LABEL.findall(m.group(3) or ""))
        try:
            value = float(m.group(4))
        except ValueError as e:
            raise MetricsFormatError(f"line {number}: value {m.group(4)!r} is not a number") from e
        samples[(m.group(1), labels)] = value
    return samples


@dataclass(slots=True)
class Snapshot:
    """One scrape, read by contract names through a dialect."""

    samples: dict[tuple[str, frozenset[tuple[str, str]]], float]
    dialect: str = "poot"
    names: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.names = {name for name, _ in self.samples}

    def _map(self, name: str, labels: dict[str, str]) -> tuple[str, dict[str, str]] | None:
        table = DIALECTS[self.dialect]
        if self.dialect == "poot":
            return name, labels
        if name not in table:
            return None
        theirs, label_names, label_values = table[name]
        return theirs, {label_names.get(k, k): label_values.get(v, v) for k, v in labels.items()}

    def has(self, name: str) -> bool:
        mapped = self._map(name, {})
        if mapped is None:
            return False
        theirs = mapped[0]
        # A counter may be exposed as `x_total` or as family `x` with a `_total` sample.
        return theirs in self.names or theirs.removesuffix("_total") in self.names

    def get(self, name: str, default: float | None = None, **labels: str) -> float | None:
        """The value of `name` (summed over samples whose labels include `labels`)."""
        mapped = self._map(name, labels)
        if mapped is None:
            return default
        theirs, want = mapped
        found, total = False, 0.0
        for (sample_name, sample_labels), value in self.samples.items():
            if sample_name != theirs:
                continue
            if all(item in sample_labels for item in want.items()):
                found, total = True, total + value
        return total if found else default
