"""The wgpu driver's ops (engine/ops.py): which WGSL kernel (engine/drivers/wgsl.py) runs each
op, with what sizes, and how each op's dispatches are recorded over the driver's buffers,
once, in prepare. A recorded dispatch is (kernel, bind group, invocations per unit,
workgroup size, unit), or ("products", [(bind group, rows)], None, None, unit) for the row
windows of one weight's product; the unit is the step's tokens or its logit indices.

Every activation buffer holds (tokens, width) float32 rows; a product reads its input as
vec4s, so an input's rows are padded to whole vec4s (zero columns in the weight match the
padding). Only the products (and the scan, which reads dbc) are told a padded row stride,
so any other buffer a kernel reads must have a width that is a multiple of 4 already.
"""

from __future__ import annotations

import numpy as np

from ..ops import Op, Program
from ..step import PICK_WORDS
from . import wgsl

PRODUCTS = ("matmul", "matmul_add", "head")
KERNEL = {"embed": "embed", "rms_norm": "rms", "final_norm": "rms", "matmul": "matmul", "matmul_add": "matmul",
          "head": "matmul", "rope_kv_write": "rope", "paged_attention": "attention", "silu_mul": "silu",
          "conv": "conv", "conv_state": "conv_state", "scan": "scan", "pick": "pick"}
# Each kernel but the products' (wgsl.MATMUL, one per tile): its source and bind group layout.
SOURCES = {"embed": (wgsl.EMBED, "uurrw"), "rms": (wgsl.RMS, "uurrrw"), "rope": (wgsl.ROPE_STORE, "uurrrwww"),
           "attention": (wgsl.ATTENTION, "uurrrrrw"), "silu": (wgsl.SILU_MUL, "uurw"), "pick": (wgsl.PICK, "uuwrw"),
           **wgsl.MAMBA_KERNELS}
MATMUL_LAYOUT = "uurrw"


def vec4s(width: int) -> int:
    return -(-width // 4) * 4


def exact_widths(op: Op) -> tuple[str, ...]:
    """The buffers an op's kernel reads or writes at their own width (no padded stride)."""
    if op.name in PRODUCTS:
        return ()
    if op.name == "scan":
        return tuple(n for n in (*op.reads, op.writes) if n != op.reads[1])
    return tuple(n for n in (*op.reads, op.writes) if n)


def kernel_sizes(program: Program, padded: dict[str, int], block_size: int, max_blocks: int) -> dict[str, int]:
    """The sizes substituted into the kernels of the program's ops (each takes those it names)."""
    d = program.dims
    sizes = {}
    if "heads" in d:
        heads, kvh, hd = d["heads"], d["kv_heads"], d["head_dim"]
        if hd % 4:  # attention reads each head as vec4s
            raise ValueError(f"the wgpu driver needs head_dim a multiple of 4, not {hd}")
        sizes |= dict(HEADS=heads, KVH=kvh, HALF=hd // 2, GROUP=heads // kvh, HD4=hd // 4, BS=block_size,
                      MAXB=max_blocks)
    scans = [op for op in program.ops if op.name == "scan"]
    if scans:
        sizes |= dict(DI=d["d_inner"], KC=d["d_conv"], DS=d["d_state"], W=padded[scans[0].reads[1]], R=d["dt_rank"])
    return sizes


class WgpuOps:
    """The op recorders of WgpuDriver, one per op of the vocabulary: each returns the op's
    dispatches. Uses the driver's buffers (`buf`, `index`, `zeros`, the per-layer `kv` and
    `state`, `device_tables`), its prepared weights (`weights`) and its bind group helpers."""

    def record(self, op: Op) -> list:
        return getattr(self, "_" + op.name)(op)

    def _embed(self, op: Op) -> list:
        d4 = self.padded[op.writes] // 4
        return [("embed", self._group("embed", (d4, r0, n), [w, self.index, self.buf[op.writes]]), d4, 64, "tokens")
                for r0, n, w in self._weight(self.weights[op.weights[0]])]

    def _rms_norm(self, op: Op) -> list:
        a, h = self.buf[op.reads[0]], self.buf[op.writes]
        group = self._group("rms", (self.padded[op.writes] // 4, 0, self.eps_bits), [a, self.index, self.zeros, h])
        return [("rms", group, 1, 64, "tokens")]

    def _final_norm(self, op: Op) -> list:
        norm = self._upload(self.weights[op.weights[0]])
        x, hl = self.buf[op.reads[0]], self.buf[op.writes]
        return [("rms", self._group("rms", (self.padded[op.writes] // 4, 1, self.eps_bits), [x, self.index, norm, hl]),
                 1, 64, "logits")]

    def _product(self, op: Op, accumulate: bool = False, logits: bool = False) -> list:
        a, y = op.reads[0], op.writes
        w = self.weights[op.weights[0]]
        if w.shape[1] != self.padded[a]:  # zero columns up to the input's padded width
            w = np.pad(w, ((0, 0), (0, self.padded[a] - w.shape[1])))
        calls = self._products(w, self.buf[a], self.buf[y], self.padded[y], accumulate, logits)
        return [("products", calls, None, None, "logits" if logits else "tokens")]

    def _matmul(self, op: Op) -> list:
        return self._product(op)

    def _matmul_add(self, op: Op) -> list:
        return self._product(op, accumulate=True)

    def _head(self, op: Op) -> list:
        return self._product(op, logits=True)

    def _rope_kv_write(self, op: Op) -> list:
        d = self.program.dims
        kc, vc = self.kv[op.layer]
        rope = self._upload_once(op.weights[0])
        group = self._group("rope", (), [self.buf[op.reads[0]], self.index, rope, self.buf[op.writes], kc, vc])
        return [("rope", group, (d["heads"] + d["kv_heads"]) * (d["head_dim"] // 2), 64, "tokens")]

    def _paged_attention(self, op: Op) -> list:
        kc, vc = self.kv[op.layer]
        group = self._group("attention", (), [self.buf[op.reads[0]], kc, vc, self.index, self.device_tables,
                                              self.buf[op.writes]])
        return [("attention", group, self.program.dims["heads"], 16, "tokens")]

    def _silu_mul(self, op: Op) -> list:
        inter = self.padded[op.writes]
        return [("silu", self._group("silu", (inter,), [self.buf[op.reads[0]], self.buf[op.writes]]), inter, 64,
                 "tokens")]

    def _conv(self, op: Op) -> list:
        conv_w, conv_b = (self._upload(self.weights[n]) for n in op.weights)
        group = self._group("conv", (), [self.buf[op.reads[0]], self.index, conv_w, conv_b, self.state[op.layer][0],
                                         self.buf[op.writes]])
        return [("conv", group, self.program.dims["d_inner"], 64, "tokens")]

    def _conv_state(self, op: Op) -> list:
        group = self._group("conv_state", (), [self.buf[op.reads[0]], self.index, self.state[op.layer][0]])
        return [("conv_state", group, self.program.dims["d_inner"], 64, "tokens")]

    def _scan(self, op: Op) -> list:
        dt_bias, a, d = (self.weights[n] for n in op.weights)
        params = self._upload(np.concatenate([dt_bias, d, a.ravel()]))  # the kernel's prm: dt_bias, D, A
        xs, dbc, dtr, xz = (self.buf[n] for n in op.reads)
        group = self._group("scan", (), [xs, dbc, dtr, self.index, params, xz, self.state[op.layer][1],
                                         self.buf[op.writes]])
        return [("scan", group, self.program.dims["d_inner"], 64, "tokens")]

    def _pick(self, op: Op) -> list:
        group = self._group("pick", (self.program.dims["vocab"],), [self.buf[op.reads[0]], self.picks, self.ids])
        return [("pick", group, 1, 1, "logits")]  # one workgroup per logit index

    def _upload_once(self, name: str):
        if name not in self._uploaded:
            self._uploaded[name] = self._upload(self.weights[name])
        return self._uploaded[name]


def pick_sizes(vocab: int, pick_wg: int) -> dict[str, int]:
    return dict(VOCAB=vocab, PICK_WORDS=PICK_WORDS, PICK_WG=pick_wg)
