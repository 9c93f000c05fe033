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

Families: Llama (attention over the paged KV cache) and Mamba (per-row recurrent state).
Each prepares its own layers as a list of dispatches (`program`); the embedding, the final
norm, the head and the pick are shared.

KV layout (the driver's own): per layer a K and a V buffer of float32, (slot, kv head,
head_dim) with slot = block * block_size + offset. Mamba's state: per layer a conv buffer
(row, d_conv - 1, d_inner) and an SSM buffer (row, d_inner, d_state), zeroed by open_row.
"""

from __future__ import annotations

import numpy as np

from ..models import llama, mamba
from ..plan import DeviceInfo, Plan
from . import wgsl
from .base import PICK_WORDS, Driver, RowWork, StepArrays, StepOutput, host_logits, marked_rows
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
        c = self.config = model.config
        if c.family not in ("llama", "mamba"):
            raise ValueError(f"the {self.backend} driver serves the Llama and Mamba families, not {c.family}")
        self.plan = plan
        dev, wgpu = self.device_, self.wgpu
        self.tmax = tmax = plan.max_step_tokens
        d, vocab = c.hidden_size, c.vocab_size
        if d % 4:
            raise ValueError(f"the {self.backend} driver needs hidden a multiple of 4, not {d}")

        # What every family's step uses: the step's index arrays and counts, the picks, the
        # read-back buffers, and the kernels of the embedding, the norms, the products, the pick.
        self.index = self._storage(wgsl.INDEX_SECTIONS * tmax * 4)
        self.index_host = np.zeros(wgsl.INDEX_SECTIONS * tmax, np.int32)
        self.step_uniform = dev.create_buffer(size=16, usage=wgpu.BufferUsage.UNIFORM | wgpu.BufferUsage.COPY_DST)
        self.readback = dev.create_buffer(size=tmax * vocab * 4, usage=wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST)
        self.picks = self._storage(tmax * PICK_WORDS * 4)  # each logit index's pick words (base.pick_words)
        self.ids = self._storage(tmax * 4)  # the token picked at each logit index
        self.ids_readback = dev.create_buffer(size=max(16, tmax * 4), usage=wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST)
        self.zeros = self._upload(np.zeros(4, np.float32))
        kinds = {"matmul": "uurrw", "embed": "uurrw", "rms": "uurrrw", "pick": "uuwrw"}
        sources = {"embed": wgsl.EMBED, "rms": wgsl.RMS, "pick": wgsl.PICK}
        sizes = dict(TMAX=tmax, VOCAB=vocab, PICK_WORDS=PICK_WORDS,
                     PICK_WG=GPU_PICK_WG if is_hardware(self.adapter) else CPU_ADAPTER_PICK_WG)
        if c.family == "llama":
            prepared = llama.prepare_llama(c, model.weights, plan.positions, np)
            widths = self._llama_kernels(kinds, sources, sizes)
        else:
            prepared = mamba.prepare_mamba(c, model.weights, 0, np)
            widths = self._mamba_kernels(kinds, sources, sizes)
        # Activations, sized to the plan's largest step.
        self.buf = {}
        for name, width in {"x": d, "h": d, "hl": d, "logits": vocab, **widths}.items():
            self._within(f"the {name} activations", tmax * width * 4)
            self.buf[name] = self._storage(tmax * width * 4)
        self.layouts = {k: self._bind_layout(v) for k, v in kinds.items()}
        self.pipelines = {}
        for tile in wgsl.MATMUL_TILES:
            self.pipelines[("matmul", tile)] = self._pipeline(wgsl.MATMUL[tile], self.layouts["matmul"])
        for name, src in sources.items():
            self.pipelines[name] = self._pipeline(wgsl.source(src, **sizes), self.layouts[name])

        # Bind groups: every dispatch of a step, recorded once here in `program` as
        # (kernel, bind group, invocations per token, workgroup size), or ("products",
        # [(bind group, rows)], None, None) for the windows of one weight's product.
        b = self.buf
        eps = int(np.float32(c.rms_eps).view(np.uint32))
        self.embed_calls = [("embed", self._group("embed", (d // 4, r0, n), [w, self.index, b["x"]]), d // 4, 64)
                            for r0, n, w in self._weight(prepared.embed)]
        self.program = list(self.embed_calls)
        if c.family == "llama":
            self.program += self._llama_layers(prepared, eps)
        else:
            self.program += self._mamba_layers(prepared, eps)
        self.norm = self._upload(prepared.norm)
        self.final_rms = self._group("rms", (d // 4, 1, eps), [b["x"], self.index, self.norm, b["hl"]])
        self.head_calls = self._products(prepared.lm_head, b["hl"], b["logits"], vocab, logits=True)
        self.pick_call = self._group("pick", (vocab,), [b["logits"], self.picks, self.ids])

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

    # ---- the Llama family: attention over the paged KV cache ----------------------------

    def _llama_kernels(self, kinds: dict, sources: dict, sizes: dict) -> dict[str, int]:
        """Adds the family's kernels; returns its activations' widths."""
        c, plan = self.config, self.plan
        heads, kvh, hd, inter = c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
        for name, n in (("head_dim", hd), ("intermediate", inter)):
            if n % 4:
                raise ValueError(f"the {self.backend} driver needs {name} a multiple of 4, not {n}")
        self.max_blocks = -(-plan.positions // plan.block_size)
        kinds |= {"rope": "uurrrwww", "attention": "uurrrrrw", "silu": "uurw"}
        sources |= {"rope": wgsl.ROPE_STORE, "attention": wgsl.ATTENTION, "silu": wgsl.SILU_MUL}
        sizes |= dict(HEADS=heads, KVH=kvh, HALF=hd // 2, GROUP=heads // kvh, HD4=hd // 4,
                      BS=plan.block_size, MAXB=self.max_blocks)
        q_size, kv_size = heads * hd, kvh * hd
        return {"qkv": q_size + 2 * kv_size, "q": q_size, "att": q_size, "gu": 2 * inter, "act": inter}

    def _llama_layers(self, prepared, eps: int) -> list:
        c, plan, b = self.config, self.plan, self.buf
        d, heads, kvh, hd, inter = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
        q_size, kv_size = heads * hd, kvh * hd
        self.device_tables = self._storage(plan.rows * self.max_blocks * 4)
        rope = np.ascontiguousarray(prepared.rope).view(np.float32)  # (positions, hd / 2, [cos, sin])
        self.rope = self._upload(rope)
        slots = plan.num_blocks * plan.block_size
        self._within("one layer's K cache", slots * kv_size * 4)
        self.kv = [(self._storage(slots * kv_size * 4), self._storage(slots * kv_size * 4)) for _ in range(c.num_layers)]
        program = []
        for i, layer in enumerate(prepared.layers):
            kc, vc = self.kv[i]
            program += [
                ("rms", self._group("rms", (d // 4, 0, eps), [b["x"], self.index, self.zeros, b["h"]]), 1, 64),
                ("products", self._products(layer["wqkv"], b["h"], b["qkv"], q_size + 2 * kv_size), None, None),
                ("rope", self._group("rope", (), [b["qkv"], self.index, self.rope, b["q"], kc, vc]),
                 (heads + kvh) * (hd // 2), 64),
                ("attention", self._group("attention", (), [b["q"], kc, vc, self.index, self.device_tables, b["att"]]),
                 heads, 16),
                ("products", self._products(layer["wo"], b["att"], b["x"], d, accumulate=True), None, None),
                ("rms", self._group("rms", (d // 4, 0, eps), [b["x"], self.index, self.zeros, b["h"]]), 1, 64),
                ("products", self._products(layer["w_gate_up"], b["h"], b["gu"], 2 * inter), None, None),
                ("silu", self._group("silu", (inter,), [b["gu"], b["act"]]), inter, 64),
                ("products", self._products(layer["w_down"], b["act"], b["x"], d, accumulate=True), None, None),
            ]
        return program

    # ---- the Mamba family: per-row recurrent state --------------------------------------

    def _mamba_kernels(self, kinds: dict, sources: dict, sizes: dict) -> dict[str, int]:
        c = self.config
        if c.d_inner % 4:
            raise ValueError(f"the {self.backend} driver needs d_inner a multiple of 4, not {c.d_inner}")
        self.dbc_width = -(-(c.dt_rank + 2 * c.d_state) // 4) * 4  # dt's input, B, C; padded to whole vec4s
        kinds |= {name: layout for name, (_, layout) in wgsl.MAMBA_KERNELS.items()}
        sources |= {name: source for name, (source, _) in wgsl.MAMBA_KERNELS.items()}
        sizes |= dict(DI=c.d_inner, KC=c.d_conv, DS=c.d_state, W=self.dbc_width, R=c.dt_rank)
        di = c.d_inner
        return {"xz": 2 * di, "xs": di, "dbc": self.dbc_width, "dtr": di, "y": di}

    def _mamba_layers(self, prepared, eps: int) -> list:
        c, plan, b = self.config, self.plan, self.buf
        d, di, ds, r, kc = c.hidden_size, c.d_inner, c.d_state, c.dt_rank, c.d_conv
        rows = plan.state_slots or plan.rows
        self.conv_row_bytes, self.ssm_row_bytes = (kc - 1) * di * 4, di * ds * 4
        self._within("one layer's SSM state", rows * self.ssm_row_bytes)
        self.state = [(self._storage(rows * self.conv_row_bytes), self._storage(rows * self.ssm_row_bytes))
                      for _ in range(c.num_layers)]
        self.zero_state = np.zeros(max(self.conv_row_bytes, self.ssm_row_bytes) // 4, np.float32)
        w = self.dbc_width
        program = []
        for i, layer in enumerate(prepared.layers):
            conv, ssm = self.state[i]
            x_proj = np.zeros((w, di), np.float32)  # padded with zero rows to dbc's width
            x_proj[: r + 2 * ds] = layer["x_proj"]
            dt_proj = np.zeros((di, w), np.float32)  # reads dt's input from dbc's first R columns
            dt_proj[:, :r] = layer["dt_proj"]
            in_proj = layer["in_proj"] * layer["norm"][None, :]  # the norm's weight folded in
            params = self._upload(np.concatenate([layer["dt_bias"], layer["D"], layer["A"].ravel()]))
            conv_w, conv_b = self._upload(layer["conv_w"]), self._upload(layer["conv_b"])
            program += [
                ("rms", self._group("rms", (d // 4, 0, eps), [b["x"], self.index, self.zeros, b["h"]]), 1, 64),
                ("products", self._products(in_proj, b["h"], b["xz"], 2 * di), None, None),
                ("conv", self._group("conv", (), [b["xz"], self.index, conv_w, conv_b, conv, b["xs"]]), di, 64),
                ("conv_state", self._group("conv_state", (), [b["xz"], self.index, conv]), di, 64),
                ("products", self._products(x_proj, b["xs"], b["dbc"], w), None, None),
                ("products", self._products(dt_proj, b["dbc"], b["dtr"], di), None, None),
                ("scan", self._group("scan", (), [b["xs"], b["dbc"], b["dtr"], self.index, params, b["xz"], ssm,
                                                  b["y"]]), di, 64),
                ("products", self._products(layer["out_proj"], b["y"], b["x"], d, accumulate=True), None, None),
            ]
        return program

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
        queue = self.device_.queue
        if self.config.family == "mamba":  # a new sequence starts from zero state
            for conv, ssm in self.state:
                queue.write_buffer(conv, row * self.conv_row_bytes, self.zero_state[: self.conv_row_bytes // 4])
                queue.write_buffer(ssm, row * self.ssm_row_bytes, self.zero_state[: self.ssm_row_bytes // 4])
            return
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

        c = self.config
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

        for kernel, group, per_token, wg in self.program:
            if kernel == "products":
                products(group, t)
            else:
                run(kernel, group, -(-t * per_token // wg))
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
