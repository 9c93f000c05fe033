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

KV layout (the driver's own): per layer a K and a V buffer of float32, (slot, kv head,
head_dim) with slot = block * block_size + offset.
"""

from __future__ import annotations

import numpy as np

from ..models import llama
from ..plan import DeviceInfo, Plan
from . import wgsl
from .base import PICK_WORDS, Driver, RowWork, StepArrays, StepOutput
from .numpy_driver import host_memory_bytes

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
    try:
        return list(wgpu.gpu.enumerate_adapters_sync())
    except Exception:  # no loader, no ICD: nothing to offer
        return []


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


class WgpuDriver(Driver):
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
        if model.config.family != "llama":
            raise ValueError(f"the {self.backend} driver serves the Llama family only, not {model.config.family}")
        c = self.config = model.config
        self.plan = plan
        dev, wgpu = self.device_, self.wgpu
        u = wgpu.BufferUsage
        prepared = llama.prepare_llama(c, model.weights, plan.positions, np)
        self.tmax = tmax = plan.max_step_tokens
        self.max_blocks = -(-plan.positions // plan.block_size)
        heads, kvh, hd = c.num_heads, c.num_kv_heads, c.head_dim
        d, inter, vocab = c.hidden_size, c.intermediate_size, c.vocab_size
        q_size, kv_size = heads * hd, kvh * hd
        for name, n in (("hidden", d), ("head_dim", hd), ("intermediate", inter)):
            if n % 4:
                raise ValueError(f"the {self.backend} driver needs {name} a multiple of 4, not {n}")

        def storage(nbytes: int, extra=0):
            return dev.create_buffer(size=max(16, nbytes), usage=u.STORAGE | u.COPY_DST | u.COPY_SRC | extra)

        def upload(a: np.ndarray):
            return dev.create_buffer_with_data(data=np.ascontiguousarray(a, np.float32), usage=u.STORAGE)

        def within(name: str, nbytes: int) -> None:
            if nbytes > self.max_binding:
                raise ValueError(f"{name} ({nbytes} bytes) exceeds the adapter's storage binding limit "
                                 f"({self.max_binding} bytes); the plan's step is too large for it")

        # Activations, sized to the plan's largest step.
        acts = {"x": d, "h": d, "qkv": q_size + 2 * kv_size, "q": q_size, "att": q_size,
                "gu": 2 * inter, "act": inter, "hl": d, "logits": vocab}
        self.buf = {}
        for name, width in acts.items():
            within(f"the {name} activations", tmax * width * 4)
            self.buf[name] = storage(tmax * width * 4)
        self.readback = dev.create_buffer(size=tmax * vocab * 4, usage=u.MAP_READ | u.COPY_DST)
        self.picks = storage(tmax * PICK_WORDS * 4)  # each logit index's pick words (base.pick_words)
        self.ids = storage(tmax * 4)  # the token picked at each logit index
        self.ids_readback = dev.create_buffer(size=max(16, tmax * 4), usage=u.MAP_READ | u.COPY_DST)
        self.index = storage(wgsl.INDEX_SECTIONS * tmax * 4)
        self.index_host = np.zeros(wgsl.INDEX_SECTIONS * tmax, np.int32)
        self.step_uniform = dev.create_buffer(size=16, usage=u.UNIFORM | u.COPY_DST)
        self.device_tables = storage(plan.rows * self.max_blocks * 4)
        rope = np.ascontiguousarray(prepared.rope).view(np.float32)  # (positions, hd / 2, [cos, sin])
        self.rope = upload(rope)
        slots = plan.num_blocks * plan.block_size
        within("one layer's K cache", slots * kv_size * 4)
        self.kv = [(storage(slots * kv_size * 4), storage(slots * kv_size * 4)) for _ in range(c.num_layers)]

        # Pipelines: one per kernel (two tiles of the product), each counted.
        sizes = dict(TMAX=tmax, HEADS=heads, KVH=kvh, HALF=hd // 2, GROUP=heads // kvh, HD4=hd // 4,
                     BS=plan.block_size, MAXB=self.max_blocks, VOCAB=vocab, PICK_WORDS=PICK_WORDS,
                     PICK_WG=GPU_PICK_WG if is_hardware(self.adapter) else CPU_ADAPTER_PICK_WG)
        kinds = {"matmul": "uurrw", "embed": "uurrw", "rms": "uurrrw", "rope": "uurrrwww", "attention": "uurrrrrw",
                 "silu": "uurw", "pick": "uuwrw"}
        sources = {"embed": wgsl.EMBED, "rms": wgsl.RMS, "rope": wgsl.ROPE_STORE, "attention": wgsl.ATTENTION,
                   "silu": wgsl.SILU_MUL, "pick": wgsl.PICK}
        self.layouts = {k: self._bind_layout(v) for k, v in kinds.items()}
        self.pipelines = {}
        for tile in wgsl.MATMUL_TILES:
            self.pipelines[("matmul", tile)] = self._pipeline(wgsl.MATMUL[tile], self.layouts["matmul"])
        for name, src in sources.items():
            self.pipelines[name] = self._pipeline(wgsl.source(src, **sizes), self.layouts[name])

        # Bind groups: every dispatch of a step, recorded once here as (kernel, group, grid).
        self.zeros = upload(np.zeros(4, np.float32))
        b = self.buf
        self.embed_calls = [self._group("embed", (d // 4, r0, n), [w, self.index, b["x"]])
                            for r0, n, w in self._weight(prepared.embed)]
        self.layer_calls = []
        eps = int(np.float32(c.rms_eps).view(np.uint32))
        for i, layer in enumerate(prepared.layers):
            kc, vc = self.kv[i]
            self.layer_calls.append({
                "rms1": self._group("rms", (d // 4, 0, eps), [b["x"], self.index, self.zeros, b["h"]]),
                "qkv": self._products(layer["wqkv"], b["h"], b["qkv"], q_size + 2 * kv_size),
                "rope": self._group("rope", (), [b["qkv"], self.index, self.rope, b["q"], kc, vc]),
                "attention": self._group("attention", (), [b["q"], kc, vc, self.index, self.device_tables, b["att"]]),
                "wo": self._products(layer["wo"], b["att"], b["x"], d, accumulate=True),
                "rms2": self._group("rms", (d // 4, 0, eps), [b["x"], self.index, self.zeros, b["h"]]),
                "gate_up": self._products(layer["w_gate_up"], b["h"], b["gu"], 2 * inter),
                "silu": self._group("silu", (inter,), [b["gu"], b["act"]]),
                "down": self._products(layer["w_down"], b["act"], b["x"], d, accumulate=True),
            })
        self.norm = upload(prepared.norm)
        self.final_rms = self._group("rms", (d // 4, 1, eps), [b["x"], self.index, self.norm, b["hl"]])
        self.head_calls = self._products(prepared.lm_head, b["hl"], b["logits"], vocab, logits=True)
        self.pick_call = self._group("pick", (vocab,), [b["logits"], self.picks, self.ids])

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

    def open_row(self, row: int, block_table: list[int]) -> None:
        super().open_row(row, block_table)
        table = np.zeros(self.max_blocks, np.int32)
        table[: len(block_table)] = block_table[: self.max_blocks]
        self.device_.queue.write_buffer(self.device_tables, row * self.max_blocks * 4, table)

    # ---- the step -----------------------------------------------------------------------

    def _run(self, step: StepArrays, batch: list[RowWork]) -> StepOutput:
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

        c = self.config
        d, heads, kvh, hd = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
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

        for group in self.embed_calls:
            run("embed", group, -(-t * d // 4 // 64))
        for calls in self.layer_calls:
            run("rms", calls["rms1"], -(-t // 64))
            products(calls["qkv"], t)
            run("rope", calls["rope"], -(-t * (heads + kvh) * (hd // 2) // 64))
            run("attention", calls["attention"], -(-t * heads // 16))
            products(calls["wo"], t)
            run("rms", calls["rms2"], -(-t // 64))
            products(calls["gate_up"], t)
            run("silu", calls["silu"], -(-t * c.intermediate_size // 64))
            products(calls["down"], t)
        run("rms", self.final_rms, -(-n_logits // 64))
        products(self.head_calls, n_logits)
        if picking:
            run("pick", self.pick_call, n_logits)  # one workgroup per logit index
        cp.end()
        row_bytes = c.vocab_size * 4
        host = np.flatnonzero(~marked)
        # The host rows' logits, packed: one copy per run of consecutive host rows.
        for first, count in _runs(host):
            encoder.copy_buffer_to_buffer(self.buf["logits"], int(host[first]) * row_bytes, self.readback,
                                          first * row_bytes, count * row_bytes)
        if picking:
            encoder.copy_buffer_to_buffer(self.ids, 0, self.ids_readback, 0, n_logits * 4)
        queue.submit([encoder.finish()])
        logits = self._read(self.readback, len(host) * row_bytes, np.float32).reshape(len(host), c.vocab_size)
        if not picking:
            return StepOutput(logits)
        ids = self._read(self.ids_readback, n_logits * 4, np.int32)
        ids[~marked] = -1
        return StepOutput(logits, ids)

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
