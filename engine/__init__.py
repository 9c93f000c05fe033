"""The engine: one scheduling loop over paged KV, driving one driver per backend."""

from .engine import Engine, EngineDead, Health
from .params import InvalidRequest, SamplingParams
from .plan import Plan

__all__ = ["Engine", "EngineDead", "Health", "InvalidRequest", "Plan", "SamplingParams"]
