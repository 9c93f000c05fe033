"""The CPU driver: NumPy arrays and the host's BLAS."""

from __future__ import annotations

import os

import numpy as np

from ..models import llama, mamba
from ..plan import DeviceInfo, Plan
from .base import Driver, RowWork, StepOutput

CPU_ROWS = 32  # rows a CPU steps at far less than 32x the cost of one (weights read once)


def host_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class NumpyDriver(Driver):
    backend = "numpy"

    def __init__(self, memory_bytes: int | None = None, mutations: frozenset[str] = frozenset()):
        super().__init__()
        self._memory = memory_bytes
        self.mutations = mutations  # deliberate defects, for tests that prove checks can fail
        self._last_rows = None

    def device(self) -> DeviceInfo:
        memory = self._memory if self._memory is not None else host_memory_bytes()
        return DeviceInfo("numpy", "cpu", memory, CPU_ROWS)

    def prepare(self, plan: Plan, model) -> None:
        self.plan = plan
        self.config = model.config
        if model.config.family == "mamba":  # recurrent: one state slot per row, no KV pool
            self.model = mamba.prepare_mamba(model.config, model.weights, plan.state_slots or plan.rows, np)
            self._built()
            return
        self.model = llama.prepare_llama(model.config, model.weights, plan.positions, np)
        self._built()
        shape = llama.kv_cache_shape(model.config, plan.num_blocks, plan.block_size)
        # np.zeros maps pages lazily, so an unused KV pool costs no memory.
        self.kv = [np.zeros(shape, np.float32) for _ in range(model.config.num_layers)]
        self._built()

    def _run(self, batch: list[RowWork]) -> StepOutput:
        if "recompile_on_batch_change" in self.mutations and len(batch) != self._last_rows:
            self._built()
        self._last_rows = len(batch)
        if self.config.family == "mamba":
            logits = mamba.forward(np, self.config, self.model, batch, "stale_recurrent_state" not in self.mutations)
            return StepOutput(np.ascontiguousarray(logits, dtype=np.float32))
        layout = llama.step_layout(batch, self.plan.block_size, "shared_position" in self.mutations)
        tokens = np.concatenate([w.tokens for w in batch]).astype(np.int64)
        logits = llama.forward(np, self.config, self.model, self.kv, tokens, layout,
                               mask_lengths="no_length_mask" not in self.mutations)
        return StepOutput(np.ascontiguousarray(logits, dtype=np.float32))
