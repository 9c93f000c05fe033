"""The wgpu driver's compute kernels, in WGSL.

Every kernel is barrier-free: one invocation computes a small tile in registers (lavapipe,
Mesa's software Vulkan, ran register-tiled kernels without workgroup barriers about 3x
faster than shared-memory tiles with barriers). Sizes a kernel loops over are substituted
into its source as constants when the driver prepares it, so a shape never reaches a step.

Every bind group starts with the same two uniforms: `p`, the kernel's fixed parameters
(written once in prepare), and `st`, the step's token and logit counts (written once per
step). The step's flat index arrays (tokens, positions, KV slots, row slots, logit indices)
lie in one int32 buffer of sections sized to the plan, `ix`, uploaded once per step.
"""

from __future__ import annotations

from string import Template


def source(template: str, **sizes: int) -> str:
    """A kernel's source with its sizes (${NAME}) substituted."""
    return Template(template).substitute(**sizes)

HEADER = """
struct Params { a: u32, b: u32, c: u32, d: u32, e: u32, f: u32, g: u32, h: u32 }
struct Step { tokens: u32, logits: u32, pad0: u32, pad1: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<uniform> st: Step;
"""

# Sections of the step's index buffer, each TMAX long: tokens, positions, kv_slots,
# row slot of each token, logit indices.
INDEX = """
const TMAX: u32 = ${TMAX}u;
fn tok(t: u32) -> u32 { return u32(ix[t]); }
fn pos(t: u32) -> u32 { return u32(ix[TMAX + t]); }
fn kv_slot(t: u32) -> u32 { return u32(ix[2u * TMAX + t]); }
fn row_slot(t: u32) -> u32 { return u32(ix[3u * TMAX + t]); }
fn logit_tok(i: u32) -> u32 { return u32(ix[4u * TMAX + i]); }
"""
INDEX_SECTIONS = 5


def _matmul(tile: int) -> str:
    """y[t, off + o] (+)= sum_k W[o, k] x[t, k] for a window of W's rows: each invocation
    computes 4 outputs for `tile` tokens. p: a = rows O, b = K / 4, c = y's row stride,
    d = column offset, e = accumulate (the residual add), f = 1: count logits, not tokens."""
    ts = range(tile)
    decl = "\n".join(f"  var acc{j} = vec4<f32>(0.0);" for j in ts)
    rows = "\n".join(f"  let x{j} = (min(t0 + {j}u, T - 1u)) * K4;" for j in ts)
    body = "\n".join("    { let xv = x[xJ + k]; accJ += vec4<f32>(dot(w0, xv), dot(w1, xv), dot(w2, xv), dot(w3, xv)); }"
                     .replace("J", str(j)) for j in ts)
    store = "\n".join("  if (t0 + Ju < T) { store(t0 + Ju, o0, accJ); }".replace("J", str(j)) for j in ts)
    return HEADER + """
@group(0) @binding(2) var<storage, read> w: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;

fn store(t: u32, o0: u32, v: vec4<f32>) {
  for (var i = 0u; i < 4u; i++) {
    if (o0 + i < p.a) {
      let idx = t * p.c + p.d + o0 + i;
      if (p.e == 1u) { y[idx] = y[idx] + v[i]; } else { y[idx] = v[i]; }
    }
  }
}

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let O = p.a;
  let K4 = p.b;
  var T = st.tokens;
  if (p.f == 1u) { T = st.logits; }
  let o0 = gid.x * 4u;
  let t0 = gid.y * """ + str(tile) + """u;
  if (o0 >= O || t0 >= T) { return; }
  let r0 = min(o0, O - 1u) * K4;
  let r1 = min(o0 + 1u, O - 1u) * K4;
  let r2 = min(o0 + 2u, O - 1u) * K4;
  let r3 = min(o0 + 3u, O - 1u) * K4;
""" + decl + "\n" + rows + """
  for (var k = 0u; k < K4; k++) {
    let w0 = w[r0 + k];
    let w1 = w[r1 + k];
    let w2 = w[r2 + k];
    let w3 = w[r3 + k];
""" + body + """
  }
""" + store + "\n}\n"


MATMUL_TILES = (1, 4)  # tokens per invocation: 1 for decode-sized steps, 4 for the rest
MATMUL = {tile: _matmul(tile) for tile in MATMUL_TILES}

# Gathers embedding rows for the tokens a window of the table holds. p: a = D / 4,
# b = the window's first row, c = its rows.
EMBED = HEADER + """
@group(0) @binding(2) var<storage, read> e: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> ix: array<i32>;
@group(0) @binding(4) var<storage, read_write> x: array<vec4<f32>>;
""" + INDEX + """
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let i = gid.x;
  if (i >= st.tokens * p.a) { return; }
  let t = i / p.a;
  let k = i % p.a;
  let id = tok(t);
  if (id < p.b || id >= p.b + p.c) { return; }
  x[i] = e[(id - p.b) * p.a + k];
}
"""

# x / rms(x) per token. p: a = D / 4, b = 1: the final norm (rows at the logit indices,
# times the norm's weight), c = eps (f32 bits).
RMS = HEADER + """
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> ix: array<i32>;
@group(0) @binding(4) var<storage, read> nw: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read_write> y: array<vec4<f32>>;
""" + INDEX + """
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let i = gid.x;
  var n = st.tokens;
  if (p.b == 1u) { n = st.logits; }
  if (i >= n) { return; }
  var src = i;
  if (p.b == 1u) { src = logit_tok(i); }
  var ss = 0.0;
  for (var k = 0u; k < p.a; k++) { let v = x[src * p.a + k]; ss += dot(v, v); }
  let r = sqrt(ss / f32(p.a * 4u) + bitcast<f32>(p.c));
  for (var k = 0u; k < p.a; k++) {
    var v = x[src * p.a + k] / r;
    if (p.b == 1u) { v = v * nw[k]; }
    y[i * p.a + k] = v;
  }
}
"""

# Rotary on each (Q or K) head's adjacent pairs, K and V written to the layer's cache at
# each token's slot. One invocation per pair.
ROPE_STORE = HEADER + """
@group(0) @binding(2) var<storage, read> qkv: array<vec2<f32>>;
@group(0) @binding(3) var<storage, read> ix: array<i32>;
@group(0) @binding(4) var<storage, read> rope: array<vec2<f32>>;
@group(0) @binding(5) var<storage, read_write> q: array<vec2<f32>>;
@group(0) @binding(6) var<storage, read_write> kc: array<vec2<f32>>;
@group(0) @binding(7) var<storage, read_write> vc: array<vec2<f32>>;
""" + INDEX + """
const HEADS: u32 = ${HEADS}u;
const KVH: u32 = ${KVH}u;
const HALF: u32 = ${HALF}u;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let i = gid.x;
  let per_token = (HEADS + KVH) * HALF;
  if (i >= st.tokens * per_token) { return; }
  let t = i / per_token;
  let hh = (i % per_token) / HALF;
  let j = i % HALF;
  let cs = rope[pos(t) * HALF + j];
  let width = (HEADS + 2u * KVH) * HALF;  // qkv's row, in pairs
  let v = qkv[t * width + hh * HALF + j];
  let r = vec2<f32>(v.x * cs.x - v.y * cs.y, v.x * cs.y + v.y * cs.x);
  if (hh < HEADS) {
    q[t * HEADS * HALF + hh * HALF + j] = r;
  } else {
    let kh = hh - HEADS;
    let at = kv_slot(t) * KVH * HALF + kh * HALF + j;
    kc[at] = r;
    vc[at] = qkv[t * width + (HEADS + KVH + kh) * HALF + j];
  }
}
"""

# Paged attention over mixed rows: one invocation per (token, head) reads its row's keys
# 0..position through the row's block table (resident since its row was opened), online softmax,
# nothing gathered. Q is pre-scaled. p: unused.
ATTENTION = HEADER + """
@group(0) @binding(2) var<storage, read> q: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> kc: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read> vc: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read> ix: array<i32>;
@group(0) @binding(6) var<storage, read> tables: array<i32>;
@group(0) @binding(7) var<storage, read_write> o: array<vec4<f32>>;
""" + INDEX + """
const HEADS: u32 = ${HEADS}u;
const GROUP: u32 = ${GROUP}u;
const KVH: u32 = ${KVH}u;
const HD4: u32 = ${HD4}u;
const BS: u32 = ${BS}u;
const MAXB: u32 = ${MAXB}u;
@compute @workgroup_size(16)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let i = gid.x;
  if (i >= st.tokens * HEADS) { return; }
  let t = i / HEADS;
  let h = i % HEADS;
  let kh = h / GROUP;
  let row = row_slot(t) * MAXB;
  var qv: array<vec4<f32>, HD4>;
  var acc: array<vec4<f32>, HD4>;
  for (var d = 0u; d < HD4; d++) { qv[d] = q[(t * HEADS + h) * HD4 + d]; acc[d] = vec4<f32>(0.0); }
  var m = -3.0e38;
  var l = 0.0;
  let n = pos(t) + 1u;
  for (var k = 0u; k < n; k++) {
    let slot = u32(tables[row + k / BS]) * BS + k % BS;
    let base = (slot * KVH + kh) * HD4;
    var s = 0.0;
    for (var d = 0u; d < HD4; d++) { s += dot(qv[d], kc[base + d]); }
    let mn = max(m, s);
    let c = exp(m - mn);
    let e = exp(s - mn);
    l = l * c + e;
    for (var d = 0u; d < HD4; d++) { acc[d] = acc[d] * c + e * vc[base + d]; }
    m = mn;
  }
  for (var d = 0u; d < HD4; d++) { o[(t * HEADS + h) * HD4 + d] = acc[d] / l; }
}
"""

# silu(gate) * up over (T, 2I) -> (T, I). p: a = I.
SILU_MUL = HEADER + """
@group(0) @binding(2) var<storage, read> gu: array<f32>;
@group(0) @binding(3) var<storage, read_write> act: array<f32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let i = gid.x;
  if (i >= st.tokens * p.a) { return; }
  let t = i / p.a;
  let j = i % p.a;
  let g = gu[t * 2u * p.a + j];
  act[i] = g / (1.0 + exp(-g)) * gu[t * 2u * p.a + p.a + j];
}
"""

# Philox4x32-10 (engine/random_stream.py) in u32 ops: WGSL has no 64-bit integers, so each
# 32 x 32 -> 64-bit product is put together from 16-bit halves.
PHILOX = """
fn mulhilo(a: u32, b: u32) -> vec2<u32> {
  let a0 = a & 0xffffu;
  let a1 = a >> 16u;
  let b0 = b & 0xffffu;
  let b1 = b >> 16u;
  let p01 = a0 * b1;
  let p10 = a1 * b0;
  let mid = ((a0 * b0) >> 16u) + (p01 & 0xffffu) + (p10 & 0xffffu);
  return vec2<u32>(a1 * b1 + (p01 >> 16u) + (p10 >> 16u) + (mid >> 16u), a * b);
}

fn philox(counter: vec4<u32>, key: vec2<u32>) -> vec4<u32> {
  var c = counter;
  var k = key;
  for (var r = 0u; r < 10u; r++) {
    if (r > 0u) { k = k + vec2<u32>(0x9E3779B9u, 0xBB67AE85u); }
    let p0 = mulhilo(0xD2511F53u, c.x);
    let p1 = mulhilo(0xCD9E8D57u, c.z);
    c = vec4<u32>(p1.x ^ c.y ^ k.x, p1.y, p0.x ^ c.w ^ k.y, p0.y);
  }
  return c;
}
"""

# Picks the token of each logit index the step marks (engine/sampler.py's rules, in float32),
# one workgroup of WG invocations per logit index, each over a contiguous chunk of the
# vocabulary; reductions go through workgroup memory. p: a = vocab. Per logit index, `pk`
# holds PICK_WORDS words: mode (0 host: left alone, 1 greedy, 2 sampled), the stream's key
# (low, high), choice and counter, temperature (f32 bits), top-k (0: none), top-p (f32 bits).
# Greedy: the first index of the largest logit. Sampled: top-k's threshold is the k-th
# largest logit, found bit by bit over order-preserving keys of the logits (a counting pass
# per bit); a sampled row's logits are then overwritten in place by their weights
# exp((z - max) / T) (zero below the threshold), whose f32 bits order them as well; top-p's
# threshold is the largest weight w with the mass of weights >= w at least top_p of the
# total (a summing pass per bit); either search stops once later bits cannot change the set
# it keeps. The token is the first, in id order, whose running sum of kept weights passes
# u * their total, u = Philox's first word's top 24 bits / 2^24.
PICK = HEADER + """
@group(0) @binding(2) var<storage, read_write> z: array<f32>;
@group(0) @binding(3) var<storage, read> pk: array<u32>;
@group(0) @binding(4) var<storage, read_write> ids: array<i32>;
""" + PHILOX + """
const WG: u32 = ${PICK_WG}u;
const V: u32 = ${VOCAB}u;
const CHUNK: u32 = (V + WG - 1u) / WG;
var<workgroup> red: array<f32, WG>;
var<workgroup> redu: array<u32, WG>;
var<workgroup> red2: array<vec2<f32>, WG>;
var<workgroup> found: atomic<u32>;
var<workgroup> last: atomic<u32>;

fn sum_f(v: f32, lid: u32) -> f32 {
  red[lid] = v;
  for (var s = WG / 2u; s > 0u; s >>= 1u) {
    workgroupBarrier();
    if (lid < s) { red[lid] += red[lid + s]; }
  }
  let r = workgroupUniformLoad(&red[0]);
  workgroupBarrier();
  return r;
}

fn max_f(v: f32, lid: u32) -> f32 {
  red[lid] = v;
  for (var s = WG / 2u; s > 0u; s >>= 1u) {
    workgroupBarrier();
    if (lid < s) { red[lid] = max(red[lid], red[lid + s]); }
  }
  let r = workgroupUniformLoad(&red[0]);
  workgroupBarrier();
  return r;
}

fn sum_2(v: vec2<f32>, lid: u32) -> vec2<f32> {
  red2[lid] = v;
  for (var s = WG / 2u; s > 0u; s >>= 1u) {
    workgroupBarrier();
    if (lid < s) { red2[lid] += red2[lid + s]; }
  }
  let r = workgroupUniformLoad(&red2[0]);
  workgroupBarrier();
  return r;
}

fn sum_u(v: u32, lid: u32) -> u32 {
  redu[lid] = v;
  for (var s = WG / 2u; s > 0u; s >>= 1u) {
    workgroupBarrier();
    if (lid < s) { redu[lid] += redu[lid + s]; }
  }
  let r = workgroupUniformLoad(&redu[0]);
  workgroupBarrier();
  return r;
}

fn min_u(v: u32, lid: u32) -> u32 {
  redu[lid] = v;
  for (var s = WG / 2u; s > 0u; s >>= 1u) {
    workgroupBarrier();
    if (lid < s) { redu[lid] = min(redu[lid], redu[lid + s]); }
  }
  let r = workgroupUniformLoad(&redu[0]);
  workgroupBarrier();
  return r;
}

// An order-preserving key of a float: a < b exactly when key(a) < key(b); -0 is 0.
fn order_key(x: f32) -> u32 {
  var b = bitcast<u32>(x);
  if (b == 0x80000000u) { b = 0u; }
  return select(b | 0x80000000u, ~b, (b & 0x80000000u) != 0u);
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let i = wid.x;
  if (i >= st.logits) { return; }
  let w = i * ${PICK_WORDS}u;
  let mode = pk[w];
  if (mode == 0u) { return; }
  let base = i * V;
  let v0 = min(lid * CHUNK, V);
  let v1 = min(v0 + CHUNK, V);

  var m = -3.4e38;
  var at = V;
  for (var v = v0; v < v1; v++) {
    let x = z[base + v];
    if (x > m) { m = x; at = v; }
  }
  let top = max_f(m, lid);
  let first = min_u(select(V, at, m == top), lid);
  if (mode == 1u) {
    if (lid == 0u) { ids[i] = i32(first); }
    return;
  }

  let temperature = bitcast<f32>(pk[w + 5u]);
  let top_k = pk[w + 6u];
  let top_p = bitcast<f32>(pk[w + 7u]);
  // Each search keeps the threshold t and the smallest rejected candidate `up`, with how
  // many tokens lie at or above each; once one token lies in [t, up), or (top-k) exactly k
  // at or above t, every later bit keeps the same set, and the search stops.
  var kth = 0u;
  if (top_k > 0u && top_k < V) {
    var at_t = V;
    var at_up = 0u;
    for (var b = 0u; b < 32u; b++) {
      let cand = kth | (0x80000000u >> b);
      var n = 0u;
      for (var v = v0; v < v1; v++) { n += select(0u, 1u, order_key(z[base + v]) >= cand); }
      let count = sum_u(n, lid);
      if (count >= top_k) { kth = cand; at_t = count; } else { at_up = count; }
      if (at_t == top_k || at_t - at_up == 1u) { break; }
    }
  }
  var s = 0.0;
  for (var v = v0; v < v1; v++) {
    let x = z[base + v];
    var e = 0.0;
    if (order_key(x) >= kth) { e = exp((x - top) / temperature); }
    z[base + v] = e;
    s += e;
  }
  let total = sum_f(s, lid);
  var cut = 0u;
  if (top_p < 1.0) {
    let need = top_p * total;
    var at_t = f32(V);
    var at_up = 0.0;
    for (var b = 2u; b < 32u; b++) {  // weights lie in [0, 1]: their top two bits are 0
      let cand = cut | (0x80000000u >> b);
      var part = vec2<f32>(0.0);  // mass and count at or above the candidate
      for (var v = v0; v < v1; v++) {
        let e = z[base + v];
        if (bitcast<u32>(e) >= cand) { part += vec2<f32>(e, 1.0); }
      }
      let got = sum_2(part, lid);
      if (got.x >= need) { cut = cand; at_t = got.y; } else { at_up = got.y; }
      if (at_t - at_up == 1.0) { break; }
    }
  }

  var mine = 0.0;
  var last_here = 0u;
  for (var v = v0; v < v1; v++) {
    let e = z[base + v];
    if (bitcast<u32>(e) >= cut && e > 0.0) { mine += e; last_here = v; }
  }
  if (lid == 0u) { atomicStore(&found, 0xffffffffu); atomicStore(&last, 0u); }
  red[lid] = mine;
  workgroupBarrier();
  var before = 0.0;
  for (var t = 0u; t < lid; t++) { before += red[t]; }
  var kept = before;
  for (var t = lid; t < WG; t++) { kept += red[t]; }
  let c = philox(vec4<u32>(pk[w + 4u], 0u, pk[w + 3u], 0u), vec2<u32>(pk[w + 1u], pk[w + 2u]));
  let goal = f32(c.x >> 8u) * (1.0 / 16777216.0) * kept;
  if (mine > 0.0) {
    atomicMax(&last, last_here);
    if (before <= goal && goal < before + mine) {
      var run = before;
      var pick = last_here;
      for (var v = v0; v < v1; v++) {
        let e = z[base + v];
        if (bitcast<u32>(e) >= cut && e > 0.0) {
          run += e;
          if (run > goal) { pick = v; break; }
        }
      }
      atomicMin(&found, pick);
    }
  }
  workgroupBarrier();
  if (lid == 0u) {
    let f = atomicLoad(&found);
    ids[i] = i32(select(f, atomicLoad(&last), f == 0xffffffffu));
  }
}
"""

# ---- the Mamba family (engine/models/mamba.py) ----------------------------------------------
# A step's tokens come in row segments (each row's tokens contiguous, each row once), so a
# token's predecessors in its own sequence are the tokens just before it with the same row
# slot; older inputs come from the row's state slot. Each layer's conv state is (rows,
# d_conv - 1, d_inner), its SSM state (rows, d_inner, d_state).
MAMBA_SIZES = """
const DI: u32 = ${DI}u;
const KC: u32 = ${KC}u;
const DS: u32 = ${DS}u;
const W: u32 = ${W}u;
const R: u32 = ${R}u;
// How many tokens before t in its row's segment, counted up to KC.
fn back(t: u32) -> u32 {
  let r = row_slot(t);
  var n = 0u;
  while (n < KC && t > n && row_slot(t - n - 1u) == r) { n++; }
  return n;
}
"""


def _per_channel(buffers: list[tuple[str, str, bool]], body: str) -> str:
    """A Mamba kernel run once per (token t, channel c) of the step, over storage `buffers`
    (name, element type, written) bound from 2 on, in the order given."""
    decl = "\n".join(f"@group(0) @binding({i}) var<storage, {'read_write' if w else 'read'}> {name}: array<{elem}>;"
                     for i, (name, elem, w) in enumerate(buffers, start=2))
    return HEADER + decl + INDEX + MAMBA_SIZES + """
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let i = gid.x;
  if (i >= st.tokens * DI) { return; }
  let t = i / DI;
  let c = i % DI;
  let r = row_slot(t);
""" + body + "}\n"


# The causal depthwise convolution, then SiLU. Tap j reads window[li + j] of [the row's
# last KC - 1 inputs, the segment's inputs], li being the token's index in its segment.
# xz holds (T, 2 DI): the inputs x, then the gate z.
_CONV_BUFFERS = [("xz", "f32", False), ("ix", "i32", False), ("cw", "f32", False), ("cb", "f32", False),
                 ("cs", "f32", False), ("xs", "f32", True)]
MAMBA_CONV = _per_channel(_CONV_BUFFERS, """
  let li = back(t);
  var acc = cb[c];
  for (var j = 0u; j < KC; j++) {
    let at = li + j;  // window index; the segment's inputs start at KC - 1
    var v = 0.0;
    if (at >= KC - 1u) { v = xz[(t + at + 1u - KC - li) * 2u * DI + c]; }
    else { v = cs[(r * (KC - 1u) + at) * DI + c]; }
    acc += v * cw[c * KC + j];
  }
  xs[i] = acc / (1.0 + exp(-acc));
""")

# The conv state after the step: each row's last KC - 1 inputs, written by the invocation of
# its segment's last token, per channel, in increasing order (slot s reads window index
# n + s > s, which no earlier write touched).
_CONV_STATE_BUFFERS = [("xz", "f32", False), ("ix", "i32", False), ("cs", "f32", True)]
MAMBA_CONV_STATE = _per_channel(_CONV_STATE_BUFFERS, """
  if (t + 1u < st.tokens && row_slot(t + 1u) == r) { return; }
  let n = back(t) + 1u;  // the segment's length, up to KC
  for (var s = 0u; s < KC - 1u; s++) {
    let at = n + s;
    var v = 0.0;
    if (at >= KC - 1u) { v = xz[(t + s + 2u - KC) * 2u * DI + c]; }
    else { v = cs[(r * (KC - 1u) + at) * DI + c]; }
    cs[(r * (KC - 1u) + s) * DI + c] = v;
  }
""")

# The selective scan, the skip term and the gate: the invocation of each segment's first
# token runs the segment's tokens in order from the row's state and stores it back. dbc
# holds (T, W): dt's low-rank input (R), B (DS), C (DS), zero padding; dtr holds dt_proj's
# output (T, DI); prm holds dt_bias (DI), D (DI) and A (DI, DS). y = (h . C + D x) * silu(z).
_SCAN_BUFFERS = [("xs", "f32", False), ("dbc", "f32", False), ("dtr", "f32", False), ("ix", "i32", False),
                 ("prm", "f32", False), ("xz", "f32", False), ("ssm", "f32", True), ("y", "f32", True)]
MAMBA_SCAN = _per_channel(_SCAN_BUFFERS, """
  if (t > 0u && row_slot(t - 1u) == r) { return; }
  var h: array<f32, DS>;
  var a: array<f32, DS>;
  for (var s = 0u; s < DS; s++) { h[s] = ssm[(r * DI + c) * DS + s]; a[s] = prm[2u * DI + c * DS + s]; }
  let bias = prm[c];
  let skip = prm[DI + c];
  for (var u = t; u < st.tokens && row_slot(u) == r; u++) {
    let raw = dtr[u * DI + c] + bias;
    let dt = max(raw, 0.0) + log(1.0 + exp(-abs(raw)));  // softplus, without overflow
    let xv = xs[u * DI + c];
    var out = xv * skip;
    for (var s = 0u; s < DS; s++) {
      h[s] = exp(dt * a[s]) * h[s] + dt * xv * dbc[u * W + R + s];
      out += h[s] * dbc[u * W + R + DS + s];
    }
    let z = xz[u * 2u * DI + DI + c];
    y[u * DI + c] = out * z / (1.0 + exp(-z));
  }
  for (var s = 0u; s < DS; s++) { ssm[(r * DI + c) * DS + s] = h[s]; }
""")


def _layout(buffers: list[tuple[str, str, bool]]) -> str:
    """A kernel's bind group layout as the driver spells it: the two uniforms, then r (read)
    or w (written) per storage buffer."""
    return "uu" + "".join("w" if written else "r" for _, _, written in buffers)


# The Mamba kernels' sources and bind group layouts, from one list of buffers each.
MAMBA_KERNELS = {"conv": (MAMBA_CONV, _layout(_CONV_BUFFERS)),
                 "conv_state": (MAMBA_CONV_STATE, _layout(_CONV_STATE_BUFFERS)),
                 "scan": (MAMBA_SCAN, _layout(_SCAN_BUFFERS))}
