"""The CPU driver: NumPy arrays, compiled kernels (numba) and, where installed, MKL's packed products."""

from __future__ import annotations

import os

import numpy as np

from ..models import llama, mamba
from ..plan import DeviceInfo, Plan
from . import cpu_kernels, mkl_products
from .base import Driver, RowWork, StepArrays, StepOutput, host_logits

CPU_ROWS = 32  # rows a CPU steps at far less than 32x the cost of one (weights read once)
# Rows fed up to this many tokens attend as paged queries (each token against its row's
# keys, in place); longer prefill chunks are cheaper as causal tiles over one gathered copy.
PAGED_ROW_TOKENS = 16


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

    def __init__(self, memory_bytes: int | None = None, kernels: bool = True, mkl: bool = True,
                 device_picks: bool = True):
        super().__init__()
        self.device_picks = device_picks  # False: every row's logits come back (tests compare the two)
        self._memory = memory_bytes
        self._want_kernels = kernels  # False: the plain NumPy path (tests compare the two)
        self._want_mkl = mkl  # False: products of many tokens on NumPy's BLAS, even with MKL installed
        self.kernels = None  # cpu_kernels.Kernels once compiled in prepare()

    def device(self) -> DeviceInfo:
        memory = self._memory if self._memory is not None else host_memory_bytes()
        padded = self._uses_mkl()
        return DeviceInfo("numpy", "cpu", memory, CPU_ROWS, token_multiple=mkl_products.PAD_TOKENS if padded else 1)

    def _uses_mkl(self) -> bool:
        return self._want_kernels and self._want_mkl and cpu_kernels.available() and mkl_products.available()

    def weight_bytes(self, model) -> int:
        """The weights, plus MKL's packed copy of every large matrix when the products will
        run there (the few-token kernel still reads the originals)."""
        total = super().weight_bytes(model)
        if model.config.family != "mamba" and self._uses_mkl():
            total += sum(w.nbytes for w in model.weights.values()
                         if w.ndim == 2 and w.size >= mkl_products.MIN_PACKED_WEIGHTS)
        return total

    def prepare(self, plan: Plan, model) -> None:
        self.plan = plan
        self.config = model.config
        if model.config.family == "mamba":  # recurrent: one state slot per row, no KV pool
            self.model = mamba.prepare_mamba(model.config, model.weights, plan.state_slots or plan.rows, np)
            self._built()
            return
        self.model = llama.prepare_llama(model.config, model.weights, plan.positions, np)
        self._built()
        if self._want_kernels and cpu_kernels.available():
            for _ in range(cpu_kernels.compile()):
                self._built()
            weights = [w for layer in self.model.layers for w in layer.values()]
            # Packing the weights for MKL is part of preparing them, not a compile of its own.
            self.kernels = cpu_kernels.Kernels(weights, use_mkl=self._want_mkl, head=self.model.lm_head)
            self._specializations = cpu_kernels.specializations()
        shape = llama.kv_cache_shape(model.config, plan.num_blocks, plan.block_size)
        # The pool is written through now, not on first use: a page's first touch costs far
        # more than a read (measured in a VM: the first 32-row step over fresh blocks took
        # 2.5 s against 0.14 s), and the pool's blocks are handed out round the whole pool,
        # so lazily mapped pages would stall steps, and grow the process, for as long as
        # any block was still untouched. The plan counted this memory at fitting anyway.
        self.kv = []
        for _ in range(model.config.num_layers):
            layer = np.empty(shape, np.float32)
            layer.fill(0)
            self.kv.append(layer)
        self._built()

    def run_step(self, step: StepArrays, batch: list[RowWork]) -> StepOutput:
        if self.config.family == "mamba":
            logits = mamba.forward(np, self.config, self.model, step)
            return host_logits(batch, np.ascontiguousarray(logits, dtype=np.float32))

        layout = self.layout(step)
        ops = llama.KernelOps(self.config, self.kv, self.kernels) if self.kernels is not None \
            else llama.ArrayOps(np, self.config, self.kv)
        logits = llama.forward(ops, self.model, layout)
        if self.kernels is not None and self.kernels.specializations() != self._specializations:
            self._specializations = self.kernels.specializations()  # a kernel compiled for new types
            self._built()
        return host_logits(batch, np.ascontiguousarray(logits, dtype=np.float32))

    def open_row(self, row: int, block_table: list[int]) -> None:
        super().open_row(row, block_table)
        if self.config.family == "mamba":
            self.start_fresh_row(row)

    def start_fresh_row(self, row: int) -> None:
        """A recurrent family: a row opened by a new sequence starts from zero state."""
        mamba.reset_rows(self.model, [row])

    def layout(self, step: StepArrays) -> llama.StepLayout:
        """Where each fed token sits: positions, KV slots, and which rows attend in place.
        With the kernels, rows of up to PAGED_ROW_TOKENS tokens (decode, speculative
        verification) attend in place; without them only decode rows are paged queries."""
        paged_upto = PAGED_ROW_TOKENS if self.kernels is not None else 1
        return llama.step_layout(step, self.tables, paged_upto)
