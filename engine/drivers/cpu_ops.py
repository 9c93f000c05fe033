"""The CPU driver's ops (engine/ops.py), one method each, and the walk that runs a program.

Activations are feature-major, (features, tokens), between the products: every product is
`W @ X` with both operands contiguous and the weight the streamed operand (one pass over it
per step, whatever the rows; the layout BLAS handles well for few rows), and gate/up, Q/K/V
come out as contiguous blocks. Attention works token-major and hands its output back
transposed (a view) for the next product; the recurrent ops work on token-major views. The
logits come out token-major, (L, vocab), as the host takes them.

Two implementations: `ArrayOps` on NumPy alone, and `KernelOps`, whose glue between the
products (norms, rotary with the KV write, SiLU) is one compiled call each (cpu_kernels)
instead of a handful of NumPy passes, and whose few-token products and paged attention in
place are the kernels' own.
"""

from __future__ import annotations

import numpy as np

from ..ops import Program, unfused
from .cpu_attention import StepLayout, attention, rms_scale


class ArrayOps:
    """The ops on NumPy. `weights`: the family's prepared weights by name; `kv`: each layer's
    paged cache (kv_cache_shape) or None; `state`: each layer's recurrent state, (conv
    (rows, d_conv - 1, d_inner), ssm (rows, d_inner, d_state)), or None."""

    def __init__(self, program: Program, weights: dict, kv: list | None, state: list | None):
        self.program, self.w, self.kv, self.state = program, weights, kv, state
        self.dims, self.eps = program.dims, program.eps

    def run(self, step, layout: StepLayout | None) -> np.ndarray:
        """Runs every op of the program over one step (engine/step.py's StepArrays, and its
        layout for the paged ops); returns the logits, (L, vocab) float32."""
        self.begin(step, layout)
        b: dict[str, np.ndarray] = {}
        self.walk(self.program.ops, b)
        return b["logits"]

    def walk(self, ops, b: dict) -> None:
        """Runs `ops` in order, a fused op as its parts."""
        for op in unfused(ops):
            getattr(self, op.name)(op, b)

    def begin(self, step, layout: StepLayout | None) -> None:
        self.step, self.layout = step, layout
        self.tokens = step.tokens.astype(np.int64) if layout is None else layout.tokens
        self.logit_idx = step.logit_idx.astype(np.int64) if layout is None else layout.logit_idx
        if layout is None:
            return
        self._rope = self.w["rope"].view(np.complex64)[layout.positions][:, :, 0][:, None, :]  # (T, 1, hd / 2)
        self._blk, self._off = layout.write_block, layout.write_offset
        self._paged = None
        if len(layout.paged_idx):
            self._paged = (layout.paged_idx, layout.paged_tables, layout.paged_table_of, layout.paged_lengths,
                           layout.all_paged)
        self._prefills = layout.prefills

    # ---- the ops ----------------------------------------------------------------------

    def embed(self, op, b) -> None:
        b[op.writes] = np.ascontiguousarray(self.w[op.weights[0]][self.tokens].T)  # (hidden, T)

    def rms_norm(self, op, b) -> None:
        b[op.writes] = self._scale(b[op.reads[0]])

    def matmul(self, op, b) -> None:
        w = self.w[op.weights[0]]
        b[op.writes] = self._product(w, _leading(b[op.reads[0]], w.shape[1]))

    def matmul_add(self, op, b) -> None:
        w = self.w[op.weights[0]]
        self._product_add(w, _leading(b[op.reads[0]], w.shape[1]), b[op.writes])

    def rope_kv_write(self, op, b) -> None:
        b[op.writes] = self._rope_store(b[op.reads[0]], op.layer)

    def paged_attention(self, op, b) -> None:
        b[op.writes] = self._attend(b[op.reads[0]], op.layer).T  # (heads * hd, T) for the next product

    def silu_mul(self, op, b) -> None:
        b[op.writes] = self._silu_mul(b[op.reads[0]])

    def final_norm(self, op, b) -> None:
        b[op.writes] = self._scale(b[op.reads[0]][:, self.logit_idx]) * self.w[op.weights[0]][:, None]

    def head(self, op, b) -> None:
        b[op.writes] = self._head(self.w[op.weights[0]], b[op.reads[0]])

    def conv(self, op, b) -> None:
        di = self.dims["d_inner"]
        xs = b[op.reads[0]][:di].T  # (T, d_inner), token-major view
        w, bias = (self.w[n] for n in op.weights)
        conv_state = self.state[op.layer][0]
        out = np.empty_like(xs)
        for row, o, n in self._segments():
            window = np.concatenate([conv_state[row], xs[o : o + n]])  # (d_conv - 1 + n, d_inner)
            acc = bias + window[0:n] * w[:, 0]
            for j in range(1, w.shape[1]):
                acc = acc + window[j : j + n] * w[:, j]
            out[o : o + n] = acc
        b[op.writes] = _silu(out).T

    def conv_state(self, op, b) -> None:
        xs = b[op.reads[0]][: self.dims["d_inner"]].T
        conv_state = self.state[op.layer][0]
        for row, o, n in self._segments():
            conv_state[row] = np.concatenate([conv_state[row], xs[o : o + n]])[n:]

    def scan(self, op, b) -> None:
        xs, dbc, dtr, xz = (b[n].T for n in op.reads)  # token-major views
        dt_bias, a, d = (self.w[n] for n in op.weights)
        di, ds, r = self.dims["d_inner"], self.dims["d_state"], self.dims["dt_rank"]
        dt = np.logaddexp(0.0, dtr + dt_bias)  # softplus
        bm, cm = dbc[:, r : r + ds], dbc[:, r + ds : r + 2 * ds]
        states = self._scan_rows(np.exp(dt[:, :, None] * a), (dt * xs)[:, :, None] * bm[:, None, :],
                                 self.state[op.layer][1])
        y = np.matmul(states, cm[:, :, None])[:, :, 0] + xs * d
        b[op.writes] = (y * _silu(xz[:, di:])).T

    # ---- the primitives KernelOps replaces ------------------------------------------

    def _scale(self, x):
        return rms_scale(np, x, self.eps)

    def _product(self, w, x):
        return np.matmul(w, x)

    def _product_add(self, w, x, out) -> None:
        out += np.matmul(w, x)

    def _head(self, w, h):
        return np.ascontiguousarray(np.matmul(w, h).T)

    def _rope_store(self, qkv, layer: int):
        heads, kvh, hd = self.dims["heads"], self.dims["kv_heads"], self.dims["head_dim"]
        q_size, kv_size = heads * hd, kvh * hd
        t = qkv.shape[1]
        cache = self.kv[layer]
        qk = np.ascontiguousarray(qkv[: q_size + kv_size].T)  # (T, q + kv): token-major for attention
        qk.view(np.complex64).reshape(t, heads + kvh, hd // 2)[...] *= self._rope  # rotary, in place
        qk = qk.reshape(t, heads + kvh, hd)
        cache[0][:, self._blk, self._off] = qk[:, heads:].transpose(1, 0, 2)
        cache[1][:, self._blk, self._off] = qkv[q_size + kv_size :].reshape(kvh, hd, t).transpose(0, 2, 1)
        return qk[:, :heads]

    def _attend(self, q, layer: int):
        return attention(np, q, self.kv[layer], self._paged, self._prefills, self.dims["kv_heads"])

    def _silu_mul(self, gate_up):
        inter = gate_up.shape[0] // 2
        gate = gate_up[:inter]
        act = np.negative(gate)
        np.exp(act, out=act)
        act += 1.0
        np.divide(gate, act, out=act)  # silu(gate)
        act *= gate_up[inter:]
        return act

    # ---- the recurrent state ----------------------------------------------------------

    def _segments(self):
        """(row slot, first token, tokens) of each row of the step."""
        s = self.step
        return zip(s.row_ids.tolist(), s.row_first.tolist(), s.row_tokens.tolist(), strict=True)

    def _scan_rows(self, decay, inflow, ssm_state):
        """h_t = decay_t * h_(t-1) + inflow_t for each row, from (and updating) its state slot;
        returns every h_t, (tokens, d_inner, d_state). All rows advance together, one position
        per iteration, so decode rows cost one iteration in all."""
        s = self.step
        rows, offsets, lengths = (a.astype(np.int64) for a in (s.row_ids, s.row_first, s.row_tokens))
        states = np.empty_like(inflow)
        for t in range(int(lengths.max())):
            live = lengths > t
            idx, slot = offsets[live] + t, rows[live]
            h = ssm_state[slot] * decay[idx] + inflow[idx]
            ssm_state[slot] = h
            states[idx] = h
        return states


class KernelOps(ArrayOps):
    """The ops on the compiled kernels (cpu_kernels.Kernels): the glue between products is
    one compiled call each (most of what a one-row step spent outside its products, and a
    sixth of a long prompt's step), split across threads when the step has many tokens."""

    def __init__(self, program: Program, weights: dict, kv, state, kernels, stack=None):
        super().__init__(program, weights, kv, state)
        self.kernels = kernels
        self.stack = stack  # cpu_layers.DecoderStack: the layers in one call, for the steps it takes

    def run(self, step, layout: StepLayout | None) -> np.ndarray:
        stack = self.stack
        if stack is None or layout is None or not layout.all_paged or not stack.takes(len(layout.tokens)):
            return super().run(step, layout)
        self.begin(step, layout)
        b: dict[str, np.ndarray] = {}
        ops = self.program.ops
        self.walk(ops[: stack.first], b)
        self.kernels.run_layers(stack, b["x"], self._rope_f, layout)
        self.walk(ops[stack.end :], b)
        return b["logits"]

    def begin(self, step, layout: StepLayout | None) -> None:
        if layout is not None:  # (T, hd): cos, sin interleaved
            rope = self.w["rope"]
            self._rope_f = rope.reshape(len(rope), -1)[layout.positions]
        super().begin(step, layout)

    def _scale(self, x):
        return self.kernels.rms_scale(np.ascontiguousarray(x), self.eps)

    def _product(self, w, x):
        return self.kernels.matmul(w, x)

    def _product_add(self, w, x, out) -> None:
        self.kernels.matmul_add(w, x, out)  # the residual add, in place

    def _head(self, w, h):
        return self.kernels.head(w, h)  # (logits, vocab), token-major as returned

    def _rope_store(self, qkv, layer: int):
        lay = self.layout
        return self.kernels.rope_store(qkv, self._rope_f, lay.write_block, lay.write_offset, self.kv[layer],
                                       self.dims["heads"])

    def _attend(self, q, layer: int):
        return attention(np, q, self.kv[layer], self._paged, self._prefills, self.dims["kv_heads"], self.kernels)

    def _silu_mul(self, gate_up):
        return self.kernels.silu_mul(gate_up)


def _leading(a: np.ndarray, k: int) -> np.ndarray:
    """The first k features of a feature-major activation (a product reads those)."""
    return a if a.shape[0] == k else a[:k]


def _silu(x):
    return x / (1.0 + np.exp(-x))
