"""The CPU driver: NumPy arrays, compiled kernels (numba) and, where installed, MKL's packed
products. The package, one module a job:

    driver.py           the driver: prepares a model's weights, products, caches; runs steps
    runtime.py          what compiled code shares in a process: numba's build and cache stamp,
                        the CPU's features, thread counts, OpenBLAS's spin clock
    walk.py             the op walk: each op of engine/ops.py on NumPy, or on the kernels
    glue.py             the compiled glue between products, and when it runs on how many threads
    attention.py        paged attention over the KV pool, and the step's layout
    decoder_stack.py    a program's Llama layers in one compiled call, where its products allow
    products/           one product interface, a class per way of running one, the choice
    kernels/            the numba kernels, a file a family of kernels
    platform/           MKL, 2 MiB pages, mapped pages given back, the host's memory and CPU name
"""

from __future__ import annotations

import logging

import numpy as np

from ...models import family
from ...ops import PAGED_OPS, STATE_OPS
from ...plan import DeviceInfo, Plan
from ...step import RowWork, StepArrays, StepOutput, host_logits
from ..base import Driver
from . import target
from .attention import StepLayout, kv_cache_shape, step_layout
from .decoder_stack import decoder_stack
from .glue import Glue
from .platform import host, huge_pages, mapped, mkl
from .platform.host import cpu_name, host_memory_bytes
from .products import ModelProducts
from .products.choice_cache import ChoiceCache
from .runtime import Runtime, shared
from .walk import ArrayOps, KernelOps

log = logging.getLogger("poot.engine")

CPU_ROWS = 32  # rows a CPU steps at far less than 32x the cost of one (weights read once)
# With the kernels every row's tokens attend in place as paged queries, a row's tokens in lane
# tiles: measured faster than causal tiles over a gathered copy at every size tried (2 to
# 512 tokens against 16 to 2,048 keys: 1.3-2x). Without them, only decode rows do.
PAGED_ROW_TOKENS = 1 << 62


class CpuDriver(Driver):
    backend = "numpy"

    def __init__(self, memory_bytes: int | None = None, kernels: bool = True, mkl: bool = True,
                 device_picks: bool = True, compact: bool = True, stack: bool = True, runtime: Runtime | None = None,
                 choices: ChoiceCache | None = None):
        """`choices`: where the product choices measured on this machine are kept and read
        (products/choice_cache.py; default: the engine's cache folder)."""
        super().__init__()
        self.device_picks = device_picks  # False: every row's logits come back (tests compare the two)
        self._memory = memory_bytes
        self._want_kernels = kernels  # False: the plain NumPy path (tests compare the two)
        self._want_mkl = mkl  # False: products of many tokens on NumPy's BLAS, even with MKL installed
        # True: the compact path: products on the model's exact block codes where it has them,
        # and the KV cache in float16 where the kernels attend (they alone read it). False:
        # the float32 path, float32 weights and KV (what tests/models compares with transformers).
        self._want_compact = compact
        self._codes: tuple = (None, {})  # (model, its family's block_codes()), found once per model
        self._want_stack = stack  # False: the layers op by op at every token count (tests compare the two)
        self.runtime = runtime or shared()
        self.choice_cache = choices if choices is not None else ChoiceCache()
        self.products: ModelProducts | None = None  # once the kernels are compiled in prepare()
        self.stack = None  # decoder_stack.DecoderStack: the layers in one call, where the program allows
        self.walk: ArrayOps | None = None

    def _kernels(self) -> bool:
        return self._want_kernels and self.runtime.available()

    def preload(self) -> None:
        """The kernels built or loaded from numba's cache (the first time in the process),
        saying which."""
        if self._want_kernels:
            try:
                self.runtime.compile(self.progress)
            except RuntimeError:
                pass  # available() says why, where it is asked

    def device(self) -> DeviceInfo:
        self.preload()
        memory = self._memory if self._memory is not None else host_memory_bytes()
        return DeviceInfo("numpy", "cpu", memory, CPU_ROWS, token_multiple=mkl.PAD_TOKENS if self._uses_mkl() else 1,
                          adapter=cpu_name(), isa=self.runtime.isa() if self._kernels() else "")

    def _half_kv(self) -> bool:
        """The KV cache in float16: decode attention reads every cached key and value each step,
        so its bytes bound it (1.3-1.4x faster at half of them; the cache holds twice the tokens).
        Kept as uint16 bits, since numba has no float16; only the kernels read it, and only
        where they can widen it (F16C)."""
        return self._want_compact and self._kernels() and self.runtime.half_floats()

    def kv_bytes_per_token(self, config) -> int:
        return config.kv_bytes_per_token(2 if self._half_kv() else 4)

    def _uses_mkl(self) -> bool:
        return self._want_mkl and self._kernels() and mkl.available(self.runtime.requested_isa)

    def weight_bytes(self, model) -> int:
        """The weights, plus MKL's packed copy of every large matrix a product reads when the
        products will run there (the few-token kernel still reads the originals)."""
        total = super().weight_bytes(model)
        if self._uses_mkl():
            sizes = (int(np.prod(shape)) for shape in model.weight_shapes().values() if len(shape) == 2)
            total += sum(4 * size for size in sizes if size >= mkl.MIN_PACKED_WEIGHTS)
        # The block codes are a second copy, with their float32 values (for the float paths
        # their products may choose) packed for MKL in place of the folded matrix.
        for codes, scale in self._block_codes(model).values():
            total += codes.nbytes + (0 if scale is None else scale.nbytes) + 4 * codes.codes.size
        return total

    def _block_codes(self, model) -> dict:
        """The family's exact block codes of the model's product matrices (none for float32
        weights from anywhere else), found once per model: checking every weight takes a
        second or two on SmolLM2."""
        fam = family(model.config)
        if not (self._want_compact and hasattr(fam, "block_codes") and self._kernels()):
            return {}
        if self._codes[0] is not model:
            # The loader's codes where it kept them (the GGUF cache), else searched for.
            self._codes = (model, fam.block_codes(model.config, model.weights, getattr(model, "block_codes", None)))
        return self._codes[1]

    def prepare(self, plan: Plan, model) -> None:
        self.plan = plan
        fam = family(model.config)
        self.program = program = fam.program(model.config)
        pool = self._allocate(plan)  # its pages are mapped beside what follows
        self.weights = fam.prepare(model.config, model.weights, plan.positions)
        self._built()
        self.products = None
        if self._want_kernels and not self.runtime.available():
            # Several times slower: say so where the operator looks, not only in the plan.
            log.warning("%s: every step runs on the plain NumPy path", self.runtime.unavailable_reason())
        if self._kernels():
            if warning := target.blas_warning(self.runtime.requested_isa, host.blas_core()):
                log.warning("%s", warning)  # timings held to AVX2 would run AVX-512 wherever OpenBLAS is picked
            self._prepare_products(plan, model, pool)
        if pool is not None:
            pool.wait()
        self.stack = None
        if self._want_stack and self.products is not None and self.products.coded:
            self.stack = decoder_stack(program, self.products, self.kv_pool, self.runtime)
        self._give_back_codes(model)
        if self.products is not None:
            self.walk = KernelOps(program, self.weights, self.kv, self.state, self.products,
                                  Glue(self.runtime, shared_pool=self._uses_mkl()), self.stack)
            self._specializations = self.runtime.specializations()
        else:
            self.walk = ArrayOps(program, self.weights, self.kv, self.state)
        self._built()

    def warm_up(self) -> None:
        super().warm_up()
        host.trim_heap()  # what preparing and warming up freed leaves the resident set

    def _prepare_products(self, plan: Plan, model, pool: huge_pages.Zeroing | None) -> None:
        for _ in range(self.runtime.compile()):
            self._built()
        parts = self.program.flat_ops
        names = sorted({w for op in parts if op.name in ("matmul", "matmul_add") for w in op.weights})
        head = next((op.weights[0] for op in parts if op.name == "head"), None)
        codes = self._block_codes(model)
        # Packing the weights for MKL is part of preparing them, not a compile of its own. The
        # paths' choice is read where this machine measured it before, else measured here.
        self.products = ModelProducts.chosen(
            self.weights, names, self.runtime, plan.rows, plan.token_budget, plan.max_step_tokens, head=head,
            codes=codes, use_mkl=self._want_mkl, cache=self.choice_cache, remeasure=self.retune,
            progress=self.progress, quiet=pool.wait if pool is not None else None)  # nothing timed beside it
        if self.products.coded:
            self._built()  # the block kernels

    def _give_back_codes(self, model) -> None:
        """Once the products hold the codes in their own layout, the family's joined codes
        (QKV, gate/up) go, and the loader's mapped codes leave the resident set
        (platform/mapped.py): a Llama 3.2 1B shape held 2.2 GB more without this."""
        self._codes = (None, {})
        known = getattr(model, "block_codes", None) or {}
        mapped.release(a for c in known.values() for a in (c.codes, c.d, c.m))

    def _allocate(self, plan: Plan) -> huge_pages.Zeroing | None:
        """Each layer's KV cache (one pool) or recurrent state. The pool's pages are being
        mapped when this returns: it may be read or written once the Zeroing returned has
        been waited for."""
        program = self.program
        dims, layers = program.dims, program.layers
        self.kv = self.state = self.kv_pool = None
        pool = None
        if program.paged:
            shape = kv_cache_shape(dims, plan.num_blocks, plan.block_size)
            # The pool is written through now, not on first use: a page's first touch costs far
            # more than a read (measured in a VM: the first 32-row step over fresh blocks took
            # 2.5 s against 0.14 s), and the pool's blocks are handed out round the whole pool,
            # so lazily mapped pages would stall steps, and grow the process, for as long as
            # any block was still untouched. The plan counted this memory at fitting anyway.
            # On 2 MiB pages (huge_pages): a row's blocks lie anywhere in it.
            # One pool for every layer's cache (a compiled decoder stack takes it whole).
            # Mapped on a thread of its own beside the weights' preparing (a fresh pool's pages
            # took 0.2-6 s to map here), and waited for before anything is timed or run.
            paged = layers(PAGED_OPS)
            self.progress.report("compile", "mapping the KV pool")
            pool = huge_pages.Zeroing((len(paged), *shape), np.uint16 if self._half_kv() else np.float32)
            self.kv_pool = pool.array  # +0.0 in either, once mapped
            self.kv = [None] * (max(paged) + 1)
            for k, i in enumerate(paged):
                self.kv[i] = self.kv_pool[k]
        if program.recurrent:  # one state slot per row, no KV pool
            rows, di = plan.state_slots or plan.rows, dims["d_inner"]
            self.state = [None] * (max(layers(STATE_OPS)) + 1)
            for i in layers(STATE_OPS):
                self.state[i] = (np.zeros((rows, dims["d_conv"] - 1, di), np.float32),
                                 np.zeros((rows, di, dims["d_state"]), np.float32))
        return pool

    def product_choice(self) -> tuple[str, ...]:
        """What runs each product, as measured when preparing (products/choice.py), for the
        plan /health publishes; empty where nothing was measured."""
        if self.products is None or not self.products.choices:
            return ()
        return tuple(c.describe() for c in self.products.choices)

    def product_choice_origin(self) -> tuple[str, str]:
        """How the product choice was made (ModelProducts.origin: measured, preferred or
        cached) and when it was measured (UTC); empty where nothing was."""
        if self.products is None or not self.products.choices:
            return "", ""
        return self.products.origin(), self.products.measured_at

    def run_step(self, step: StepArrays, batch: list[RowWork]) -> StepOutput:
        layout = self.layout(step) if self.program.paged else None
        logits = self.walk.run(step, layout)
        if self.products is not None and self.runtime.specializations() != self._specializations:
            self._specializations = self.runtime.specializations()  # a kernel compiled for new types
            self._built()
        return host_logits(batch, np.ascontiguousarray(logits, dtype=np.float32))

    def _open_row(self, row: int, block_table: tuple[int, ...]) -> None:
        super()._open_row(row, block_table)
        if self.program.recurrent:
            self.start_fresh_row(row)

    def start_fresh_row(self, row: int) -> None:
        """A recurrent program: a row opened by a new sequence starts from zero state."""
        for conv, ssm in filter(None, self.state):
            conv[row] = 0
            ssm[row] = 0

    def layout(self, step: StepArrays) -> StepLayout:
        """Where each fed token sits: positions, KV slots, and which rows attend in place.
        With the kernels every row attends in place; without them only decode rows are paged
        queries, and prefill chunks go as causal tiles (attention.py)."""
        paged_upto = PAGED_ROW_TOKENS if self.products is not None else 1
        return step_layout(step, self.tables, paged_upto)
