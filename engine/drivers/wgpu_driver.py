"""The wgpu driver: WebGPU (wgpu-py, over Vulkan, Metal or DX12) with WGSL compute kernels.

Weights, the KV cache, every activation and the step's index arrays stay resident on the
device. `prepare()` builds every pipeline and bind group a step can use and counts each;
a step only writes a few small buffers (the step's counts, its flat index arrays, its picks),
records dispatches over the prepared bind groups and reads back, whatever the batch, the
token ids of the rows the engine let it pick (greedy, or sampled with the request's Philox
stream: wgsl.PICK) and the logits of the others only.

Backends: `wgpu` runs on any adapter the machine offers; `vulkan` insists on a Vulkan one.
The plan is fitted to the adapter's limits: one storage binding holds at most
`max-storage-buffer-binding-size` bytes (128 MiB on lavapipe), so a weight larger than that
is bound in windows of rows (each its own buffer and bind group), and each layer's KV must
fit one binding.

Any family: `prepare()` records the dispatches of the family's program (engine/ops.py) op by
op, each op's kernel and bind groups as wgpu_ops.py implements it, and the pick after them.

KV layout (the driver's own): per paged layer a K and a V buffer of float32, (slot, kv head,
head_dim) with slot = block * block_size + offset. Recurrent state: per layer a conv buffer
(row, d_conv - 1, d_inner) and an SSM buffer (row, d_inner, d_state), zeroed when a plan opens the row.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import numpy as np

from ..models import family
from ..ops import PAGED_OPS, PICK, STATE_OPS
from ..plan import DeviceInfo, Plan
from ..step import PICK_WORDS, RowWork, StepArrays, StepOutput, host_logits, marked_rows
from . import wgsl
from .base import Driver
from .cpu.platform.host import host_memory_bytes
from .wgpu_ops import (
    KERNEL,
    MATMUL_LAYOUT,
    PRODUCTS,
    SOURCES,
    WgpuOps,
    exact_widths,
    kernel_sizes,
    pick_sizes,
    vec4s,
)

HARDWARE = ("DiscreteGPU", "IntegratedGPU")
INSTALL_HINT = ("install a Vulkan driver and loader (Debian/Ubuntu: apt-get install mesa-vulkan-drivers libvulkan1, "
                "which brings lavapipe, a CPU Vulkan device) and wgpu-py (pip install 'poot[wgpu]')")
ASSUMED_GPU_MEMORY = 4 << 30  # WebGPU reports no memory size; a hardware adapter is taken to hold this
CPU_ADAPTER_ROWS = 8
GPU_ROWS = 32
# Invocations picking one row's token (wgsl.PICK). On lavapipe a workgroup barrier costs in
# proportion to the invocations it holds, and 64 ran a sampled pick 2-3x faster than 256.
CPU_ADAPTER_PICK_WG = 64
GPU_PICK_WG = 256


class NoAdapter(RuntimeError):
    """No adapter of the kind asked for; the message says what to install."""


def adapters() -> list:
    """Every adapter wgpu finds; empty when wgpu-py or any driver is missing."""
    try:
        import wgpu
    except ImportError:
        return []
    quiet_display_lookup()
    try:
        return list(wgpu.gpu.enumerate_adapters_sync())
    except Exception:  # no loader, no ICD: nothing to offer
        return []


def quiet_display_lookup() -> None:
    """Gives this process a private, empty XDG_RUNTIME_DIR where it has none. Listing adapters
    loads Mesa's drivers, which look for a Wayland display through libwayland, and libwayland
    prints "error: XDG_RUNTIME_DIR is invalid or not set" for each (four lines, on a server
    that has no display to find and nothing wrong). In an empty folder it finds no display
    and says nothing."""
    current = os.environ.get("XDG_RUNTIME_DIR", "")
    if current.startswith("/") and os.path.isdir(current):
        return
    folder = tempfile.mkdtemp(prefix="poot-runtime-")  # mode 0700, as the variable's spec asks
    os.environ["XDG_RUNTIME_DIR"] = folder
    atexit.register(shutil.rmtree, folder, ignore_errors=True)


def describe(adapter) -> str:
    info = adapter.info
    return f"{info.get('device', '?')} ({info.get('backend_type', '?')}, {info.get('adapter_type', '?')})"


def is_hardware(adapter) -> bool:
    return adapter.info.get("adapter_type") in HARDWARE


def pick_adapter(backend: str):
    """`vulkan`: a Vulkan adapter, hardware first; `wgpu`: any, hardware first, Vulkan before
    others. Raises NoAdapter with what to install."""
    found = adapters()
    if backend == "vulkan":
        found = [a for a in found if a.info.get("backend_type") == "Vulkan"]
        if not found:
            raise NoAdapter(f"--backend vulkan: no Vulkan adapter found; {INSTALL_HINT}")
    if not found:
        raise NoAdapter(f"--backend {backend}: no WebGPU adapter found; {INSTALL_HINT}")
    return sorted(found, key=lambda a: (not is_hardware(a), a.info.get("backend_type") != "Vulkan"))[0]


def _windows(rows: int, cols: int, limit: int) -> list[tuple[int, int]]:
    """(first row, rows) windows of a (rows, cols) float32 matrix, each within one binding."""
    per = max(1, limit // (cols * 4))
    per -= per % 4 if per >= 4 else 0
    return [(r, min(per, rows - r)) for r in range(0, rows, per)]


class WgpuDriver(WgpuOps, Driver):
    def __init__(self, backend: str = "wgpu", adapter=None, memory_bytes: int | None = None,
                 device_picks: bool = True):
        super().__init__()
        self.device_picks = device_picks  # False: every row's logits are read back
        self._memory = memory_bytes  # None: what the adapter offers
        self.backend = backend
        self.adapter = adapter if adapter is not None else pick_adapter(backend)  # NoAdapter without wgpu-py
        import wgpu

        self.wgpu = wgpu
        # Device errors: validation and out-of-memory surface after work was submitted.
        self.fault_errors = (wgpu.GPUError,)
        limits = self.adapter.limits
        self.max_binding = int(limits["max-storage-buffer-binding-size"])
        self.window_bytes = self.max_binding  # a weight larger than this is bound in windows of rows
        self.max_buffer = int(limits["max-buffer-size"])
        self.device_ = self.adapter.request_device_sync(required_limits={
            "max-storage-buffer-binding-size": self.max_binding,
            "max-buffer-size": self.max_buffer,
            "max-storage-buffers-per-shader-stage": min(8, int(limits["max-storage-buffers-per-shader-stage"])),
        })

    def device(self) -> DeviceInfo:
        hardware = is_hardware(self.adapter)
        memory = self._memory or (ASSUMED_GPU_MEMORY if hardware else host_memory_bytes())
        return DeviceInfo(self.backend, self.adapter.info.get("device", "?"), memory,
                          GPU_ROWS if hardware else CPU_ADAPTER_ROWS, max_binding_bytes=self.max_binding,
                          adapter=describe(self.adapter))

    # ---- prepare: every buffer, pipeline and bind group a step uses ----------------------

    def prepare(self, plan: Plan, model) -> None:
        c = model.config
        fam = family(c)
        self.program = program = fam.program(c).unfused()  # fused ops as their parts
        self.weights = fam.prepare(c, model.weights, plan.positions)
        self.plan = plan
        dev, wgpu = self.device_, self.wgpu
        self.tmax = tmax = plan.max_step_tokens
        self.vocab = vocab = program.dims["vocab"]
        # The products read their input as vec4s: those buffers' rows are padded to whole vec4s.
        inputs = {op.reads[0] for op in program.ops if op.name in PRODUCTS}
        self.padded = {name: vec4s(w) if name in inputs else w for name, w in program.widths.items()}
        for op in program.ops:
            for name in exact_widths(op):
                if program.widths[name] % 4:
                    raise ValueError(f"the {self.backend} driver needs {name}'s width a multiple of 4, "
                                     f"not {program.widths[name]}")
        self.eps_bits = int(np.float32(program.eps).view(np.uint32))

        # The step's index arrays and counts, the picks, the read-back buffers.
        self.index = self._storage(wgsl.INDEX_SECTIONS * tmax * 4)
        self.index_host = np.zeros(wgsl.INDEX_SECTIONS * tmax, np.int32)
        self.step_uniform = dev.create_buffer(size=16, usage=wgpu.BufferUsage.UNIFORM | wgpu.BufferUsage.COPY_DST)
        self.readback = dev.create_buffer(size=tmax * vocab * 4, usage=wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST)
        self.picks = self._storage(tmax * PICK_WORDS * 4)  # each logit index's pick words (step.pick_words)
        self.ids = self._storage(tmax * 4)  # the token picked at each logit index
        self.ids_readback = dev.create_buffer(size=max(16, tmax * 4), usage=wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST)
        self.zeros = self._upload(np.zeros(4, np.float32))
        # Activations, sized to the plan's largest step.
        self.buf = {}
        for name, width in self.padded.items():
            self._within(f"the {name} activations", tmax * width * 4)
            self.buf[name] = self._storage(tmax * width * 4)
        self._caches(program, plan)

        ops = [*program.ops, PICK]
        kernels = list(dict.fromkeys(KERNEL[op.name] for op in ops))
        sizes = dict(TMAX=tmax, **pick_sizes(vocab, GPU_PICK_WG if is_hardware(self.adapter) else CPU_ADAPTER_PICK_WG),
                     **kernel_sizes(program, self.padded, plan.block_size, self.max_blocks))
        self.layouts = {k: self._bind_layout(SOURCES[k][1] if k != "matmul" else MATMUL_LAYOUT) for k in kernels}
        self.pipelines = {}
        for kernel in kernels:
            if kernel == "matmul":
                for tile in wgsl.MATMUL_TILES:
                    self.pipelines[("matmul", tile)] = self._pipeline(wgsl.MATMUL[tile], self.layouts["matmul"])
            else:
                self.pipelines[kernel] = self._pipeline(wgsl.source(SOURCES[kernel][0], **sizes), self.layouts[kernel])

        # Bind groups: every dispatch of a step, recorded once here from the program's ops.
        self._uploaded = {}
        self.recorded = [(op, self.record(op)) for op in program.ops]
        self.pick_calls = self.record(PICK)

    def _caches(self, program, plan: Plan) -> None:
        """Each paged layer's K and V buffers, (slot, kv head, head_dim), and the rows' block
        tables; each recurrent layer's conv (row, d_conv - 1, d_inner) and SSM (row, d_inner,
        d_state) state, zeroed when a plan opens the row."""
        d = program.dims
        self.max_blocks = -(-plan.positions // plan.block_size)
        self.kv, self.state = {}, {}
        if program.paged:
            self.device_tables = self._storage(plan.rows * self.max_blocks * 4)
            slots, kv_size = plan.num_blocks * plan.block_size, d["kv_heads"] * d["head_dim"]
            self._within("one layer's K cache", slots * kv_size * 4)
            for i in program.layers(PAGED_OPS):
                self.kv[i] = (self._storage(slots * kv_size * 4), self._storage(slots * kv_size * 4))
        if program.recurrent:
            rows, di = plan.state_slots or plan.rows, d["d_inner"]
            self.conv_row_bytes, self.ssm_row_bytes = (d["d_conv"] - 1) * di * 4, di * d["d_state"] * 4
            self._within("one layer's SSM state", rows * self.ssm_row_bytes)
            for i in program.layers(STATE_OPS):
                self.state[i] = (self._storage(rows * self.conv_row_bytes), self._storage(rows * self.ssm_row_bytes))
            self.zero_state = np.zeros(max(self.conv_row_bytes, self.ssm_row_bytes) // 4, np.float32)

    @property
    def embed_calls(self) -> list:
        return [call for op, calls in self.recorded if op.name == "embed" for call in calls]

    @property
    def head_calls(self) -> list:
        return [window for op, calls in self.recorded if op.name == "head" for call in calls for window in call[1]]

    def _storage(self, nbytes: int):
        u = self.wgpu.BufferUsage
        return self.device_.create_buffer(size=max(16, nbytes), usage=u.STORAGE | u.COPY_DST | u.COPY_SRC)

    def _upload(self, a: np.ndarray):
        return self.device_.create_buffer_with_data(data=np.ascontiguousarray(a, np.float32),
                                                    usage=self.wgpu.BufferUsage.STORAGE)

    def _within(self, name: str, nbytes: int) -> None:
        if nbytes > self.max_binding:
            raise ValueError(f"{name} ({nbytes} bytes) exceeds the adapter's storage binding limit "
                             f"({self.max_binding} bytes); the plan's step is too large for it")

    def _bind_layout(self, kinds: str):
        wgpu = self.wgpu
        entries = []
        for i, k in enumerate(kinds):
            kind = {"u": wgpu.BufferBindingType.uniform, "r": wgpu.BufferBindingType.read_only_storage,
                    "w": wgpu.BufferBindingType.storage}[k]
            entries.append({"binding": i, "visibility": wgpu.ShaderStage.COMPUTE, "buffer": {"type": kind}})
        return self.device_.create_bind_group_layout(entries=entries)

    def _pipeline(self, code: str, bind_layout):
        dev = self.device_
        module = dev.create_shader_module(code=code)
        pipeline = dev.create_compute_pipeline(
            layout=dev.create_pipeline_layout(bind_group_layouts=[bind_layout]),
            compute={"module": module, "entry_point": "main"})
        self._built()
        return pipeline

    def _group(self, kernel: str, params: tuple, buffers: list):
        """A bind group of `kernel` over its fixed parameters, the step uniform and `buffers`."""
        p = np.zeros(8, np.uint32)
        p[: len(params)] = params
        u = self.wgpu.BufferUsage
        pbuf = self.device_.create_buffer_with_data(data=p, usage=u.UNIFORM)
        resources = [pbuf, self.step_uniform, *buffers]
        group = self.device_.create_bind_group(
            layout=self.layouts[kernel],
            entries=[{"binding": i, "resource": {"buffer": r, "offset": 0, "size": r.size}}
                     for i, r in enumerate(resources)])
        self._built()
        return group

    def _weight(self, w: np.ndarray) -> list[tuple[int, int, object]]:
        """A weight on the device as row windows, each within one binding."""
        w = np.ascontiguousarray(w, np.float32)
        u = self.wgpu.BufferUsage
        return [(r0, n, self.device_.create_buffer_with_data(data=w[r0 : r0 + n], usage=u.STORAGE))
                for r0, n in _windows(w.shape[0], w.shape[1], self.window_bytes)]

    def _products(self, w: np.ndarray, x, y, y_stride: int, accumulate: bool = False, logits: bool = False):
        """y[t, r0:r0+n] (+)= W[r0:r0+n] @ x[t] over W's windows: (bind group, rows) each."""
        k4 = w.shape[1] // 4
        return [(self._group("matmul", (n, k4, y_stride, r0, int(accumulate), int(logits)), [wb, x, y]), n)
                for r0, n, wb in self._weight(w)]

    # ---- rows ---------------------------------------------------------------------------

    def _open_row(self, row: int, block_table: tuple[int, ...]) -> None:
        super()._open_row(row, block_table)
        queue = self.device_.queue
        for conv, ssm in self.state.values():  # a new sequence starts from zero state
            queue.write_buffer(conv, row * self.conv_row_bytes, self.zero_state[: self.conv_row_bytes // 4])
            queue.write_buffer(ssm, row * self.ssm_row_bytes, self.zero_state[: self.ssm_row_bytes // 4])
        if self.program.paged:
            table = np.zeros(self.max_blocks, np.int32)
            table[: len(block_table)] = block_table[: self.max_blocks]
            queue.write_buffer(self.device_tables, row * self.max_blocks * 4, table)

    # ---- the step -----------------------------------------------------------------------

    def run_step(self, step: StepArrays, batch: list[RowWork]) -> StepOutput:
        t, n_logits, tmax = step.num_tokens, len(step.logit_idx), self.tmax
        ix = self.index_host
        ix[0:t] = step.tokens
        ix[tmax : tmax + t] = step.positions
        ix[2 * tmax : 2 * tmax + t] = step.kv_slots
        ix[3 * tmax : 3 * tmax + t] = step.row_ids[step.token_row]
        ix[4 * tmax : 4 * tmax + n_logits] = step.logit_idx
        queue = self.device_.queue
        queue.write_buffer(self.step_uniform, 0, np.array([t, n_logits, 0, 0], np.uint32))
        queue.write_buffer(self.index, 0, ix)
        marked = step.picks[:, 0] != 0  # the logit indices picked here
        picking = bool(marked.any())
        if picking:
            queue.write_buffer(self.picks, 0, np.ascontiguousarray(step.picks))

        encoder = self.device_.create_command_encoder()
        cp = encoder.begin_compute_pass()

        def run(kernel, group, *grid):
            cp.set_pipeline(self.pipelines[kernel])
            cp.set_bind_group(0, group)
            cp.dispatch_workgroups(*[max(1, g) for g in grid])

        def products(calls, tokens):
            tile = 1 if tokens <= 2 else 4
            for group, rows in calls:
                run(("matmul", tile), group, -(-rows // 256), -(-tokens // tile))

        def dispatch(calls) -> None:
            for kernel, group, per_unit, wg, unit in calls:
                n = t if unit == "tokens" else n_logits
                if kernel == "products":
                    products(group, n)
                else:
                    run(kernel, group, -(-n * per_unit // wg))

        for _, calls in self.recorded:
            dispatch(calls)
        if picking:
            dispatch(self.pick_calls)
        cp.end()
        row_bytes = self.vocab * 4
        host = np.flatnonzero(~marked)
        # The host rows' logits, packed: one copy per run of consecutive host rows.
        for first, count in _runs(host):
            encoder.copy_buffer_to_buffer(self.buf["logits"], int(host[first]) * row_bytes, self.readback,
                                          first * row_bytes, count * row_bytes)
        if picking:
            encoder.copy_buffer_to_buffer(self.ids, 0, self.ids_readback, 0, n_logits * 4)
        queue.submit([encoder.finish()])
        logits = self._read(self.readback, len(host) * row_bytes, np.float32).reshape(len(host), self.vocab)
        if not picking:
            return host_logits(batch, logits)
        ids = self._read(self.ids_readback, n_logits * 4, np.int32)
        ids[~marked] = -1
        return StepOutput(marked_rows(batch, marked), logits, ids)

    def _read(self, buffer, nbytes: int, dtype) -> np.ndarray:
        if not nbytes:
            return np.zeros(0, dtype)
        buffer.map_sync(self.wgpu.MapMode.READ, 0, nbytes)
        try:
            return np.frombuffer(buffer.read_mapped(0, nbytes), dtype).copy()
        finally:
            buffer.unmap()


def _runs(indices: np.ndarray) -> list[tuple[int, int]]:
    """(position in `indices`, length) of each run of consecutive values in sorted `indices`."""
    if not len(indices):
        return []
    breaks = np.flatnonzero(np.diff(indices) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(indices)]])
    return list(zip(starts.tolist(), (ends - starts).tolist(), strict=True))
