"""The op contract: a model family describes one step as a fixed list of generic ops over
named buffers (its `Program`); a driver implements each op once and runs any family by
walking the list. Nothing here knows a family or a device.

Conventions every op below uses:

- The step: T fed tokens, R rows, L logit indices, as engine/step.py's StepArrays gives
  them: tokens (T,), positions (T,), kv_slots (T,) (block * block_size + offset), the row of
  each token, each row's first token and token count (a row's tokens are contiguous and in
  position order, each row once), and logit_idx (L,). Each open row's block table (its
  physical KV blocks for positions 0.., fixed from the plan that opens the row to the one that closes it) is the driver's.
- Activation buffers: `Program.widths[name]` features per token, float32, read as (T, width)
  token-major, element [t, f] (final_norm's and head's outputs have L rows instead of T).
  A driver may store a buffer in any layout (the CPU driver keeps (width, T); a GPU driver
  may pad the width) as long as its ops agree; the values are what is specified here.
- Weights: `Family.prepare` returns them by name as host NumPy float32 arrays, C-contiguous;
  a matrix W is (out, in) and a product is W @ a. An op's `weights` name them in the order
  its text gives.
- Sizes an op loops over are in `Program.dims` (hidden, vocab; the Llama ops: heads,
  kv_heads, head_dim; the Mamba ops: d_inner, d_conv, d_state, dt_rank); the norms' epsilon
  is `Program.eps`.
- `layer`: the layer whose KV cache (paged ops) or recurrent state (state ops) the op
  touches; -1 for none. A driver allocates one cache or one state per layer it finds here.
- Fused ops (FUSED_OPS): one op a family names for a run of the ops above, its `parts`,
  listed once in the family's program. The parts define it: a driver with a kernel for the
  whole run takes it by the op's name and must give what the parts give; any other runs the
  parts (`Program.unfused()`). So a driver never matches a family's ops against a copy of
  its own, and a program edited inside a fused op keeps its drivers' fast path.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

# The vocabulary: each op's name and exactly what it computes.
VOCABULARY: dict[str, str] = {
    "embed": """x[t, :] = E[tokens[t], :] for every fed token. weights: (E,), (vocab, hidden).
        reads nothing; writes x (width hidden).""",
    "rms_norm": """h[t, f] = a[t, f] / sqrt(sum_f'(a[t, f'] ^ 2) / width + eps), per token.
        No weight: the norm's weight was folded into the columns of the product that reads h
        (W' = W * w[None, :] at prepare). reads (a,); writes h, the same width.""",
    "matmul": """y[t, o] = sum_{k < K} W[o, k] * a[t, k], W = weights[0] of shape (O, K). `a` may
        be wider than K: the product reads a's first K features (Mamba's dt projection reads
        dt's input from the front of dbc). reads (a,); writes y (width O).""",
    "matmul_add": """y[t, o] += sum_{k < K} W[o, k] * a[t, k]: matmul accumulated into y, the
        residual add (y is x). reads (a,); writes (accumulates into) y.""",
    "rope_kv_write": """Rotary on Q and K, then K and V into the layer's paged cache. reads (qkv,):
        width (heads + 2 kv_heads) * head_dim, Q's heads then K's then V's, head_dim features
        each; Q is pre-scaled by 1/sqrt(head_dim) (folded into its weight). weights: (rope,),
        (positions, head_dim / 2, 2): rope[p, j] = (cos p th_j, sin p th_j), th_j =
        rope_theta ^ (-j / (head_dim / 2)). Pair layout: within each Q and K head, features
        (2j, 2j + 1) are the pair (a, b) that rotary turns by angle p th_j (prepare moved the
        rotate_half pairs (j, j + head_dim/2) next to each other, in Q and K alike, so q.k is
        unchanged): (a, b) -> (a cos - b sin, a sin + b cos), p = positions[t]. Writes q[t]
        (width heads * head_dim): the rotated Q. Writes, for each kv head g, the rotated K
        and the V of token t (head_dim each) to the layer's cache at slot kv_slots[t]; the
        cache's layout and dtype are the driver's own.""",
    "paged_attention": """Each token attends its own row's keys, positions 0..its own position.
        reads (q,); writes att (width heads * head_dim). For token t of row r, p =
        positions[t], head h and its kv head g = h // (heads / kv_heads) (grouped queries):
        the key and value of position i <= p sit at slot table_r[i // block_size] *
        block_size + i % block_size of the layer's cache (table_r: the row's block table);
        s_i = q[t, h] . k_i (no further scale); att[t, h] = sum_{i <= p} softmax(s)_i v_i.
        Per-row positions and length masks: slots past p (later tokens of the step, blocks
        not yet written) are never read. Runs after the layer's rope_kv_write over the whole
        step, so the tokens of a prefill chunk see each other.""",
    "silu_mul": """act[t, j] = silu(a[t, j]) * a[t, I + j], silu(g) = g / (1 + exp(-g)). reads (a,)
        of width 2I (the gate's I features, then up's); writes act (width I).""",
    "conv": """Mamba's depthwise causal convolution, then SiLU. reads (xz,): width 2 d_inner, the
        inputs x (first d_inner) then the gate z. weights: (conv_w (d_inner, d_conv), conv_b
        (d_inner,)). For token t, the li-th token of its row in the step: window = the row's
        conv state (its last d_conv - 1 inputs before the step, oldest first; zero for a row
        just opened) followed by the row's x in the step; xs[t, c] = silu(conv_b[c] +
        sum_{j < d_conv} conv_w[c, j] * window[li + j, c]). Reads the layer's conv state, does
        not change it. writes xs (width d_inner).""",
    "conv_state": """The layer's conv state after the step: each row in the step keeps the last
        d_conv - 1 entries of its window (see conv). reads (xz,); writes no buffer (writes
        ""), only the state. Runs after the layer's conv.""",
    "scan": """Mamba's selective scan, skip term and gate. reads (xs, dbc, dtr, xz): dbc of width
        dt_rank + 2 d_state holds [dt's input (dt_rank), B (d_state), C (d_state)] per token;
        dtr (width d_inner) is the dt projection of dt's input. weights: (dt_bias (d_inner,),
        A (d_inner, d_state), D (d_inner,)). dt[t, c] = softplus(dtr[t, c] + dt_bias[c]),
        softplus(v) = log(1 + exp(v)). Each row's tokens in order, from the row's SSM state
        h (d_inner, d_state) (zero for a row just opened): h[c, s] = exp(dt[t, c] A[c, s])
        h[c, s] + dt[t, c] xs[t, c] B[t, s]; y[t, c] = (sum_s h[c, s] C[t, s] + D[c] xs[t, c])
        * silu(xz[t, d_inner + c]). The row's state after its last token is stored back.
        writes y (width d_inner).""",
    "final_norm": """The logit tokens' rows, RMS-scaled, times the final norm's weight: hl[i, f] =
        x[u, f] / sqrt(sum_f'(x[u, f'] ^ 2) / hidden + eps) * norm[f], u = logit_idx[i].
        reads (x,); weights (norm,) (hidden,); writes hl (L rows, width hidden).""",
    "head": """logits[i, v] = sum_k lm_head[v, k] hl[i, k]. reads (hl,); weights (lm_head,),
        (vocab, hidden); writes logits (L rows, width vocab): what comes back to the host
        (float32) for the logit indices not picked on the device.""",
    "pick": """Token ids picked where the logits are. reads (logits,) and the step's pick words
        (engine/step.py pick_words: (L, PICK_WORDS) uint32 per logit index: mode, the
        stream's key low and high, its choice, the counter, temperature (f32 bits), top-k
        (0: none), top-p (f32 bits)); writes ids (L,) int32. PICK_HOST: -1 (the logits go to
        the host). PICK_GREEDY: argmax, the lowest id among ties. PICK_SAMPLE: the token
        engine/sampler.py's sample() returns for the row's parameters and the uniform of
        engine/random_stream.py's Philox stream (key, choice) at that counter (top-k with
        ties kept, temperature, softmax, top-p by whole probability levels, inverse CDF in
        token id order), computed in float32.""",
    "llama_layer": """A Llama decoder layer (engine/models/llama.py lists its parts): what its parts
        compute, run in order. reads (x,), writes x (the residual stream the parts add to);
        weights: its parts' in order; layer: the layer whose KV cache its parts touch.""",
}

PAGED_OPS = frozenset({"rope_kv_write", "paged_attention"})  # touch the layer's KV cache
STATE_OPS = frozenset({"conv", "conv_state", "scan"})  # touch the layer's recurrent state
FUSED_OPS = frozenset({"llama_layer"})  # made of other ops, its `parts`


@dataclass(slots=True, frozen=True)
class Op:
    """One op of a step: `name` from VOCABULARY, the activation buffers it reads, the one it
    writes or accumulates into ("" for none), the prepared weights it uses, the layer
    whose KV cache or recurrent state it touches (-1: none), and for a fused op its parts."""

    name: str
    reads: tuple[str, ...] = ()
    writes: str = ""
    weights: tuple[str, ...] = ()
    layer: int = -1
    parts: tuple[Op, ...] = ()

    def __post_init__(self):
        if self.name not in VOCABULARY:
            raise ValueError(f"unknown op {self.name!r}")
        if self.parts and self.name not in FUSED_OPS:
            raise ValueError(f"{self.name!r} takes no parts")
        if not self.parts and self.name in FUSED_OPS:
            raise ValueError(f"{self.name!r} is made of parts; none were given")


def fused(name: str, parts: list[Op], layer: int = -1) -> Op:
    """The fused op `name` standing for `parts`: it reads what they read before any of them
    writes it, writes what the last one writes, and uses their weights in order."""
    reads: list[str] = []
    written: set[str] = set()
    for part in parts:
        reads += [r for r in part.reads if r not in written and r not in reads]
        written.add(part.writes)
    weights = tuple(dict.fromkeys(w for part in parts for w in part.weights))
    return Op(name, tuple(reads), parts[-1].writes, weights, layer, tuple(parts))


def unfused(ops: tuple[Op, ...]) -> tuple[Op, ...]:
    """The ops with every fused op replaced by its parts, in order."""
    return tuple(part for op in ops for part in (unfused(op.parts) if op.parts else (op,)))


# Every program ends in the head's logits; a device that picks adds this op after them.
PICK = Op("pick", ("logits",), "ids")


@dataclass(slots=True, frozen=True)
class Program:
    """A family's step: its ops in order, each activation buffer's width (features per token),
    the sizes its ops loop over and the norms' epsilon. A driver sizes its buffers, caches
    and states from this alone."""

    ops: tuple[Op, ...]
    widths: dict[str, int]
    dims: dict[str, int] = field(default_factory=dict)
    eps: float = 1e-5
    # Every op with the fused ones replaced by their parts, made once: drivers ask `paged` each step.
    flat_ops: tuple[Op, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "flat_ops", unfused(self.ops))

    def unfused(self) -> Program:
        """The same step with every fused op replaced by its parts: what a driver without a
        kernel for a fused op runs."""
        return dataclasses.replace(self, ops=self.flat_ops)

    @property
    def paged(self) -> bool:
        """The step reads and writes a paged KV cache (rows need block tables)."""
        return any(op.name in PAGED_OPS for op in self.flat_ops)

    @property
    def recurrent(self) -> bool:
        """The step carries per-row state (a row a new sequence opens starts from zero)."""
        return any(op.name in STATE_OPS for op in self.flat_ops)

    def layers(self, kinds: frozenset[str]) -> list[int]:
        """The layers whose cache or state the ops of `kinds` touch, in order."""
        return sorted({op.layer for op in self.flat_ops if op.name in kinds and op.layer >= 0})

    def weight_names(self) -> list[str]:
        """Every weight the program uses, once each, in first use order."""
        return list(dict.fromkeys(w for op in self.flat_ops for w in op.weights))
