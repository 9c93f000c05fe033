"""What kind of server answers at a URL, told in one place for the suite and the load tests.

One look fetches the endpoints that tell servers apart (poot's /health plan, llama.cpp's
/props, the metric families on /metrics, vLLM's owned_by on /v1/models); the kind is read
off it in a fixed order, with the evidence that decided it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx

from . import prometheus

KINDS = ("poot", "llamacpp", "vllm", "openai")
DISPLAY = {"poot": "poot", "llamacpp": "llama.cpp", "vllm": "vLLM", "openai": "OpenAI-compatible"}


def get_json(http: httpx.Client, path: str) -> tuple[int, Any]:
    """(status, JSON body or None); status 0 when the server did not answer."""
    try:
        r = http.get(path)
    except httpx.HTTPError:
        return 0, None
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, None


@dataclass(slots=True)
class Look:
    """The answers of one look at a server (None where an endpoint gave no JSON object)."""

    health: dict | None = None
    props: dict | None = None
    models: dict | None = None
    metrics: prometheus.Samples = field(default_factory=dict)
    metrics_text: bool = False  # /metrics answered 200 with Prometheus text

    @classmethod
    def take(cls, http: httpx.Client) -> Look:
        def obj(path: str) -> dict | None:
            status, body = get_json(http, path)
            return body if status == 200 and isinstance(body, dict) else None

        look = cls(health=obj("/health"), props=obj("/props"), models=obj("/v1/models"))
        try:
            r = http.get("/metrics")
            if r.status_code == 200:
                look.metrics, look.metrics_text = prometheus.parse(r.text), True
        except (httpx.HTTPError, prometheus.MetricsFormatError):
            pass
        return look

    @property
    def plan(self) -> dict | None:
        plan = (self.health or {}).get("plan")
        return plan if isinstance(plan, dict) else None

    @property
    def metric_names(self) -> set[str]:
        return prometheus.names(self.metrics)

    @property
    def model_entries(self) -> list[dict]:
        data = (self.models or {}).get("data")
        return [m for m in data if isinstance(m, dict)] if isinstance(data, list) else []

    def kind(self) -> tuple[str, str]:
        """(kind, the evidence), kind one of KINDS."""
        names = self.metric_names
        if self.plan is not None:
            return "poot", "/health publishes a plan"
        if self.props is not None and "total_slots" in self.props:
            return "llamacpp", "/props has total_slots"
        if any(n.startswith("llamacpp:") for n in names):
            return "llamacpp", "/metrics has llamacpp:* names"
        if any(n.startswith("vllm:") for n in names):
            return "vllm", "/metrics has vllm:* names"
        if any(m.get("owned_by") == "vllm" for m in self.model_entries):
            return "vllm", "/v1/models says owned_by vllm"
        if "engine_steps_total" in names:
            return "poot", "/metrics has engine_steps_total"
        return "openai", "no /health plan, /props or known /metrics names"


def first_model(http: httpx.Client) -> str | None:
    """The first model id of GET /v1/models, or None."""
    status, body = get_json(http, "/v1/models")
    data = body.get("data") if status == 200 and isinstance(body, dict) else None
    if isinstance(data, list) and data and isinstance(data[0], dict) and isinstance(data[0].get("id"), str):
        return data[0]["id"]
    return None
