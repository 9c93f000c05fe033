"""The CuPy driver, backends `ptx` (CUDA) and `rocm` (HIP): the family's Program (engine/ops.py)
run as a list of launches of engine/drivers/cuda's kernels (one source for CUDA and HIP), the
products on cuBLAS or hipBLAS.

Weights are 16-bit words on the device (fp16; bf16 when a weight overflows fp16's range),
as is the KV cache; the residual stream and the products' outputs stay fp32 (the precision
plan of engine/drivers/cuda/kernels.cu; cupy_layout.py places each buffer and weight).
prepare() uploads the weights, sizes every activation buffer from `Program.widths` for the
plan's largest step, allocates one K and one V cache per layer the paged ops name and one
conv and SSM state per layer the state ops name, loads every kernel and records the step as
one closure per op (no branch on the family: an op name is one method); a step uploads one
packed int32 buffer, walks the launches, picks on the device for the rows the engine marked
and reads back their ids and the other rows' logits.

`xp` and `kernels` stand in for CuPy and the device launcher in tests: NumPy and
cupy_launch.ReferenceLauncher run the same driver on a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..models import family
from ..ops import PAGED_OPS, PICK, STATE_OPS, Op
from ..plan import MAX_POSITIONS, DeviceInfo, Plan
from . import cupy_device
from .base import PICK_HOST, PICK_WORDS, Driver, RowWork, StepArrays, StepOutput, host_logits, marked_rows
from .cuda import reference as ref
from .cupy_launch import DeviceLauncher, Launcher, w_dtype
from .cupy_layout import layout, shadow

MAX_HEAD_DIM = 256  # paged_attention's ATT_MAX_DIM: head_dim / lanes dimensions per lane
MAX_D_STATE = 16  # mamba_scan keeps a channel's state in registers (MAMBA_MAX_DS)


def half_words(w: np.ndarray, wtype: str | None = None) -> tuple[np.ndarray, str]:
    """A weight as 16-bit words: fp16 when every finite value stays finite in fp16, else bf16
    (round to nearest even from float32, as the kernels' __float2bfloat16_rn); `wtype`
    forces one."""
    a = np.ascontiguousarray(w, np.float32)
    if wtype is None:
        wtype = "f16" if fits_f16(a) else "bf16"
    if wtype == "f16":
        with np.errstate(over="ignore"):
            return a.astype(np.float16).view(np.uint16), "f16"
    return ref.f32_to_bf16(a), "bf16"


def fits_f16(a: np.ndarray) -> bool:
    """No finite value rounds past fp16's largest (65504); 65520 and up round to inf."""
    if not a.size:
        return True
    top = max(float(a.max()), -float(a.min()))  # no copy of the weight, in the usual all-finite case
    if not np.isfinite(top):
        finite = np.abs(a[np.isfinite(a)])
        top = float(finite.max()) if finite.size else 0.0
    return top < 65520.0


def _equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal weights (a head tied to the embedding, converted twice); the first rows are
    compared first, so layers of one shape cost one row each, not a pass over both."""
    return a.shape == b.shape and np.array_equal(a[:1], b[:1]) and np.array_equal(a, b)


@dataclass(slots=True)
class StepView:
    """The step as the launches see it: sizes, and device views of the uploaded arrays."""

    t: int
    n: int  # logit indices
    r: int  # rows
    tokens: object
    positions: object
    kv_slots: object
    row_slot: object  # each token's row slot, as opened
    logit_idx: object
    token_row: object  # each token's step row (0..r-1)
    row_ids: object  # each step row's slot
    row_first: object
    row_tokens: object
    picks: object  # (n, PICK_WORDS) uint32


class CupyDriver(Driver):
    def __init__(self, backend: str = "ptx", xp=None, kernels=None, probe: cupy_device.Probe | None = None,
                 memory_bytes: int | None = None, device_picks: bool = True, wtype: str | None = None):
        """`xp`: the array module (CuPy; NumPy stands in for it in tests); `kernels`: a
        callable(wtype, lanes) -> Launcher (the device launcher by default); `probe`, `memory_bytes`:
        the device figures the plan is fitted to, replaced in tests; `wtype`: forces the
        weights' word type (tests run the bf16 kernels on an fp16-safe model)."""
        super().__init__()
        if backend not in cupy_device.PLATFORM:
            raise ValueError(f"the CuPy driver runs ptx or rocm, not {backend!r}")
        self.backend = backend
        self.device_picks = device_picks
        self._memory = memory_bytes
        self._wtype = wtype
        if xp is None:
            probe = probe or cupy_device.probe(backend)  # NoDevice: what to install, or why no device
            cupy_device.check_toolchain(backend)
            import cupy

            xp = cupy
        if probe is not None:
            cupy_device.check_arch(probe, backend)
        self.xp, self.probe = xp, probe
        self.lanes = probe.lanes if probe is not None else 32  # the kernels' warp or wavefront size
        self._launcher = kernels or DeviceLauncher
        self.refused_errors, self.fault_errors = cupy_device.error_kinds()
        self.kernels: Launcher | None = None
        self.state: dict = {}  # layer -> (conv state, SSM state), recurrent families only

    def device(self) -> DeviceInfo:
        found = self.probe if self.probe is not None else cupy_device.probe(self.backend)
        return cupy_device.device_info(found, self.backend, self._memory)

    def weight_bytes(self, model) -> int:
        """The weights as cupy_layout places them, W words (2 bytes) or fp32 (a head tied to
        the embedding is uploaded once; each norm folded into a product is never uploaded),
        plus the fp32 rotary table (positions, head_dim / 2, 2) the rope op reads."""
        program = family(model.config).program(model.config).unfused()  # fused ops as their parts
        f32 = layout(program).f32_weights
        total = sum(int(np.prod(shape)) * (4 if name in f32 else 2) for name, shape in model.weight_shapes().items())
        if program.paged:
            total += 4 * min(int(model.config.max_positions), MAX_POSITIONS) * program.dims["head_dim"]
        return total

    def kv_bytes_per_token(self, config) -> int:
        return config.kv_bytes_per_token(2)  # K and V in W (fp16 or bf16), as kernels.cu stores them

    # ---- prepare ------------------------------------------------------------------------

    def prepare(self, plan: Plan, model) -> None:
        fam = family(model.config)
        program = fam.program(model.config).unfused()  # fused ops as their parts
        self._check(program)
        self.plan, self.config, self.program, self.layout = plan, model.config, program, layout(program)
        weights = fam.prepare(model.config, model.weights, plan.positions)
        self._upload_weights(program, weights)
        self.kernels = self._launcher(self.wtype, self.lanes)
        for _ in self.kernels.names():  # each kernel loaded once, here
            self._built()
        self._allocate(program, plan)
        self.launches = [getattr(self, "_op_" + op.name)(op) for op in program.ops]
        self._built()
        # A CUDA graph of the pure-decode step at row capacity (T = L = rows) would replay
        # these launches with one call; it needs fixed shapes and fixed buffer addresses, so it
        # pays only for steps of exactly that shape, and it is not captured here: every step
        # launches its kernels one by one.

    def _check(self, program) -> None:
        missing = sorted({op.name for op in program.ops if not hasattr(self, "_op_" + op.name)})
        if missing:
            raise ValueError(f"the {self.backend} driver has no kernel for {', '.join(missing)}")
        dims = program.dims
        if program.paged:
            hd, heads, kvh = dims["head_dim"], dims["heads"], dims["kv_heads"]
            if hd % 2 or hd > MAX_HEAD_DIM or heads % kvh:
                raise ValueError(f"the {self.backend} kernels need an even head_dim up to {MAX_HEAD_DIM} and "
                                 f"heads a multiple of kv_heads, not head_dim {hd}, {heads} heads, {kvh} kv heads")
        if program.recurrent and dims["d_state"] > MAX_D_STATE:
            raise ValueError(f"the {self.backend} scan kernel holds d_state up to {MAX_D_STATE}, not {dims['d_state']}")

    def _upload_weights(self, program, weights: dict[str, np.ndarray]) -> None:
        """Each weight once on the device, W words or fp32 as cupy_layout says. One word
        type for the whole model."""
        as_f32 = self.layout.f32_weights
        names = program.weight_names()
        halves = [n for n in names if n not in as_f32]
        self.wtype = self._wtype or ("f16" if all(fits_f16(np.asarray(weights[n], np.float32)) for n in halves)
                                     else "bf16")
        xp, wdtype = self.xp, w_dtype(self.wtype)
        self.weights, uploaded = {}, []  # uploaded: (host array, device array), to share a tied head
        for name in names:
            host = weights[name]
            same = next((d for h, d in uploaded if h is host or _equal(h, host)), None)
            if same is None:
                words = np.ascontiguousarray(host, np.float32) if name in as_f32 else \
                    half_words(host, self.wtype)[0].view(wdtype)
                same = xp.asarray(words)
                uploaded.append((host, same))
            self.weights[name] = same

    def _allocate(self, program, plan: Plan) -> None:
        xp, wdtype = self.xp, w_dtype(self.wtype)
        self.tmax = tmax = plan.max_step_tokens
        self.widths = dict(program.widths)
        self.widths |= {shadow(b): program.widths[b] for b in program.widths if shadow(b) in self.layout.half}
        self.buf = {name: xp.zeros((tmax, self.widths[name]), wdtype if half else np.float32)
                    for name, half in self.layout.half.items()}
        self.ids = xp.zeros(tmax, np.int32)  # the pick's output, one id per logit index
        # One int32 upload per step: tokens, positions, KV slots, row slots, step rows (T
        # each), logit indices (L), row slots, first tokens, token counts (R each) and the
        # pick words (L x PICK_WORDS), packed back to back. Pageable host memory on purpose:
        # a copy from it has read it when set() returns, so the next step may repack it even
        # after a step that read nothing back (a mid-prefill chunk), which pinned memory's
        # asynchronous copy would race.
        self.index_host = np.zeros((5 + 1 + PICK_WORDS) * tmax + 3 * plan.rows, np.int32)
        self.index = xp.zeros(len(self.index_host), np.int32)
        self.max_blocks = plan.blocks_for(plan.positions)
        self.device_tables = xp.zeros((plan.rows, self.max_blocks), np.int32)
        dims, slots = program.dims, plan.num_blocks * plan.block_size
        self.kv = {layer: (xp.zeros((slots, dims["kv_heads"], dims["head_dim"]), wdtype),
                           xp.zeros((slots, dims["kv_heads"], dims["head_dim"]), wdtype))
                   for layer in program.layers(PAGED_OPS)}
        # Recurrent state, per layer: the conv's last d_conv - 1 inputs and the SSM state, fp32.
        rows = plan.state_slots or plan.rows
        self.state = {layer: (xp.zeros((rows, dims["d_conv"] - 1, dims["d_inner"]), np.float32),
                              xp.zeros((rows, dims["d_inner"], dims["d_state"]), np.float32))
                      for layer in program.layers(STATE_OPS)}

    # ---- one implementation per op: each returns the launch its op is, bound to buffers ---

    def _op_embed(self, op: Op):
        table, x, dim = self.weights[op.weights[0]], self.buf[op.writes], self.widths[op.writes]
        return lambda s: self.kernels.embed(table, s.tokens, x, s.t, dim)

    def _op_rms_norm(self, op: Op):
        a, h, dim, eps = self.buf[op.reads[0]], self.buf[op.writes], self.widths[op.writes], self.program.eps
        return lambda s: self.kernels.rms_norm(a, h, s.t, dim, eps)

    def _op_matmul(self, op: Op, accumulate: bool = False):
        w, a, y = self.weights[op.weights[0]], self.buf[self.layout.product_input(op.reads[0])], self.buf[op.writes]
        return lambda s: self.kernels.product(w, a, y, s.t, accumulate)

    def _op_matmul_add(self, op: Op):
        return self._op_matmul(op, accumulate=True)  # cuBLAS's beta = 1: the residual add in the product

    def _op_rope_kv_write(self, op: Op):
        qkv, q, rope = self.buf[op.reads[0]], self.buf[op.writes], self.weights[op.weights[0]]
        k, v = self.kv[op.layer]
        d = self.program.dims
        return lambda s: self.kernels.rope_kv_write(qkv, rope, s.positions, s.kv_slots, q, k, v, s.t, d["heads"],
                                                    d["kv_heads"], d["head_dim"])

    def _op_paged_attention(self, op: Op):
        q, out = self.buf[op.reads[0]], self.buf[op.writes]
        k, v = self.kv[op.layer]
        d, bs, mb = self.program.dims, self.plan.block_size, self.max_blocks
        return lambda s: self.kernels.paged_attention(q, k, v, s.positions, s.row_slot, self.device_tables, out, s.t,
                                                      d["heads"], d["kv_heads"], d["head_dim"], bs, mb)

    def _op_silu_mul(self, op: Op):
        gu, act, inter = self.buf[op.reads[0]], self.buf[op.writes], self.widths[op.writes]
        return lambda s: self.kernels.silu_mul(gu, act, s.t, inter)

    def _op_final_norm(self, op: Op):
        x, h, norm = self.buf[op.reads[0]], self.buf[op.writes], self.weights[op.weights[0]]
        dim, eps = self.widths[op.writes], self.program.eps
        return lambda s: self.kernels.final_norm(x, s.logit_idx, norm, h, s.n, dim, eps)

    def _op_head(self, op: Op):
        w, a, y = self.weights[op.weights[0]], self.buf[self.layout.product_input(op.reads[0])], self.buf[op.writes]
        return lambda s: self.kernels.product(w, a, y, s.n)

    def _op_conv(self, op: Op):
        xz, xs, xs_w = self.buf[op.reads[0]], self.buf[op.writes], self.buf[shadow(op.writes)]
        conv_w, conv_b = (self.weights[w] for w in op.weights)
        conv = self.state[op.layer][0]
        di, dc = self.program.dims["d_inner"], self.program.dims["d_conv"]
        return lambda s: self.kernels.mamba_conv(xz, s.token_row, s.row_ids, s.row_first, conv_w, conv_b, conv, xs,
                                                 xs_w, s.t, di, dc)

    def _op_conv_state(self, op: Op):
        xz, conv = self.buf[op.reads[0]], self.state[op.layer][0]
        di, dc = self.program.dims["d_inner"], self.program.dims["d_conv"]
        return lambda s: self.kernels.mamba_conv_state(xz, s.row_ids, s.row_first, s.row_tokens, conv, s.r, di, dc)

    def _op_scan(self, op: Op):
        xs, dbc, dtr, xz = (self.buf[b] for b in op.reads)
        dt_bias, a, d_skip = (self.weights[w] for w in op.weights)
        ssm, y, d = self.state[op.layer][1], self.buf[op.writes], self.program.dims
        return lambda s: self.kernels.mamba_scan(xs, dbc, dtr, xz, s.row_ids, s.row_first, s.row_tokens, dt_bias, a,
                                                 d_skip, ssm, y, s.r, d["d_inner"], d["d_state"], d["dt_rank"],
                                                 self.widths[op.reads[1]])

    # ---- rows ---------------------------------------------------------------------------

    def _open_row(self, row: int, block_table: tuple[int, ...]) -> None:
        super()._open_row(row, block_table)
        if self.tables is not None:
            self._put(self.device_tables[row], self.tables[row].astype(np.int32))
        for conv, ssm in self.state.values():  # a new sequence starts from zero state
            conv[row].fill(0)
            ssm[row].fill(0)

    def _close_row(self, row: int) -> None:
        super()._close_row(row)  # the device table row stays; it is rewritten when the row reopens

    # ---- the step -----------------------------------------------------------------------

    def run_step(self, step: StepArrays, batch: list[RowWork]) -> StepOutput:
        s = self._upload(step)
        for launch in self.launches:
            launch(s)
        marked = step.picks[:, 0] != PICK_HOST
        picking = bool(marked.any())
        logits = self.buf[PICK.reads[0]]
        if picking:  # the sampled rows' logits become weights in place; the host rows' are untouched
            self.kernels.pick(logits, s.picks, self.ids, s.n, self.widths[PICK.reads[0]])
        host = self._host_rows(logits, np.flatnonzero(~marked))
        if not picking:
            return host_logits(batch, host)
        ids = np.array(self._to_host(self.ids[: s.n]), np.int32)
        ids[~marked] = -1
        return StepOutput(marked_rows(batch, marked), host, ids)

    def _upload(self, step: StepArrays) -> StepView:
        """The step's arrays, packed back to back into one int32 buffer and copied at once."""
        t, n = step.num_tokens, len(step.logit_idx)
        parts = (step.tokens, step.positions, step.kv_slots, step.row_ids[step.token_row], step.logit_idx,
                 step.token_row, step.row_ids, step.row_first, step.row_tokens, step.picks.reshape(-1).view(np.int32))
        ix, at, bounds = self.index_host, 0, []
        for a in parts:
            ix[at : at + len(a)] = a
            bounds.append((at, at + len(a)))
            at += len(a)
        self._put(self.index[:at], ix[:at])
        v = [self.index[a:b] for a, b in bounds]
        return StepView(t, n, step.num_rows, *v[:-1], v[-1].view(np.uint32))

    def _host_rows(self, logits, rows: np.ndarray) -> np.ndarray:
        """The given logit rows, float32 on the host: one copy per run of consecutive rows."""
        vocab = logits.shape[1]
        if not len(rows):
            return np.zeros((0, vocab), np.float32)
        breaks = np.flatnonzero(np.diff(rows) != 1) + 1
        runs = np.split(rows, breaks)
        return np.concatenate([np.array(self._to_host(logits[r[0] : r[-1] + 1]), np.float32) for r in runs])

    def _put(self, dst, src: np.ndarray) -> None:
        """Host -> device into an existing buffer (a view of one)."""
        if self.xp is np:
            dst[...] = src
        else:
            dst.set(src)

    def _to_host(self, a):
        return a if self.xp is np else a.get()
