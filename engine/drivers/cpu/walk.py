"""The CPU driver's ops (engine/ops.py), one method each, and the walk that runs a program:
every op in order, a fused op as its parts unless the driver runs it as one kernel (the
decoder stack, decoder_stack.py, for the steps it takes).

Activations are feature-major, (features, tokens), between the products: every product is
`W @ X` with both operands contiguous and the weight the streamed operand (one pass over it
per step, whatever the rows; the layout BLAS handles well for few rows), and gate/up, Q/K/V
come out as contiguous blocks. Attention works token-major and hands its output back
transposed (a view) for the next product; the recurrent ops work on token-major views. The
logits come out token-major, (L, vocab), as the host takes them.

Two implementations: `ArrayOps` on NumPy alone, and `KernelOps`, whose glue between the
products (norms, rotary with the KV write, SiLU) is one compiled call each (glue.py) instead
of a handful of NumPy passes, whose products are the model's own (products/), and whose paged
attention reads the cache in place. Built once per prepare; `run` takes a step.
"""

from __future__ import annotations

import numpy as np

from ...ops import Program, unfused
from .attention import StepLayout, attention, rms_scale


class ArrayOps:
    """The ops on NumPy. `weights`: the family's prepared weights by name; `kv`: each layer's
    paged cache (kv_cache_shape) or None; `state`: each layer's recurrent state, (conv
    (rows, d_conv - 1, d_inner), ssm (rows, d_inner, d_state)), or None."""

    def __init__(self, program: Program, weights: dict, kv: list | None, state: list | None):
        self.program, self.w, self.kv, self.state = program, weights, kv, state
        self.dims, self.eps = program.dims, program.eps
        self.ops = program.flat_ops  # the program's ops, a fused op as its parts

    def run(self, step, layout: StepLayout | None) -> np.ndarray:
        """Runs every op of the program over one step (engine/step.py's StepArrays, and its
        layout for the paged ops); returns the logits, (L, vocab) float32."""
        self.begin(step, layout)
        b: dict[str, np.ndarray] = {}
        self.walk(self.ops, b)
        return b["logits"]

    def walk(self, ops: tuple, b: dict) -> None:
        """Runs `ops` in order over the step's buffers `b`."""
        for op in ops:
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
        name = op.weights[0]
        b[op.writes] = self._product(name, _leading(b[op.reads[0]], self._inputs(name)))

    def matmul_add(self, op, b) -> None:
        name = op.weights[0]
        self._product_add(name, _leading(b[op.reads[0]], self._inputs(name)), b[op.writes])

    def rope_kv_write(self, op, b) -> None:
        b[op.writes] = self._rope_store(b[op.reads[0]], op.layer)

    def paged_attention(self, op, b) -> None:
        b[op.writes] = self._attend(b[op.reads[0]], op.layer).T  # (heads * hd, T) for the next product

    def silu_mul(self, op, b) -> None:
        b[op.writes] = self._silu_mul(b[op.reads[0]])

    def final_norm(self, op, b) -> None:
        b[op.writes] = self._scale(b[op.reads[0]][:, self.logit_idx]) * self.w[op.weights[0]][:, None]

    def head(self, op, b) -> None:
        b[op.writes] = self._head(op.weights[0], b[op.reads[0]])

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

    def _inputs(self, name: str) -> int:
        """The features a product of weight `name` reads."""
        return self.w[name].shape[1]

    def _product(self, name: str, x):
        return np.matmul(self.w[name], x)

    def _product_add(self, name: str, x, out) -> None:
        out += np.matmul(self.w[name], x)

    def _head(self, name: str, h):
        return np.ascontiguousarray(np.matmul(self.w[name], h).T)

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
    """The ops on the compiled kernels: the glue between products is one compiled call each
    (most of what a one-row step spent outside its products, and a sixth of a long prompt's
    step), split across threads when the step has many tokens; each product is the model's
    own (products.ModelProducts, by weight name)."""

    def __init__(self, program: Program, weights: dict, kv, state, products, glue, stack=None):
        super().__init__(program, weights, kv, state)
        self.products, self.glue = products, glue
        self.stack = stack  # decoder_stack.DecoderStack: the layers in one call, for the steps it takes
        if stack is not None:  # the ops around the stack's
            self._before, self._after = unfused(program.ops[: stack.first]), unfused(program.ops[stack.end :])

    def run(self, step, layout: StepLayout | None) -> np.ndarray:
        stack = self.stack
        if stack is None or layout is None or not layout.all_paged or not stack.takes(len(layout.tokens)):
            return super().run(step, layout)
        self.begin(step, layout)
        b: dict[str, np.ndarray] = {}
        self.walk(self._before, b)
        stack.run(b["x"], self._rope_f, layout)
        self.walk(self._after, b)
        return b["logits"]

    def begin(self, step, layout: StepLayout | None) -> None:
        if layout is not None:  # (T, hd): cos, sin interleaved
            rope = self.w["rope"]
            self._rope_f = rope.reshape(len(rope), -1)[layout.positions]
        super().begin(step, layout)

    def _inputs(self, name: str) -> int:
        return self.products[name].shape[1]  # not the weight's: its float32 copy may never be made

    def _scale(self, x):
        return self.glue.rms_scale(np.ascontiguousarray(x), self.eps)

    def _product(self, name: str, x):
        product = self.products[name]
        result = product.run(x)
        return result.T if product.head else result

    def _product_add(self, name: str, x, out) -> None:
        product = self.products[name]
        if not product.head and out.flags.c_contiguous:
            product.run(x, out=out)  # the residual add, in place
        else:
            out += self._product(name, x)

    def _head(self, name: str, h):
        product = self.products[name]
        result = product.run(h)
        return result if product.head else np.ascontiguousarray(result.T)  # (logits, vocab), token-major

    def _rope_store(self, qkv, layer: int):
        lay = self.layout
        return self.glue.rope_store(qkv, self._rope_f, lay.write_block, lay.write_offset, self.kv[layer],
                                    self.dims["heads"])

    def _attend(self, q, layer: int):
        return attention(np, q, self.kv[layer], self._paged, self._prefills, self.dims["kv_heads"], self.glue)

    def _silu_mul(self, gate_up):
        return self.glue.silu_mul(gate_up)


def _leading(a: np.ndarray, k: int) -> np.ndarray:
    """The first k features of a feature-major activation (a product reads those)."""
    return a if a.shape[0] == k else a[:k]


def _silu(x):
    return x / (1.0 + np.exp(-x))
